"""The distillation stages: teacher prefill (phase ``teacher``) and student prefill (``student``).

For every staged sample the stage sends SGLang's prefill request (:func:`prefill_payload`:
``input_ids`` = prompt + response, ``max_new_tokens`` 0, ``return_logprob`` from
``logprob_start_len = prompt_len - 1``, and ``top_logprobs_num = k`` in top-k mode), checks the
answer (:func:`parse_prefill`: exactly response length + 1 input log-probs) and writes the
fields: ``teacher_logprobs`` (and ``teacher_topk_ids`` / ``teacher_topk_logprobs``), or
``student_logprobs`` for the student stage.

Routing: the model comes from the sample's ``metadata["route_key"]`` (the role's route-key
map); each group is pinned to one replica — resolved once per group with ``affinity_key`` =
the group id, and every sample of the group sent there — so a group is scored by one teacher
replica whatever the role's policy. One client per event loop, reused across samples
(:class:`~relax_core.coordination.stages.RoleClients`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import attrs

from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import StageContext, StageReport
from relax_core.errors import RelaxError, ScoringError, UpstreamError

__all__ = ["DistillationStage", "PrefillResult", "parse_prefill", "prefill_payload"]


def prefill_payload(
    prompt_ids: Sequence[int],
    response_ids: Sequence[int],
    *,
    top_k: int = 0,
    token_ids_logprob: Sequence[int] | None = None,
) -> dict[str, Any]:
    """The ``/generate`` body scoring ``response_ids`` after ``prompt_ids``.

    No token is generated (``max_new_tokens`` 0); log-probs start at the last prompt position
    so every response token gets one.

    :raises ValueError: an empty prompt or response.
    """
    if not prompt_ids or not response_ids:
        raise ValueError("prefill_payload: prompt_ids and response_ids must both be non-empty")
    body: dict[str, Any] = {
        "input_ids": [int(i) for i in (*prompt_ids, *response_ids)],
        "sampling_params": {"temperature": 0.0, "max_new_tokens": 0, "skip_special_tokens": False},
        "return_logprob": True,
        "logprob_start_len": max(len(prompt_ids) - 1, 0),
    }
    if top_k:
        body["top_logprobs_num"] = int(top_k)
    if token_ids_logprob is not None:
        body["token_ids_logprob"] = [int(i) for i in token_ids_logprob]
    return body


@attrs.frozen
class PrefillResult:
    """Log-probs of each response token, and the top-k (token id, log-prob) per position."""

    logprobs: tuple[float, ...]
    top_ids: tuple[tuple[int, ...], ...]
    top_logprobs: tuple[tuple[float, ...], ...]


def parse_prefill(answer: Any, response_len: int) -> PrefillResult:
    """Check and unpack a prefill answer for a response of ``response_len`` tokens.

    The engine returns one input log-prob per position from ``logprob_start_len``: response
    length + 1 (the first is the last prompt position's own, with no log-prob).

    :raises UpstreamError: (502) the answer does not have that shape.
    """
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        meta = {}
    lps = meta.get("input_token_logprobs")
    if not isinstance(lps, list) or len(lps) != response_len + 1:
        got = len(lps) if isinstance(lps, list) else None
        raise UpstreamError(
            502,
            f"prefill answer has {got} input log-probs, expected response length + 1 = "
            f"{response_len + 1}; check logprob_start_len = prompt_len - 1",
        )
    try:
        logprobs = tuple(float(entry[0]) for entry in lps[1:])
        tops = meta.get("input_top_logprobs") or []
        tops = tops[1:] if len(tops) == response_len + 1 else []
        top_ids = tuple(tuple(int(e[1]) for e in pos or ()) for pos in tops)
        top_lps = tuple(tuple(float(e[0]) for e in pos or ()) for pos in tops)
    except (TypeError, ValueError, IndexError) as exc:
        raise UpstreamError(502, f"prefill answer has a malformed log-prob entry: {exc}") from exc
    return PrefillResult(logprobs=logprobs, top_ids=top_ids, top_logprobs=top_lps)


class DistillationStage:
    """Prefill every staged sample on ``role``'s engines and write the log-prob fields.

    :param role: the role to prefill on (the teacher role; the generation role with
        ``student=True``).
    :param top_k: teacher top-k width (0: sampled-token log-probs only).
    :param student: write ``student_logprobs`` (phase ``student``) instead of teacher fields.
    :param concurrency: prefill requests in flight at once.
    :param timeout: deadline of one prefill request (``None``: the client's).
    """

    def __init__(
        self,
        role: str,
        *,
        name: str | None = None,
        top_k: int = 0,
        student: bool = False,
        concurrency: int = 64,
        timeout: float | None = None,
    ) -> None:
        if top_k < 0 or (student and top_k):
            raise ValueError(f"top_k={top_k!r}: >= 0, and 0 for a student stage")
        self.role = role
        self.name = name or ("student" if student else role)
        self.phase = "student" if student else "distill"
        self.top_k = int(top_k)
        self.student = student
        self.concurrency = concurrency
        self.timeout = timeout
        if student:
            self.writes = frozenset({"student_logprobs"})
        elif top_k:
            self.writes = frozenset(
                {"teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs"}
            )
        else:
            self.writes = frozenset({"teacher_logprobs"})

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        """Prefill ``samples`` in place (concurrently); raise on the first failure."""
        client = ctx.clients.client(self.role)
        gate = asyncio.Semaphore(self.concurrency)
        targets: dict[tuple[str, str | None], asyncio.Future[Any]] = {}

        def target_of(sample: Sample) -> asyncio.Future[Any]:
            # One routing decision per group (and route key): the group's replica.
            key = (sample.group_id, sample.route_key)
            fut = targets.get(key)
            if fut is None:
                fut = targets[key] = asyncio.ensure_future(
                    client.resolve(route_key=sample.route_key, affinity_key=sample.group_id)
                )
            return fut

        async def one(sample: Sample) -> None:
            async with gate:
                try:
                    target = await target_of(sample)
                    payload = prefill_payload(
                        sample.prompt_ids, sample.response_ids, top_k=self.top_k
                    )
                    answer = await client.post(
                        "/generate",
                        payload,
                        affinity_key=sample.group_id,
                        target=target,
                        timeout=self.timeout,
                    )
                    result = parse_prefill(answer, len(sample.response_ids))
                except (RelaxError, ValueError) as exc:
                    raise ScoringError(
                        self.name,
                        f"prefill of sample {sample.id} (group {sample.group_id}) on role "
                        f"{self.role!r}: {type(exc).__name__}: {exc}",
                    ) from exc
            if self.student:
                sample.student_logprobs = result.logprobs
                return
            sample.teacher_logprobs = result.logprobs
            if self.top_k:
                sample.teacher_topk_ids = result.top_ids
                sample.teacher_topk_logprobs = result.top_logprobs

        tasks = [asyncio.ensure_future(one(s)) for s in samples]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in (*tasks, *targets.values()):
                t.cancel()
            await asyncio.gather(*tasks, *targets.values(), return_exceptions=True)
        engines = {gid: fut.result().engine_id for (gid, _), fut in targets.items()}
        return StageReport(
            self.name,
            {"requests": len(samples), "groups": len({s.group_id for s in samples})},
            {"group_engines": engines},
        )
