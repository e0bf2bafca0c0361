"""The distillation stages: teacher prefill (kind ``distill``) and student prefill (``student``).

For every staged sample the stage sends SGLang's prefill request (:func:`prefill_payload`:
``input_ids`` = prompt + response, ``max_new_tokens`` 0, ``return_logprob`` from
``logprob_start_len = prompt_len - 1``, and ``top_logprobs_num = k`` in top-k mode), checks the
answer (:func:`parse_prefill`: exactly response length + 1 input log-probs) and writes the
fields it declares: ``teacher_logprobs`` (and ``teacher_topk_ids`` / ``teacher_topk_logprobs``
with ``top_k``), or ``student_logprobs`` for the student stage — for a multi-turn trajectory
only at the policy's own tokens (loss mask 1; the environment's tokens are prefilled as
context and carry 0.0, :func:`policy_tokens_only`) — each validated by the batch
before anything is written back (one finite log-prob <= 0 per response token; top-k rows of k
ids and k sorted log-probs).

Routing: the model comes from the sample's ``metadata["route_key"]`` (the role's route-key
map); each group is pinned to one replica — resolved once per group with ``affinity_key`` =
the group id, and every sample of the group sent there — so a group is scored by one teacher
replica whatever the role's policy. One client per event loop, reused across samples
(:class:`~relax_core.RoleClients`).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import operator
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from relax_core import (
    ConfigReader,
    RelaxError,
    Sample,
    SampleField,
    ScoringError,
    StageConfig,
    StageContext,
    StageReport,
    StageSpec,
    UpstreamError,
    hookimpl,
)

__all__ = [
    "DISTILL",
    "STUDENT",
    "STUDENT_LOGPROBS",
    "TEACHER_LOGPROBS",
    "TEACHER_MODES",
    "DistillationStage",
    "PrefillResult",
    "parse_prefill",
    "policy_tokens_only",
    "prefill_payload",
    "teacher_topk_fields",
]

#: ``mode`` values of a distill stage: the teacher's log-prob of each sampled token, or its
#: top-k at each position.
TEACHER_MODES = ("sampled", "top-k")


def _fine(values: Any) -> bool:
    """Fast path (C loops): every value a finite number <= 0. False means "look closer"."""
    if not values:
        return True
    try:
        return bool(max(values) <= 0 and math.isfinite(math.fsum(values)))
    except (TypeError, ValueError, OverflowError):
        return False


def _logprob_problem(values: object, tokens: int, field: str) -> str | None:
    if not isinstance(values, tuple | list):
        return f"{field} is missing ({type(values).__name__})"
    if len(values) != tokens:
        return f"{field} has {len(values)} entries for {tokens} response tokens (one per token)"
    if _fine(values):
        return None
    for i, v in enumerate(values):
        if not isinstance(v, float | int) or not math.isfinite(v) or v > 0:
            return f"{field}[{i}] = {v!r} is not a finite log-prob <= 0"
    return None


def _topk_fine(ids: Sequence[Any], lps: Sequence[Any], k: int) -> bool:
    """Fast path (C loops over every row at once; a Python loop per row over a step's 256
    samples x ~120 positions was most of a GPU step's 46-85 ms of validation): each row a list
    or tuple of ``k``; the ids ints >= 0; the log-probs each row sorted descending, its first
    <= 0, their sum finite (so each is). False means "look row by row"."""
    if not ids or len(ids) != len(lps) or {*map(type, ids), *map(type, lps)} - {list, tuple}:
        return False
    if {*map(len, ids), *map(len, lps)} != {k}:
        return False
    flat = list(itertools.chain.from_iterable(ids))
    if list(map(type, flat)).count(int) != len(flat) or min(flat) < 0:
        return False
    values = list(itertools.chain.from_iterable(lps))
    try:
        if not math.isfinite(sum(values)) or max(map(operator.itemgetter(0), lps)) > 0:
            return False
    except TypeError:
        return False
    # each value >= the next one, but across two rows
    ordered = list(map(operator.ge, values, itertools.islice(values, 1, None)))
    ordered[k - 1 :: k] = [True] * len(ordered[k - 1 :: k])
    return all(ordered)


def _topk_problem(ids: object, lps: object, tokens: int, k: int) -> str | None:
    for name, rows in (("teacher_topk_ids", ids), ("teacher_topk_logprobs", lps)):
        if not isinstance(rows, tuple | list):
            return f"{name} is missing ({type(rows).__name__})"
        if len(rows) != tokens:
            return f"{name} has {len(rows)} rows for {tokens} response tokens"
    assert isinstance(ids, tuple | list) and isinstance(lps, tuple | list)
    if _topk_fine(ids, lps, k):
        return None
    for t, (id_row, lp_row) in enumerate(zip(ids, lps, strict=True)):
        if not isinstance(id_row, tuple | list) or len(id_row) != k:
            return f"teacher_topk_ids[{t}] is not {k} ids (shape [tokens, {k}])"
        if not isinstance(lp_row, tuple | list) or len(lp_row) != k:
            return f"teacher_topk_logprobs[{t}] is not {k} log-probs (shape [tokens, {k}])"
        for j, i in enumerate(id_row):
            if type(i) is not int or i < 0:
                return f"teacher_topk_ids[{t}][{j}] = {i!r} is not a token id"
        if _fine(lp_row) and list(lp_row) == sorted(lp_row, reverse=True):
            continue
        prev = math.inf
        for j, v in enumerate(lp_row):
            if not isinstance(v, float | int) or not math.isfinite(v) or v > 0:
                return f"teacher_topk_logprobs[{t}][{j}] = {v!r} is not a finite log-prob <= 0"
            if v > prev:
                return f"teacher_topk_logprobs[{t}] is not sorted descending (at {j})"
            prev = v
    return None


def _per_token(field: str) -> Callable[[Any, Sample], str | None]:
    def check(value: Any, sample: Sample) -> str | None:
        return _logprob_problem(value, len(sample.response_ids), field)

    return check


#: The teacher's log-prob of each sampled response token.
TEACHER_LOGPROBS = SampleField(
    "teacher_logprobs",
    _per_token("teacher_logprobs"),
    "the teacher's log-prob of each response token",
)
#: The policy's own log-prob of each response token, prefilled again (a student stage).
STUDENT_LOGPROBS = SampleField(
    "student_logprobs",
    _per_token("student_logprobs"),
    "the policy's log-prob of each response token, prefilled after generation",
)


@functools.cache
def teacher_topk_fields(k: int) -> tuple[SampleField, SampleField]:
    """The teacher's top-``k`` fields (``[response tokens][k]`` ids and log-probs); one pair
    per ``k``, so two stages of one ``k`` declare the same fields."""

    def check(lps: Any, sample: Sample) -> str | None:
        ids = sample.fields.get("teacher_topk_ids")
        return _topk_problem(ids, lps, len(sample.response_ids), k)

    ids = SampleField("teacher_topk_ids", None, f"the teacher's top-{k} token ids per position")
    lps = SampleField("teacher_topk_logprobs", check, "their log-probs, sorted descending")
    return ids, lps


def policy_tokens_only(sample: Sample, logprobs: tuple[float, ...]) -> tuple[float, ...]:
    """``logprobs`` kept for the policy's own tokens of ``sample`` (loss mask 1) and 0.0 for
    an environment's or a tool's (mask 0): those are prefilled as context — the teacher reads
    the whole trajectory — but they are not the policy's, so nothing is distilled on them (the
    trainer masks them too). A sample without a mask keeps every log-prob."""
    if not sample.loss_mask:
        return logprobs
    return tuple(lp if m else 0.0 for lp, m in zip(logprobs, sample.loss_mask, strict=True))


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
    :param models: the role's models it uses (only those are onloaded for it; empty: all).
    :param top_k: teacher top-k width (0: sampled-token log-probs only).
    :param student: write ``student_logprobs`` instead of teacher fields.
    :param concurrency: prefill requests in flight at once.
    :param timeout: deadline of one prefill request (``None``: the client's).
    :param retries: how many times a prefill that failed for a transport reason or a 5xx is
        sent again (a prefill is idempotent), on another replica when there is one, the role's
        dead replicas rebuilt first (``StageContext.retrying``).
    """

    #: each sample is prefilled on its own: the async driver may prefill each group as it
    #: completes (never a student stage: it needs the generation role's lease)
    streaming = True

    def __init__(
        self,
        role: str,
        *,
        name: str | None = None,
        models: Sequence[str] = (),
        top_k: int = 0,
        student: bool = False,
        concurrency: int = 64,
        timeout: float | None = None,
        retries: int = 0,
    ) -> None:
        if top_k < 0 or (student and top_k):
            raise ValueError(f"top_k={top_k!r}: >= 0, and 0 for a student stage")
        self.role = role
        self.models = tuple(models)
        self.name = name or ("student" if student else role)
        self.top_k = int(top_k)
        self.student = student
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        self.fields: tuple[SampleField, ...]
        if student:
            self.fields = (STUDENT_LOGPROBS,)
        elif top_k:
            self.fields = (TEACHER_LOGPROBS, *teacher_topk_fields(self.top_k))
        else:
            self.fields = (TEACHER_LOGPROBS,)

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        """Prefill ``samples`` in place (concurrently); raise on the first failure."""
        client = ctx.clients.client(self.role)
        model = self.models[0] if len(self.models) == 1 else None
        gate = asyncio.Semaphore(self.concurrency)
        targets: dict[tuple[str, str | None], asyncio.Future[Any]] = {}
        #: group -> the replica its last prefill went to
        engines: dict[str, str] = {}

        def target_of(sample: Sample) -> asyncio.Future[Any]:
            # One routing decision per group (and route key): the group's replica.
            key = (sample.group_id, sample.route_key)
            fut = targets.get(key)
            # a resolution that failed (the role not READY while its replica is rebuilt) is
            # not kept: the next sample of the group resolves anew
            if fut is None or (fut.done() and (fut.cancelled() or fut.exception() is not None)):
                fut = targets[key] = asyncio.ensure_future(
                    client.resolve(
                        model=model, route_key=sample.route_key, affinity_key=sample.group_id
                    )
                )
            return fut

        async def one(sample: Sample) -> None:
            async with gate:
                try:
                    payload = prefill_payload(
                        sample.prompt_ids, sample.response_ids, top_k=self.top_k
                    )
                    tried: list[str] = []
                    sent: list[int] = []

                    async def send() -> Any:
                        sent.append(1)
                        if len(sent) == 1:  # the group's replica first
                            target = await target_of(sample)
                        else:  # a retry, resolved anew: another replica when there is one
                            target = await client.resolve(
                                model=model,
                                route_key=sample.route_key,
                                affinity_key=sample.group_id,
                                avoid=tried,
                            )
                        tried.append(target.url)
                        engines[sample.group_id] = target.engine_id
                        return await client.post(
                            "/generate",
                            payload,
                            affinity_key=sample.group_id,
                            target=target,
                            timeout=self.timeout,
                        )

                    answer = await ctx.retrying(
                        send, stage=self.name, role=self.role, retries=self.retries
                    )
                    result = parse_prefill(answer, len(sample.response_ids))
                except (RelaxError, ValueError) as exc:
                    raise ScoringError(
                        self.name,
                        f"prefill of sample {sample.id} (group {sample.group_id}) on role "
                        f"{self.role!r}: {type(exc).__name__}: {exc}",
                    ) from exc
            fields = sample.fields
            logprobs = policy_tokens_only(sample, result.logprobs)
            if self.student:
                fields["student_logprobs"] = logprobs
                return
            fields["teacher_logprobs"] = logprobs
            if self.top_k:
                fields["teacher_topk_ids"] = result.top_ids
                fields["teacher_topk_logprobs"] = result.top_logprobs

        tasks = [asyncio.ensure_future(one(s)) for s in samples]
        try:
            await asyncio.gather(*tasks)
        finally:
            for t in (*tasks, *targets.values()):
                t.cancel()
            await asyncio.gather(*tasks, *targets.values(), return_exceptions=True)
        return StageReport(
            self.name,
            {"requests": len(samples), "groups": len({s.group_id for s in samples})},
            {"group_engines": engines},
        )


def build_distill(config: StageConfig) -> DistillationStage:
    """The ``distill`` kind: the teacher's prefill on ``role`` (``mode`` ``sampled`` or
    ``top-k``, ``top_k`` (8) in top-k mode, ``concurrency``).

    :raises ConfigValidationError: every problem of its table.
    """
    r = ConfigReader()
    o, p = config.options, config.path
    mode = r.value(o, p, "mode", str, "sampled", check=ConfigReader.one_of(TEACHER_MODES))
    top_k = r.value(o, p, "top_k", int, 8, check=ConfigReader.at_least(1))
    if "top_k" in o and mode != "top-k":
        r.problem(config.key("top_k"), "teacher-mode", "top_k applies to mode = 'top-k' only")
    concurrency = r.value(o, p, "concurrency", int, 64, check=ConfigReader.at_least(1))
    if config.role is not None and config.role == config.generation_role:
        r.problem(
            config.key("role"),
            "generation-role",
            f"{config.role!r} generates the batch; a teacher prefill runs on another role (a "
            "prefill on the policy itself is stage = 'student')",
        )
    r.raise_problems()
    assert config.role is not None
    return DistillationStage(
        config.role,
        name=config.name,
        models=config.models,
        top_k=top_k if mode == "top-k" else 0,
        concurrency=concurrency,
        timeout=config.run.request_timeout,
        retries=config.retries,
    )


def build_student(config: StageConfig) -> DistillationStage:
    """The ``student`` kind: the policy's own prefill (its role, the generation role, restored
    for it), writing ``student_logprobs``; ``concurrency``.

    :raises ConfigValidationError: its role is not the generation role.
    """
    r = ConfigReader()
    concurrency = r.value(
        config.options, config.path, "concurrency", int, 64, check=ConfigReader.at_least(1)
    )
    role = config.role or config.generation_role
    if role is None or role != config.generation_role:
        r.problem(
            config.key("role"),
            "generation-role",
            f"a student prefill runs on the role that generates the batch "
            f"({config.generation_role!r}), not {role!r}",
        )
    r.raise_problems()
    assert role is not None
    return DistillationStage(
        role,
        name=config.name,
        student=True,
        concurrency=concurrency,
        timeout=config.run.request_timeout,
        retries=config.retries,
    )


#: The teacher's prefill for on-policy distillation.
DISTILL = StageSpec(
    name="distill",
    build=build_distill,
    options=("mode", "top_k", "concurrency"),
    needs_role=True,
    # a prefill is idempotent: one that failed for a transport reason or a 5xx is sent again
    retries=2,
    description="Teacher prefill: teacher_logprobs, or its top-k (teacher_topk_ids/_logprobs).",
)
#: The policy's own prefill after generation.
STUDENT = StageSpec(
    name="student",
    build=build_student,
    options=("concurrency",),
    retries=2,
    description="The policy's own prefill, its weights restored for it: student_logprobs.",
)


@hookimpl
def relax_register_stages(register: Callable[[StageSpec], None]) -> None:
    """Register the ``distill`` and ``student`` stage kinds."""
    register(DISTILL)
    register(STUDENT)
