"""Background evaluation (``background = true`` on an ``eval`` stage): in step ``N``'s batch
the stage only starts its work, which runs beside the steps that follow without any lease and
ends as an :class:`EvalResult`, never failing a step (``docs/run.md``)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, Unpack, runtime_checkable

import attrs

from relax_core.coordination.batch import Producer, describe_failure
from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import (
    MoreGroups,
    RoleClients,
    Stage,
    StageContext,
    StageReport,
    more_groups,
)
from relax_core.errors import ConfigError, ConfigProblem, CoordinationError

#: What a background evaluation ended as.
_ENDS = DONE, FAILED, CANCELLED = "done", "failed", "cancelled"


@runtime_checkable
class BackgroundStage(Stage, Protocol):
    """A stage that can run off the step's critical path; ``roles``: every role its work
    calls."""

    @property
    def background(self) -> bool: ...

    @property
    def roles(self) -> tuple[str, ...]: ...

    def due(self, step: int) -> bool: ...


@attrs.frozen
class EvalResult:
    """How one background evaluation ended; ``weight_version``: ``None`` when its samples span
    several (``weight_versions``) or none."""

    stage: str
    step: int
    status: str
    weight_version: str | None
    weight_versions: tuple[str | None, ...]
    counts: Mapping[str, float]
    error: str | None
    seconds: float

    def row(self) -> dict[str, Any]:
        """The JSON object ``relax run --json`` prints for it (``docs/run.md``)."""
        row = attrs.asdict(self)
        row |= {"weight_versions": list(self.weight_versions), "counts": dict(self.counts)}
        return {"eval": row.pop("stage"), **row}

    def metrics(self) -> dict[str, float]:
        """The trackers' metrics of step :attr:`step` (``eval/STAGE/COUNT``; finite only)."""
        out: dict[str, float] = {}
        for key, value in self.counts.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"eval/{self.stage}/{key}"] = float(value)
        with contextlib.suppress(ValueError):
            out[f"eval/{self.stage}/weight_version"] = float(str(self.weight_version))
        return {k: v for k, v in out.items() if math.isfinite(v)}


@attrs.frozen
class EvalCounts:
    """How the run's background evaluations ended (the summary's ``evaluations``)."""

    done: int = 0
    failed: int = 0
    cancelled: int = 0

    def row(self) -> dict[str, int]:
        """``{"done": …, "failed": …, "cancelled": …}``."""
        return attrs.asdict(self)


def background_problems(
    stages: Iterable[Any], *, defer_roles: Sequence[str], residency: str
) -> list[ConfigProblem]:
    """The background ``eval`` stage tables a layout where the generation role takes turns on
    its GPUs refuses. Pure."""
    if not defer_roles and residency != "exclusive":
        return []
    why = (
        f"in a defer layout (placement.defer_roles: {', '.join(defer_roles)})"
        if defer_roles
        else 'under placement.residency = "exclusive"'
    )
    return [
        ConfigProblem(
            table.key("background"),
            "background",
            f"a background evaluation runs without the step's leases, but {why} the generation "
            "role takes turns on its GPUs: its held-out generation would need the lease only "
            "the step's batch holds; remove background (the evaluation then runs in the step, "
            'with the leases), or use a split or decoupled layout under residency = "planned"',
        )
        for table in stages
        if table.kind == "eval" and table.options.get("background") is True
    ]


class _Launch:
    """A background stage as the batch of one step runs it: starts the work, reports so."""

    role: str | None = None
    models: tuple[str, ...] = ()

    def __init__(self, stage: BackgroundStage, start: Callable[[], None]) -> None:
        self.name = stage.name
        self.fields = tuple(stage.fields)
        self._stage = stage
        self._start = start

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        if not self._stage.due(ctx.batch_id):
            return StageReport(self.name, {"skipped": 1})
        self._start()
        return StageReport(self.name, {"background": 1})


@attrs.define
class _OffPath:
    """A background stage's batch control: generate and run a stage, with no lease."""

    step: int
    stage: str
    producer: Producer
    clients: RoleClients
    samples: list[Sample] = attrs.field(init=False, factory=list)

    @property
    def upstream(self) -> tuple[Stage, ...]:
        return ()

    @property
    def target_groups(self) -> int:
        return 0

    async def generate(self, **request: Unpack[MoreGroups]) -> list[Sample]:
        groups = await self.producer.generate(self.step, **more_groups(self.stage, request))
        samples = [s for group in groups for s in group]
        self.samples += samples
        return samples

    def add(self, samples: Sequence[Sample]) -> list[Sample]:
        raise CoordinationError(self._refused("add samples to"))

    def drop(self, group_ids: Iterable[str], reason: str) -> int:
        raise CoordinationError(self._refused("drop groups of"))

    async def run_stage(self, stage: Stage, samples: Sequence[Sample]) -> StageReport:
        return await stage.run(samples, StageContext(self.step, self.clients, self))

    def _refused(self, what: str) -> str:
        return (
            f"stage {self.stage!r} runs in the background: it cannot {what} batch {self.step}, "
            "which committed without waiting for it; remove background from its table"
        )

    def versions(self) -> tuple[str | None, ...]:
        """Every weight version of the samples, in order of appearance."""
        seen: dict[str | None, None] = {}
        for s in self.samples:
            for _, version in s.versions:
                seen.setdefault(version)
        return tuple(seen)


@attrs.define(eq=False)
class BackgroundEvals:
    """The background evaluations of one run.

    :param on_result: told each :class:`EvalResult`; what it raises is raised by :meth:`settle`.
    :param deadline: seconds :meth:`settle` waits for those pending before it cancels them."""

    on_result: Callable[[EvalResult], None] | None = attrs.field(default=None, kw_only=True)
    deadline: float = attrs.field(default=300.0, kw_only=True)
    _tasks: set[asyncio.Task[None]] = attrs.field(init=False, factory=set)
    _ended: dict[str, int] = attrs.field(init=False, factory=lambda: dict.fromkeys(_ENDS, 0))
    _reporting: list[BaseException] = attrs.field(init=False, factory=list)

    @property
    def counts(self) -> EvalCounts:
        """How the evaluations that ended so far ended."""
        return EvalCounts(**self._ended)

    @staticmethod
    def check(stages: Sequence[Stage], *, switching: bool, deferred_roles: Sequence[str]) -> None:
        """Refuse a background stage whose work would need a lease.

        :raises ConfigError: naming the stage and what to do."""
        for stage in stages:
            if not (isinstance(stage, BackgroundStage) and stage.background):
                continue
            leased = [r for r in stage.roles if r in deferred_roles]
            if not switching and not leased:
                continue
            who = (
                "the generation role takes turns on its GPUs"
                if switching
                else f"{', '.join(leased)} takes turns on its GPUs"
            )
            raise ConfigError(
                f"run.stages ({stage.name})",
                f"stage {stage.name!r} has background = true, but {who}: its work would need "
                "a lease only the step's batch holds; remove background, or use a split or "
                'decoupled layout under placement.residency = "planned"',
            )

    def stages(
        self, step: int, stages: Sequence[Stage], *, producer: Any, clients: RoleClients
    ) -> tuple[Stage, ...]:
        """``stages`` for the batch of ``step``, each background one a stand-in that starts its
        work."""
        return tuple(
            _Launch(s, functools.partial(self._start, step, s, producer, clients))
            if isinstance(s, BackgroundStage) and s.background
            else s
            for s in stages
        )

    def _start(
        self, step: int, stage: BackgroundStage, producer: Any, clients: RoleClients
    ) -> None:
        task = asyncio.ensure_future(self._evaluate(step, stage, producer, clients))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _evaluate(
        self, step: int, stage: BackgroundStage, producer: Any, clients: RoleClients
    ) -> None:
        control = _OffPath(step, stage.name, producer, clients)
        began = time.perf_counter()
        status, error, counts = DONE, None, {}
        try:
            report = await stage.run((), StageContext(step, clients, control))
            counts = dict(report.counts)
        except asyncio.CancelledError:
            status, error = CANCELLED, "cancelled: the run ended before it finished"
        except Exception as exc:
            status, error = FAILED, describe_failure(exc)
        versions = control.versions()
        result = EvalResult(
            stage=stage.name,
            step=step,
            status=status,
            weight_version=versions[0] if len(versions) == 1 else None,
            weight_versions=versions,
            counts=counts,
            error=error,
            seconds=time.perf_counter() - began,
        )
        self._ended[status] += 1
        if self.on_result is not None:
            try:
                self.on_result(result)
            except Exception as exc:
                self._reporting.append(exc)

    async def settle(self, *, cancel: bool = False) -> EvalCounts:
        """End every evaluation still pending: await them up to :attr:`deadline` seconds
        (``cancel``: not at all), then cancel the rest; the counts.

        :raises Exception: what ``on_result`` raised first (every evaluation ended anyway)."""
        tasks = [t for t in self._tasks if not t.done()]
        if tasks and not cancel:
            await asyncio.wait(tasks, timeout=self.deadline)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._reporting:
            first, self._reporting = self._reporting[0], []
            raise first
        return self.counts
