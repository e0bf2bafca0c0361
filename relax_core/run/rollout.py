"""Rollout shapes: how one prompt of a step becomes one group of samples (a
:class:`~relax_core.records.RolloutShapeSpec` named by ``[run.generation] shape``)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from relax_core.client.client import InferenceClient
from relax_core.config import ConfigReader
from relax_core.coordination.sample import Sample
from relax_core.errors import ConfigProblem, ConfigValidationError, PluginError, UpstreamError
from relax_core.records import PluginLookup, RolloutShapeSpec
from relax_core.run.config import GenerationTable, RunConfig
from relax_core.run.data import Prompt


def sampling_seed(seed: int, batch_id: int, index: int, *extra: int) -> int:
    """A sampling seed per (run seed, step, prompt[, sample, turn]): reproducible, different
    for each."""
    tail = "".join(f":{e}" for e in extra)
    return zlib.crc32(f"{seed}:{batch_id}:{index}{tail}".encode()) & 0x7FFFFFFF


@attrs.frozen
class GroupRequest:
    """One group to generate: ``group_id`` is ``b{batch_id}-p{index}``."""

    batch_id: int
    index: int
    group_id: str
    prompt: Prompt
    samples: int
    temperature: float
    seed: int

    def sample_id(self, j: int) -> str:
        """The id of the group's ``j``-th sample (``b0-p1-s2``)."""
        return f"{self.group_id}-s{j}"


@runtime_checkable
class RolloutShape(Protocol):
    """Turns one prompt into one group of samples; the step's producer awaits :meth:`group`
    once per group."""

    async def group(self, request: GroupRequest, client: InferenceClient) -> list[Sample]:
        """The group's samples, ``request.samples`` of them, each with ``request.group_id``.

        :raises RelaxError: the generation failed (the step fails; nothing is committed)."""
        ...


@attrs.frozen
class RolloutShapeConfig:
    """What a shape's builder gets: the ``[run.generation]`` table's own keys and key path, the
    run's settings, the plugins, and the generation model's name, directory and key path."""

    options: Mapping[str, Any]
    path: str
    run: RunConfig
    pm: PluginLookup
    model: str
    model_path: str
    model_where: str

    def key(self, option: str) -> str:
        """The key path of one of the table's keys (``run.generation.max_turns``)."""
        return f"{self.path}.{option}"


def build_rollout_shape(
    table: GenerationTable,
    run: RunConfig,
    pm: Any,
    *,
    model: str,
    model_path: str,
    model_where: str,
) -> RolloutShape:
    """The run's shape, built by its registered kind.

    :raises ConfigValidationError: every problem, each with its key path."""
    if problems := _kind_problems(table, pm):
        raise ConfigValidationError(problems, run.base)
    spec: RolloutShapeSpec = pm.rollout_shape(table.shape)
    config = RolloutShapeConfig(
        dict(table.options), table.path, run, pm, model, model_path, model_where
    )
    shape = spec.build(config)
    if not isinstance(shape, RolloutShape):
        why = f"rollout shape {table.shape!r} built a {type(shape).__name__}, which has no async "
        why += "group(request, client): a plugin bug"
        raise ConfigValidationError([ConfigProblem(f"{table.path}.shape", "shape", why)])
    return shape


def rollout_problems(
    table: GenerationTable, run: RunConfig, pm: Any, **model: str
) -> list[ConfigProblem]:
    """Every problem of the run's ``[run.generation]`` table (none: it builds);
    ``model``: as :func:`build_rollout_shape`'s."""
    try:
        build_rollout_shape(table, run, pm, **model)
    except ConfigValidationError as exc:
        return list(exc.problems)
    return []


def _kind_problems(table: GenerationTable, pm: Any) -> list[ConfigProblem]:
    try:
        spec: RolloutShapeSpec = pm.rollout_shape(table.shape)
    except PluginError as exc:
        return [ConfigProblem(f"{table.path}.shape", "shape", str(exc))]
    if spec.options is None:
        return []
    r = ConfigReader()
    r.table(dict(table.options), table.path, spec.options)
    return list(r.problems)


@attrs.frozen
class TurnAnswer:
    """One ``/generate`` answer of one sample (log-probs: the engine's own)."""

    output_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    finish: str | None
    weight_version: str | None
    #: the version boundaries of a sample a weight update reached mid-way (``(first token,
    #: version)``; empty: one version made it all)
    weight_versions: tuple[tuple[int, str], ...] = ()


def parse_answer(sample_id: str, answer: Any) -> TurnAnswer:
    """Check and unpack a ``/generate`` answer of one sample.

    :raises UpstreamError: (502) not a ``/generate`` answer, or without one log-prob per
        output token."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    output_ids = answer.get("output_ids") if isinstance(answer, dict) else None
    if not isinstance(meta, dict) or not isinstance(output_ids, list):
        raise UpstreamError(502, f"sample {sample_id}: not a /generate answer: {answer!r:.300}")
    lps = meta.get("output_token_logprobs")
    if not isinstance(lps, list) or len(lps) != len(output_ids):
        got = len(lps) if isinstance(lps, list) else None
        raise UpstreamError(
            502,
            f"sample {sample_id}: {got} output log-probs for {len(output_ids)} tokens; the "
            "rollout route must keep return_logprob",
        )
    version = meta.get("weight_version")
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    return TurnAnswer(
        tuple(int(i) for i in output_ids),
        tuple(float(e[0]) for e in lps),
        str(answer.get("text", "")),
        None if kind is None else str(kind),
        None if version is None else str(version),
        version_boundaries(sample_id, meta.get("weight_versions")),
    )


def version_boundaries(sample_id: str, spans: Any) -> tuple[tuple[int, str], ...]:
    """SGLang's ``meta_info.weight_versions`` (``[{version, start, end}]``) as a sample's
    version boundaries (``(first token, version)``); none when one version made it all."""
    if spans is None:
        return ()
    if not isinstance(spans, list) or not all(
        isinstance(e, dict) and isinstance(e.get("start"), int) and "version" in e for e in spans
    ):
        raise UpstreamError(
            502,
            f"sample {sample_id}: meta_info.weight_versions is not a list of spans: {spans!r:.200}",
        )
    if len(spans) <= 1:
        return ()
    return tuple((int(e["start"]), str(e["version"])) for e in spans)


def add_segments(segments: list[tuple[int, str | None]], start: int, answer: TurnAnswer) -> None:
    """Append an answer's version segments at its offset ``start`` in a sample's response
    (a segment of the version before it merged)."""
    for at, v in answer.weight_versions or ((0, answer.weight_version),):
        if not segments or segments[-1][1] != v:
            segments.append((start + at, v))


def boundaries(segments: list[tuple[int, str | None]]) -> tuple[tuple[int, str], ...]:
    """A sample's version boundaries (``Sample.weight_versions``) from its segments."""
    if len(segments) <= 1:
        return ()
    return tuple((at, "" if v is None else v) for at, v in segments)


#: How many times one answer is continued after an ``abort`` pause before the step fails: a
#: push every few tokens would otherwise re-send it for ever.
MAX_CONTINUATIONS = 8


async def continue_aborted(
    client: InferenceClient,
    body: Mapping[str, Any],
    answer: TurnAnswer,
    *,
    sample_id: str,
    affinity_key: str | None,
    timeout: float,
) -> TurnAnswer:
    """``answer`` to ``body`` (one sample), continued while a weight push's ``abort`` pause
    cut it short: the parts joined token-exact, each part's version kept as version
    boundaries.

    :raises UpstreamError: (502) an answer is malformed, or it was cut short more than
        :data:`MAX_CONTINUATIONS` times."""
    if answer.finish != "abort":
        return answer
    sampling = dict(body.get("sampling_params") or {})
    limit = int(sampling.get("max_new_tokens", 128))
    ids, lps, text = list(answer.output_ids), list(answer.logprobs), answer.text
    segments: list[tuple[int, str | None]] = []
    add_segments(segments, 0, answer)

    def joined(last: TurnAnswer, **finish: str) -> TurnAnswer:
        return attrs.evolve(
            last, output_ids=tuple(ids), logprobs=tuple(lps), text=text,
            weight_versions=boundaries(segments), **finish,
        )  # fmt: skip

    for k in range(1, MAX_CONTINUATIONS + 1):
        room = limit - len(ids)
        if room < 1:  # cut after its last token: it ended by length
            return joined(answer, finish="length")
        part = dict(sampling)
        part.update(n=1, max_new_tokens=room)
        if "min_new_tokens" in sampling:
            part["min_new_tokens"] = max(0, int(sampling["min_new_tokens"]) - len(ids))
        if sampling.get("sampling_seed") is not None:
            part["sampling_seed"] = sampling_seed(int(sampling["sampling_seed"]), k, len(ids))
        ask = {**body, "input_ids": [*body["input_ids"], *ids], "sampling_params": part}
        raw = await client.generate(ask, timeout=timeout, affinity_key=affinity_key)
        more = parse_answer(
            f"{sample_id} (continued {k})", raw[0] if isinstance(raw, list) else raw
        )
        add_segments(segments, len(ids), more)
        ids += more.output_ids
        lps += more.logprobs
        text += more.text
        answer = joined(more)
        if more.finish != "abort":
            return answer
    raise UpstreamError(
        502,
        f"sample {sample_id}: cut short by an abort {MAX_CONTINUATIONS + 1} times (pushes "
        "faster than it can finish a response?); use push_pause = 'in_place' or 'retract'",
    )
