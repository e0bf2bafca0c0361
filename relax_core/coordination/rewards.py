"""The reward stage: registered reward adapters (:class:`~relax_core.records.RewardSpec`) over a
staged batch, ``sync`` ones in Ray worker processes, ``async`` ones as coroutines with
``context=`` (:class:`RewardContext`). It writes :data:`REWARD_FIELDS`; an adapter that raises or
returns no finite number (or :class:`RewardResult`) fails the stage, naming it and the sample."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Sequence
from typing import Any, TypeGuard

import attrs

from relax_core._concurrent import gather_all
from relax_core.client.client import InferenceClient
from relax_core.coordination.retries import stage_deadline
from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import RoleClients, SampleField, StageContext, StageReport
from relax_core.errors import ScoringError
from relax_core.records import RewardSpec


def _finite(value: object) -> bool:
    return _number(value) and math.isfinite(value)


def _number(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_reward(value: object, sample: Sample) -> str | None:
    # Each adapter's value first: a non-finite sum names the adapter that made it so.
    for key, part in sample.rewards.items():
        if not _finite(part):
            return f"rewards[{key!r}] = {part!r} is not a finite number (adapter {key!r})"
    if not _finite(value):
        return f"reward = {value!r} is not a finite number"
    return None


def _check_rewards(value: object, sample: Sample) -> str | None:
    if not isinstance(value, dict) or not all(type(k) is str for k in value):
        return f"rewards = {value!r} is not a table of adapter key -> value"
    return None


#: The weighted sum of the reward adapters that scored a sample (every reward stage adds to it).
REWARD = SampleField(
    "reward",
    _check_reward,
    "the weighted sum of every reward adapter that scored the sample",
    missing="is missing (no reward adapter matched its label)",
)
#: Each reward adapter's value by its key (the adapter's name unless its stage gives another).
REWARDS = SampleField(
    "rewards", _check_rewards, "each reward adapter's value, by its key", required=False
)
#: What a reward stage writes.
REWARD_FIELDS = (REWARD, REWARDS)


@attrs.frozen
class RewardResult:
    """An adapter's answer for one sample: the reward and whether its source could be parsed."""

    value: float
    parse_failed: bool = False
    detail: str | None = None


@attrs.frozen
class RewardContext:
    """What an async adapter gets besides ``(response, label)``: the staged sample (read-only),
    the batch id, the loop's clients, and the stage's ``role`` and ``model`` (its one model)."""

    sample: Sample
    batch_id: int
    clients: RoleClients
    role: str | None = None
    model: str | None = None

    @property
    def prompt(self) -> str:
        """The prompt text."""
        return self.sample.prompt

    @property
    def route_key(self) -> str | None:
        """The sample's route key (``metadata["route_key"]``), if any."""
        return self.sample.route_key

    def client(self, role: str) -> InferenceClient:
        """The running loop's client of ``role`` (one per loop, reused across samples)."""
        return self.clients.client(role)


def _outcome(adapter: str, sample: Sample, value: object) -> RewardResult:
    """The adapter's answer for ``sample`` as a :class:`RewardResult`.

    :raises ScoringError: not a number or a ``RewardResult``, or not finite."""
    result = RewardResult(float(value)) if _number(value) else value
    if isinstance(result, RewardResult) and _finite(result.value):
        return result
    shown, rule = (
        (result.value, "a reward must be a finite number")
        if isinstance(result, RewardResult)
        else (value, "a reward adapter returns a number or a RewardResult")
    )
    raise ScoringError(
        adapter, f"returned {shown!r} for sample {sample.id} (group {sample.group_id}); {rule}"
    )


def _score_chunk(fn: Any, pass_metadata: bool, items: list[tuple[Any, ...]]) -> list[Any]:
    """Runs in a Ray worker: ``fn`` over ``(response, label, metadata)`` items; a failing item
    becomes ``("error", text)``."""
    out: list[Any] = []
    for response, label, metadata in items:
        try:
            out.append(
                fn(response, label, metadata=metadata) if pass_metadata else fn(response, label)
            )
        except Exception as exc:
            out.append(("error", f"{type(exc).__name__}: {exc}"))
    return out


@functools.cache
def _remote_scorer() -> Any:
    import ray

    return ray.remote(num_cpus=1, max_retries=0)(_score_chunk)


#: One adapter of a reward stage: a spec, ``(spec, weight)`` or ``(spec, weight, key)``.
AdapterEntry = RewardSpec | tuple[RewardSpec, float] | tuple[RewardSpec, float, str]


class RewardStage:
    """Scores every staged sample with ``adapters`` (fields :data:`REWARD_FIELDS`).

    :param adapters: :class:`~relax_core.records.RewardSpec` records, ``(spec, weight)`` or
        ``(spec, weight, key)`` (weight 1.0 and key the adapter's name by default); keys must
        be unique.
    :param role: the role the async adapters call (``None``: CPU-only adapters).
    :param models: the role's models the adapters use (with exactly one, ``context.model``).
    :param concurrency: async adapter calls in flight at once.
    :param sync_tasks: remote tasks a sync adapter's samples are split into.
    :param timeout: deadline of one adapter's whole pass, in seconds; a wait for the role's
        rebuild between two attempts does not count
        (:func:`~relax_core.coordination.retries.stage_deadline`).
    :param retries: retries of an async adapter's call for a sample (``None``: each adapter's
        own ``RewardSpec.retries``; :meth:`~relax_core.coordination.StageContext.retrying`).
    :raises ValueError: no adapters, a duplicate key, a weight that is not finite."""

    fields = REWARD_FIELDS
    #: each sample is scored on its own (:mod:`relax_core.run.streaming`)
    streaming = True

    def __init__(
        self,
        adapters: Sequence[AdapterEntry],
        *,
        name: str = "rewards",
        role: str | None = None,
        models: Sequence[str] = (),
        concurrency: int = 64,
        sync_tasks: int = 4,
        timeout: float = 600.0,
        retries: int | None = None,
    ) -> None:
        entries: list[tuple[RewardSpec, float, str]] = []
        for entry in adapters:
            parts: tuple[Any, ...] = entry if isinstance(entry, tuple) else (entry,)
            spec = parts[0]
            weight = parts[1] if len(parts) > 1 else 1.0
            key = parts[2] if len(parts) > 2 else None
            if not isinstance(spec, RewardSpec):
                raise ValueError(f"reward stage {name!r}: {spec!r} is not a RewardSpec")
            if not isinstance(weight, int | float) or not math.isfinite(weight):
                raise ValueError(f"reward stage {name!r}: weight of {spec.name!r} is {weight!r}")
            entries.append((spec, float(weight), key or spec.name))
        if not entries:
            raise ValueError(f"reward stage {name!r}: give at least one reward adapter")
        keys = [key for _, _, key in entries]
        if len(set(keys)) != len(keys):
            raise ValueError(f"reward stage {name!r}: adapter keys repeat: {keys}")
        self.name = name
        self.role = role
        self.models = tuple(models)
        self.adapters: tuple[tuple[RewardSpec, float, str], ...] = tuple(entries)
        self.concurrency = concurrency
        self.sync_tasks = sync_tasks
        self.timeout = timeout
        self.retries = retries

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        """Score ``samples`` in place; every adapter runs at once."""
        plans = []
        for spec, weight, key in self.adapters:
            matcher = spec.label_matcher
            chosen = [s for s in samples if matcher is None or matcher(s.label)]
            plans.append((spec, weight, key, chosen))
        passes = [self._pass(spec, chosen, ctx) for spec, _, _, chosen in plans]
        # a failed pass cancels the others: no judge request outlives the stage that failed
        outcomes = await gather_all(passes)
        counts: dict[str, float] = {}
        for (_spec, weight, key, chosen), results in zip(plans, outcomes, strict=True):
            failures = 0
            for sample, result in zip(chosen, results, strict=True):
                fields = sample.fields
                fields.setdefault("rewards", {})[key] = result.value
                fields["reward"] = (fields.get("reward") or 0.0) + weight * result.value
                failures += result.parse_failed
            counts[f"{key}.scored"] = len(chosen)
            counts[f"{key}.parse_failures"] = failures
        return StageReport(self.name, counts)

    async def _pass(
        self, spec: RewardSpec, chosen: list[Sample], ctx: StageContext
    ) -> list[RewardResult]:
        if not chosen:
            return []
        try:
            async with stage_deadline(self.timeout):
                if spec.mode == "sync":
                    return await self._sync(spec, chosen)
                return await self._async(spec, chosen, ctx)
        except TimeoutError:
            raise ScoringError(
                spec.name, f"did not score {len(chosen)} samples within {self.timeout:g}s"
            ) from None

    async def _sync(self, spec: RewardSpec, chosen: list[Sample]) -> list[RewardResult]:
        import ray

        if not ray.is_initialized():
            raise ScoringError(
                spec.name, "sync reward adapters run in Ray workers: connect to Ray first"
            )
        items = [(s.response, s.label, s.metadata if spec.pass_metadata else None) for s in chosen]
        tasks = max(1, min(self.sync_tasks, len(items)))
        size = -(-len(items) // tasks)
        chunks = [items[i : i + size] for i in range(0, len(items), size)]
        scorer = _remote_scorer()
        refs = [scorer.remote(spec.fn, spec.pass_metadata, chunk) for chunk in chunks]
        try:
            parts = await asyncio.gather(*refs)
        except ray.exceptions.RayError as exc:
            raise ScoringError(spec.name, f"its Ray task failed: {exc}") from exc
        finally:
            for ref in refs:
                ray.cancel(ref)
        values = [v for part in parts for v in part]
        out = []
        for sample, value in zip(chosen, values, strict=True):
            if isinstance(value, tuple) and len(value) == 2 and value[0] == "error":
                raise ScoringError(
                    spec.name,
                    f"raised for sample {sample.id} (group {sample.group_id}): {value[1]}",
                )
            out.append(_outcome(spec.name, sample, value))
        return out

    async def _async(
        self, spec: RewardSpec, chosen: list[Sample], ctx: StageContext
    ) -> list[RewardResult]:
        gate = asyncio.Semaphore(self.concurrency)
        model = self.models[0] if len(self.models) == 1 else None
        retries = spec.retries if self.retries is None else self.retries

        async def one(sample: Sample) -> RewardResult:
            context = RewardContext(sample, ctx.batch_id, ctx.clients, self.role, model)
            kwargs: dict[str, Any] = {"context": context}
            if spec.pass_metadata:
                kwargs["metadata"] = sample.metadata
            async with gate:
                try:
                    value = await ctx.retrying(
                        lambda: spec.fn(sample.response, sample.label, **kwargs),
                        stage=self.name,
                        role=self.role,
                        retries=retries,
                    )
                except ScoringError:
                    raise
                except Exception as exc:
                    notes = "".join(f" ({n})" for n in getattr(exc, "__notes__", ()))
                    raise ScoringError(
                        spec.name,
                        f"raised for sample {sample.id} (group {sample.group_id}): "
                        f"{type(exc).__name__}: {exc}{notes}",
                    ) from exc
            return _outcome(spec.name, sample, value)

        return await gather_all(one(s) for s in chosen)
