"""Rollout shapes: how one prompt of a step becomes one group of samples.

A shape is a plugin of ``relax_register_rollout_shapes`` (a
:class:`~relax_core.records.RolloutShapeSpec`), named by ``[run.generation] shape``. The core
registers two: ``single-turn`` (the default: one ``/generate`` request per prompt asking for
``samples_per_prompt`` completions, :class:`~relax_core.run.generate.SingleTurn`) and
``multi-turn`` (each sample a trajectory of policy turns and an environment's observations,
:class:`~relax_core.agent.MultiTurn`).

The step's producer (:class:`~relax_core.run.generate.Generator`) calls
``await shape.group(request, client)`` once per prompt — the step's first groups and every
group a stage asks more of — with a :class:`GroupRequest` (the group's id, its prompt, how
many samples, the temperature, the sampling seed) and the generation role's
:class:`~relax_core.client.client.InferenceClient`; the shape returns the group's samples,
each with the group's id. What it raises fails the step (nothing of it is committed).

:func:`build_rollout_shape` builds the run's shape from its table; :func:`rollout_problems`
reports what is wrong with the table before anything starts.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from relax_core.client.client import InferenceClient
from relax_core.config import ConfigProblem, ConfigReader
from relax_core.coordination.sample import Sample
from relax_core.errors import ConfigValidationError, PluginError, UpstreamError
from relax_core.records import PluginLookup, RolloutShapeSpec
from relax_core.run.config import GenerationTable, RunConfig
from relax_core.run.data import Prompt

__all__ = [
    "DEFAULT_SHAPE",
    "GroupRequest",
    "RolloutShape",
    "RolloutShapeConfig",
    "TurnAnswer",
    "build_rollout_shape",
    "parse_answer",
    "rollout_problems",
    "sampling_seed",
]

#: The shape a run without ``[run.generation]`` generates with.
DEFAULT_SHAPE = "single-turn"


def sampling_seed(seed: int, batch_id: int, index: int, *extra: int) -> int:
    """A sampling seed per (run seed, step, prompt[, sample, turn]): reproducible, different
    for each."""
    tail = "".join(f":{e}" for e in extra)
    return zlib.crc32(f"{seed}:{batch_id}:{index}{tail}".encode()) & 0x7FFFFFFF


@attrs.frozen
class GroupRequest:
    """One group to generate: ``group_id`` (``b{batch_id}-p{index}``), its ``prompt`` (a
    dataset row), ``samples`` in it, the sampling ``temperature`` and ``seed``."""

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
    """Turns one prompt into one group of samples (see the module docstring)."""

    async def group(self, request: GroupRequest, client: InferenceClient) -> list[Sample]:
        """The group's samples, ``request.samples`` of them, each with ``request.group_id``.

        :raises RelaxError: the generation failed (the step fails; nothing is committed).
        """
        ...


@attrs.frozen
class RolloutShapeConfig:
    """What a shape's builder gets: the ``[run.generation]`` table's own keys (``options``) and
    its key path (``path``), the run's settings, the plugin manager, and the generation
    model's name, directory and key path (``roles.rollout.models.policy``)."""

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

    :raises ConfigValidationError: no such shape, an unknown option, or what its builder
        found wrong (each with its key path).
    """
    problems = _kind_problems(table, pm)
    if problems:
        raise ConfigValidationError(problems, run.base)
    spec: RolloutShapeSpec = pm.rollout_shape(table.shape)
    config = RolloutShapeConfig(
        options=dict(table.options),
        path=table.path,
        run=run,
        pm=pm,
        model=model,
        model_path=model_path,
        model_where=model_where,
    )
    shape = spec.build(config)
    if not isinstance(shape, RolloutShape):
        raise ConfigValidationError(
            [
                ConfigProblem(
                    f"{table.path}.shape",
                    "shape",
                    f"rollout shape {table.shape!r} built a {type(shape).__name__}, which has "
                    "no async group(request, client): a plugin bug",
                )
            ]
        )
    return shape


def rollout_problems(
    table: GenerationTable,
    run: RunConfig,
    pm: Any,
    *,
    model: str,
    model_path: str,
    model_where: str,
) -> list[ConfigProblem]:
    """Every problem of the run's ``[run.generation]`` table (none: it builds)."""
    try:
        build_rollout_shape(
            table, run, pm, model=model, model_path=model_path, model_where=model_where
        )
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
    """One ``/generate`` answer of one sample: the sampled ids, their log-probs (the engine's
    own, as it returned them), the text, the finish reason and the weight version."""

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
        output token.
    """
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
