"""Background evaluation: a stage's work for step ``N`` run beside the steps that follow, off
the step's critical path (``background = true`` on an ``eval`` stage's table).

In the batch of step ``N`` a background stage only starts its work (:class:`BackgroundEvals`
hands the batch a stand-in that reports ``{"background": 1}``, or ``{"skipped": 1}`` on a step
that is not one of its ``every``); the step commits and trains without waiting for it. The
work runs in a task: the held-out groups generated through step ``N``'s producer with the
weights rollout serves then, scored by the stage's own rewards, and reported when it ends as
its own :class:`EvalResult`, tagged with the weight version its samples were generated with
(``relax run``: one JSON object, the trackers' ``eval/NAME/...`` metrics of step ``N``).

Off the critical path means without any lease: the held-out generation needs the generation
role awake and the scoring needs the scorer's role, so a background stage is refused where
either takes turns on shared GPUs (:func:`background_problems` before anything starts,
:meth:`BackgroundEvals.check` in the driver): there only the step's batch holds those leases.

At the end of the run the evaluations still pending are awaited up to a deadline, then
cancelled; Ctrl-C cancels them at once. Each one ends as a result (``done``, ``failed`` or
``cancelled``), none is dropped unreported, and :attr:`BackgroundEvals.counts` is the summary's
``evaluations``. A background evaluation's failure is its result's ``error``: it never fails a
step.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, Unpack, runtime_checkable

import attrs

from relax_core.config import ConfigProblem
from relax_core.coordination.batch import describe_failure
from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import (
    MoreGroups,
    RoleClients,
    SampleField,
    Stage,
    StageContext,
    StageReport,
)
from relax_core.errors import ConfigError, CoordinationError

__all__ = [
    "BackgroundEvals",
    "BackgroundStage",
    "EvalCounts",
    "EvalResult",
    "background_problems",
]

#: What a background evaluation ended as.
DONE, FAILED, CANCELLED = "done", "failed", "cancelled"


@runtime_checkable
class BackgroundStage(Stage, Protocol):
    """A stage that can run off the step's critical path: ``background`` says it does (its
    table's key), :meth:`due` whether step ``step`` runs it at all, ``roles`` every role its
    work calls (none of them may take turns on shared GPUs)."""

    @property
    def background(self) -> bool: ...

    @property
    def roles(self) -> tuple[str, ...]: ...

    def due(self, step: int) -> bool: ...


class _Producer(Protocol):
    async def generate(
        self, batch_id: int, **request: Unpack[MoreGroups]
    ) -> list[list[Sample]]: ...


@attrs.frozen
class EvalResult:
    """How one background evaluation ended: the stage and the step that started it,
    ``status`` (``done``, ``failed`` or ``cancelled``), the weight version its samples were
    generated with (``None`` when they span several or none was generated: ``weight_versions``
    lists each, oldest first as rollout reported them), its counts (the stage's report:
    ``samples``, ``reward_mean``, ``reward_std``, …), the error of a failed or cancelled one,
    and its seconds from start to end."""

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
        return {
            "eval": self.stage,
            "step": self.step,
            "status": self.status,
            "weight_version": self.weight_version,
            "weight_versions": list(self.weight_versions),
            "counts": dict(self.counts),
            "error": self.error,
            "seconds": self.seconds,
        }

    def metrics(self) -> dict[str, float]:
        """The trackers' metrics of step :attr:`step`: ``eval/STAGE/COUNT`` for each number of
        :attr:`counts`, and ``eval/STAGE/weight_version`` where the version is a number (finite
        values only: no rewards scored leaves ``reward_mean`` out)."""
        out: dict[str, float] = {}
        for key, value in self.counts.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                out[f"eval/{self.stage}/{key}"] = float(value)
        try:
            out[f"eval/{self.stage}/weight_version"] = float(str(self.weight_version))
        except ValueError:
            pass
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
    """The background ``eval`` stage tables (``background = true``) a layout refuses: in a
    defer layout (``defer_roles``) or under ``residency = "exclusive"`` the generation role
    takes turns on its GPUs, so the held-out generation needs its lease, which only a step's
    batch holds. ``stages``: :class:`~relax_core.run.config.StageTable` records. Pure."""
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
        self.fields: tuple[SampleField, ...] = tuple(stage.fields)
        self._stage = stage
        self._start = start

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        if not self._stage.due(ctx.batch_id):
            return StageReport(self.name, {"skipped": 1})
        self._start()
        return StageReport(self.name, {"background": 1})


class _OffPath:
    """What a background stage may do (:class:`~relax_core.coordination.stages.BatchControl`):
    generate through its step's producer and run a stage, with no lease (refused where one
    would be needed); the batch itself committed without it, so it cannot add or drop."""

    def __init__(self, step: int, stage: str, producer: _Producer, clients: RoleClients) -> None:
        self.step = step
        self.stage = stage
        self.producer = producer
        self.clients = clients
        self.samples: list[Sample] = []

    @property
    def upstream(self) -> tuple[Stage, ...]:
        return ()

    @property
    def target_groups(self) -> int:
        return 0

    async def generate(self, **request: Unpack[MoreGroups]) -> list[Sample]:
        if (request.get("groups") is None) == (request.get("prompts") is None):
            raise ValueError(f"stage {self.stage!r}: generate() takes groups or prompts")
        asked: MoreGroups = {
            "groups": None, "prompts": None, "samples_per_prompt": None, "temperature": None,
            **request,
        }  # fmt: skip
        groups = await self.producer.generate(self.step, **asked)
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
        """Every weight version the samples were generated with, in order of appearance."""
        seen: dict[str | None, None] = {}
        for s in self.samples:
            for _, version in s.versions:
                seen.setdefault(version)
        return tuple(seen)


class BackgroundEvals:
    """The background evaluations of one run (see the module docstring).

    :param on_result: told each :class:`EvalResult` as its evaluation ends (printed, told to
        the trackers); what it raises is kept and raised by :meth:`settle`, after every
        evaluation ended (a strict tracker's failure).
    :param deadline: seconds :meth:`settle` waits for the evaluations still pending at the end
        of the run before it cancels them.
    """

    def __init__(
        self,
        *,
        on_result: Callable[[EvalResult], None] | None = None,
        deadline: float = 300.0,
    ) -> None:
        self.on_result = on_result
        self.deadline = deadline
        self._tasks: set[asyncio.Task[None]] = set()
        self._done = self._failed = self._cancelled = 0
        self._reporting: list[BaseException] = []

    @property
    def counts(self) -> EvalCounts:
        """How the evaluations that ended so far ended."""
        return EvalCounts(self._done, self._failed, self._cancelled)

    @property
    def pending(self) -> int:
        """Evaluations started and not ended."""
        return sum(not t.done() for t in self._tasks)

    @staticmethod
    def check(stages: Sequence[Stage], *, switching: bool, deferred_roles: Sequence[str]) -> None:
        """Refuse a background stage where its work would need a lease: the generation role
        takes turns (``switching``) or a role it calls is one of ``deferred_roles``.

        :raises ConfigError: naming the stage and what to do.
        """
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
        """``stages`` as the batch of ``step`` runs them: each background stage replaced by a
        stand-in that starts its work with ``producer`` (step ``step``'s) and returns."""

        def launcher(stage: BackgroundStage) -> Stage:
            return _Launch(stage, lambda: self._start(step, stage, producer, clients))

        return tuple(
            launcher(s) if isinstance(s, BackgroundStage) and s.background else s for s in stages
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
        if status == DONE:
            self._done += 1
        elif status == FAILED:
            self._failed += 1
        else:
            self._cancelled += 1
        if self.on_result is not None:
            try:
                self.on_result(result)
            except Exception as exc:
                self._reporting.append(exc)

    async def settle(self, *, cancel: bool = False) -> EvalCounts:
        """End every evaluation still pending: await them up to :attr:`deadline` seconds
        (``cancel``: not at all), then cancel the rest; each is reported. Return the counts.

        :raises Exception: what ``on_result`` raised first (every evaluation ended anyway).
        """
        tasks = [t for t in self._tasks if not t.done()]
        if tasks and not cancel:
            await asyncio.wait(tasks, timeout=self.deadline)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._reporting:
            first, self._reporting = self._reporting[0], []
            raise first
        return self.counts
