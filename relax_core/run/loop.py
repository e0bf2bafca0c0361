"""``relax run``'s steps around the :class:`~relax_core.run.driver.StepDriver`: the run's
engines as :class:`StepPorts`, and what a run reports of its steps (``docs/run.md``)."""

from __future__ import annotations

import asyncio
import collections
import functools
import json
import math
import os
import statistics
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, TypedDict, Unpack

import attrs

from relax_core.client.client import InferenceClient
from relax_core.coordination.batch import interrupted
from relax_core.coordination.handles import RayManagerHandle, unconfirmed
from relax_core.coordination.leases import LeaseEngine
from relax_core.coordination.retries import Recovery
from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import RoleClients, Stage
from relax_core.coordination.timeline import PhaseEvent, Timeline
from relax_core.errors import LifecycleError
from relax_core.jobs.managers import engine_spec
from relax_core.jobs.session import ShutdownSignals
from relax_core.records import RunProbe, RunProbeSpec
from relax_core.run.background import BackgroundEvals, EvalCounts, EvalResult
from relax_core.run.checkpoint import Checkpoint, Checkpointer, Cursor, CursorProducer, job_settings
from relax_core.run.data import open_source
from relax_core.run.driver import (
    DriverSettings,
    Finished,
    StepDriver,
    StepOutcome,
    StepProducerLike,
    _StepFailure,
)
from relax_core.run.generate import Generator, PromptTokenizer
from relax_core.run.job import RunJob
from relax_core.run.metrics import RunMetrics
from relax_core.run.progress import Printer, Progress
from relax_core.tracking.hub import Trackers
from relax_core.tracking.metrics import reward_by_key, rollout_metrics, sample_rows, step_metrics
from relax_core.tracking.tracker import PhaseSpan

#: Entries of the trainer's answer the row also carries at its top level (``docs/run.md``).
TOP_LEVEL_TRAINER_KEYS = ("teacher_kl", "teacher_logprob_mean")


@attrs.frozen
class FailedStep:
    """A step that failed, was skipped or interrupted (its :meth:`row`: ``docs/run.md``)."""

    step: int
    error: str
    kind: str
    sample_ids: tuple[str, ...]
    blocked: dict[str, str]
    trainer: str
    interrupted: bool = False
    went_on: bool = False
    skipped: bool = False
    retries: dict[str, Any] = attrs.field(factory=dict)

    def row(self) -> dict[str, Any]:
        """The JSON object of the failed (or skipped) step."""
        return {
            "step": self.step,
            "failed": not self.skipped,
            "skipped": self.skipped,
            "went_on": self.went_on,
            "interrupted": self.interrupted,
            "error": self.error,
            "kind": self.kind,
            "samples_generated": len(self.sample_ids),
            "sample_ids": list(self.sample_ids),
            "blocked": self.blocked,
            "trainer": self.trainer,
            "retries": self.retries.get("retries", {}),
            "recoveries": self.retries.get("rebuilt", {}),
        }


@attrs.define
class RunSummary:
    """What a run did (its :meth:`row` is the summary object of ``docs/run.md``)."""

    job: str
    steps: int
    committed: list[dict[str, Any]] = attrs.field(factory=list)
    failure: FailedStep | None = None
    weight_versions: list[str | None] = attrs.field(factory=list)
    final_push: dict[str, Any] | None = None
    switching: dict[str, Any] | None = None
    seconds: float = 0.0
    startup_seconds: float = 0.0
    trace: str | None = None
    interrupted_step: int | None = None
    first_step: int = 0
    evaluations: EvalCounts = attrs.field(factory=EvalCounts)
    went_past: list[FailedStep] = attrs.field(factory=list)
    error: str | None = None

    @property
    def interrupted(self) -> bool:
        """Whether Ctrl-C (or SIGTERM) ended the run."""
        return self.interrupted_step is not None

    def row(self) -> dict[str, Any]:
        """The summary JSON object."""
        return {
            "summary": True,
            "job": self.job,
            "steps": self.steps,
            "steps_committed": len(self.committed),
            "first_step": self.first_step,
            "failed_step": None if self.failure is None else self.failure.step,
            "interrupted": self.interrupted,
            "interrupted_step": self.interrupted_step,
            "weight_versions": self.weight_versions,
            "final_push": self.final_push,
            "reward_means": [r["reward_mean"] for r in self.committed],
            "seconds": self.seconds,
            "startup_seconds": self.startup_seconds,
            "step_seconds": sum(r["seconds"] for r in self.committed),
            "trace": self.trace,
            "switching": self.switching,
            "evaluations": self.evaluations.row(),
            "failed_steps": [f.step for f in self.went_past if not f.skipped]
            + ([] if self.failure is None or self.interrupted else [self.failure.step]),
            "skipped_steps": [f.step for f in self.went_past if f.skipped],
            "retries": _total(self.committed, self.went_past, "retries"),
            "recoveries": _total(self.committed, self.went_past, "recoveries"),
            "error": self.error,
        }


#: The :class:`StepPorts` the driver takes as they are.
_DRIVEN = (
    "stages", "sink", "clients", "producer", "trainer", "generation_role", "deferred_roles",
    "switching", "discards",
)  # fmt: skip


def _total(rows: list[dict[str, Any]], failed: list[FailedStep], key: str) -> dict[str, int]:
    """``key``'s counts (stage or role -> n) summed over the steps' rows."""
    out: collections.Counter[str] = collections.Counter()
    for counts in [r.get(key) or {} for r in rows] + [f.row()[key] for f in failed]:
        out.update(counts)
    return dict(out)


async def _heads(registry: Any) -> list[str]:
    from relax_core.discovery.schema import RoleSnapshot

    snapshot = RoleSnapshot.from_json(await registry.fetch())
    return [e.base_url for m in snapshot.models.values() for e in m.engines if e.base_url]


def _dump(directory: str, name: str, samples: Sequence[Sample]) -> None:
    path = os.path.join(directory, name)
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        for s in samples:
            f.write(json.dumps(attrs.asdict(s)) + "\n")
    os.replace(tmp, path)


def run_description(job: RunJob) -> dict[str, Any]:
    """What trackers hear of the run first (``log_config``)."""
    run = attrs.asdict(job.run, recurse=True)
    run["trackers"] = [{"tracker": t.name, **t.options} for t in job.run.trackers]
    run["stages"] = [
        {"stage": t.kind, "name": t.name, "role": t.role, "models": list(t.models), **t.options}
        for t in job.run.stages
    ]
    run.pop("base", None)
    return {
        "job": job.name,
        "job_file": job.config.source,
        "generation_role": job.generation_role,
        "run": run,
        "roles": {
            role.name: {
                m.name: {
                    "backend": m.backend,
                    "model_path": m.model_path,
                    "device": m.device,
                    "num_gpus": m.placement.num_gpus,
                    "weight_source": m.weight_source,
                }
                for m in role.models
            }
            for role in job.config.roles
        },
        "placement": {
            "mode": job.config.placement.mode,
            "defer_roles": list(job.config.placement.defer_roles),
        },
        "slices": dict(job.slices),
        "residency": job.residency.to_dict(),
    }


def blocked_advice(job: str, blocked: dict[str, str]) -> str:
    """What a BLOCKED lease means for the operator (docs/coordination.md#blocked)."""
    roles = "; ".join(f"{r}: {why}" for r, why in blocked.items())
    first = next(iter(blocked))
    return (
        f"BLOCKED ({roles}): relax run shuts every engine down now, which frees their memory; "
        "a job that went on would stay BLOCKED until an operator confirmed the role's engines "
        "hold no GPU memory (nvidia-smi, the engine's /server_info) and ran `relax coordinator "
        f"reset --address HEAD:6379 --job {job} --role {first} --confirm-clean` "
        "(docs/coordination.md#blocked)"
    )


def async_overlap_note(job: RunJob) -> str | None:
    """What async steps cannot overlap in the started ``job``, or ``None``."""
    gen = job.generation_role
    if gen in job.residency.free:
        return None
    others = [r for r in job.slices if r != gen and job.slices[r] == job.slices[gen]]
    with_whom = f"with {', '.join(others)} " if others else ""
    return (
        f"async: {gen} takes turns {with_whom}on its GPUs, so training overlaps generation "
        "but scoring does not (placement mode 'split' or 'decoupled', under residency "
        "'planned', overlaps scoring too)"
    )


class TrainerCalls:
    """The trainer's Ray actor as the driver calls it: each method an awaitable remote call."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self.actor, name)

        async def call(*args: Any) -> Any:
            return await method.remote(*args)

        return call


@attrs.define
class StepPorts:
    """What the steps of a run call (a :class:`~relax_core.run.job.RunJob`'s actors, or a
    simulation); ``free``: rollout never switches (``discards``: its offload loses its weights);
    ``heads(role)``: a role's engine heads (``--measure``); ``recover(role)``: rebuild a role's
    dead replicas."""

    name: str
    run: Any
    coordinator: Any
    rollout: Any
    stages: Sequence[Stage]
    sink: Any
    clients: RoleClients
    producer: Callable[[], StepProducerLike]
    trainer: Any
    generation_role: str
    deferred_roles: tuple[str, ...] = ()
    switching: bool = False
    discards: bool = False
    free: bool = True
    heads: Callable[[str], Awaitable[list[str]]] | None = None
    recover: Callable[[str], Awaitable[Any]] | None = None


def step_row(
    outcome: StepOutcome, stages: Sequence[Stage], timeline: Any, recovery: Recovery | None = None
) -> dict[str, Any]:
    """The committed step's JSON object (``docs/run.md``)."""
    n, result, trained = outcome.step, outcome.result, outcome.trained
    samples = outcome.batch.originals
    rewards = [float(s.reward or 0.0) for s in samples]
    failures = [
        v
        for stage, r in zip(stages, result.reports, strict=False)
        if stage.role is not None
        for k, v in r.counts.items()
        if k.endswith("parse_failures")
    ]
    names = sorted({f for s in samples for f in s.fields})
    counts = recovery.of(n) if recovery is not None else {}
    return {
        "step": n,
        "batch_id": n,
        "partition": result.receipt.partition,
        "samples": result.samples,
        "groups": len({s.group_id for s in samples}),
        "reward_mean": statistics.fmean(rewards) if rewards else math.nan,
        "reward_std": statistics.pstdev(rewards) if rewards else math.nan,
        "reward_by_key": reward_by_key(samples),
        "parse_failures": int(sum(failures)) if failures else None,
        **{key: trained.get(key) for key in TOP_LEVEL_TRAINER_KEYS},
        "tokens": sum(len(s.response_ids) for s in samples),
        "weight_version": samples[0].weight_version if samples else None,
        "fields": {f: sum(f in s.fields for s in samples) for f in names},
        "stages": {r.stage: dict(r.counts) for r in result.reports},
        "dropped": {
            "groups": len(result.dropped),
            "samples": sum(len(d.samples) for d in result.dropped),
            "reasons": dict(collections.Counter(f"{d.stage}: {d.reason}" for d in result.dropped)),
        },
        "generated_groups": result.generated_groups,
        "switches": timeline.switches(n),
        "seconds": outcome.seconds,
        "latency_seconds": time.perf_counter() - outcome.began,
        "phases": timeline.phases(n),
        "pushed_before": outcome.pushed_before,
        "train": dict(trained),
        "async": outcome.metrics,
        "trajectories": rollout_metrics(samples),
        "retries": counts.get("retries", {}),
        "recoveries": counts.get("rebuilt", {}),
    }


@attrs.define(eq=False)
class _Report:
    """What a run reports of its steps: phases, rows, failures and dumps."""

    ports: StepPorts
    printer: Printer
    summary: RunSummary
    trace: str | None = attrs.field(kw_only=True)
    dump_dir: str | None = attrs.field(kw_only=True)
    trackers: Trackers | None = attrs.field(kw_only=True)
    metrics: RunMetrics = attrs.field(init=False, factory=RunMetrics.of)
    timeline: Timeline = attrs.field(init=False)
    #: the innermost phase an interruption stopped, if one did
    interrupted_phase: str | None = attrs.field(init=False, default=None)
    _bars: dict[int, Progress] = attrs.field(init=False, factory=dict)

    @timeline.default
    def _timeline(self) -> Timeline:
        return Timeline(
            on_event=self._event, trace_path=self.trace, run=f"relax run {self.ports.name}"
        )

    def _event(self, e: PhaseEvent) -> None:
        if e.interrupted and self.interrupted_phase is None:
            self.interrupted_phase = e.name
        self.printer.event(e)
        if e.ended and self.trackers is not None:
            self.trackers.log_span(
                PhaseSpan(
                    e.step, e.name, e.started, e.seconds, lane=e.lane, failed=e.failed,
                    interrupted=e.interrupted,
                )
            )  # fmt: skip

    def progress(self, step: int, groups: int) -> None:
        """``groups`` of step ``step`` generated: the status line's bar."""
        spp, total = self.ports.run.samples_per_prompt, self.ports.run.prompts_per_step
        bar = self._bars.get(step)
        if bar is None:
            bar = self._bars[step] = Progress(
                self.printer, f"step {step} generate", total * spp, "samples"
            )
        bar.update(groups * spp)

    def finalizer(self, batch_id: int, samples: Sequence[Sample]) -> None:
        if self.dump_dir is not None:
            _dump(self.dump_dir, f"batch-{batch_id}.jsonl", samples)

    def step(self, outcome: StepOutcome) -> None:
        """A step committed and trained: its row printed, counted and told to the trackers."""
        self._bars.pop(outcome.step, None)
        batch = outcome.batch
        if self.dump_dir is not None and batch.dropped_samples:
            _dump(self.dump_dir, f"dropped-{outcome.step}.jsonl", batch.dropped_samples)
        row = step_row(outcome, self.ports.stages, self.timeline, self.ports.clients.recovery)
        self.metrics.committed(row)
        if self.trackers is not None:
            self.trackers.log_metrics(row["step"], step_metrics(row))
            samples = sample_rows(batch.originals, self.ports.run.tracker_samples)
            self.trackers.log_samples(row["step"], samples)
        if outcome.pushed_before is not None:
            self.summary.weight_versions.append(outcome.pushed_before.get("weight_version"))
        self.summary.committed.append(row)
        self.printer.step(row)

    def evaluation(self, result: EvalResult) -> None:
        """A background evaluation ended: printed and told to the trackers."""
        if self.trackers is not None:
            self.trackers.log_metrics(result.step, result.metrics())
        self.printer.evaluation(result.row())

    def retried(self, batch_id: int, stage: str, error: str) -> None:
        """A stage's request was sent again: the trace's ``retries`` counter track."""
        recovery = self.ports.clients.recovery
        if recovery is not None:
            self.timeline.counter("retries", dict(recovery.retries[batch_id]))

    async def failed(self, failed: _StepFailure, *, went_on: bool = False) -> None:
        """The step that failed or was interrupted, reported; ``went_on``: the run goes on."""
        n, exc = failed.step, failed.error
        stopped = interrupted(exc)
        samples = [*failed.samples, *failed.ahead]
        if self.dump_dir is not None:
            _dump(self.dump_dir, f"failed-{n}.jsonl", samples)
        try:
            blocked: dict[str, str] = dict((await self.ports.coordinator.describe()).blocked)
        except Exception as err:  # the coordinator itself may be what failed
            blocked = {"?": f"the coordinator could not be asked: {err}"}
        where = self.interrupted_phase or "the step"
        text = f"interrupted during {where}" if stopped else f"{type(exc).__name__}: {exc}"
        notes = getattr(exc, "__notes__", None)
        if notes:
            text += " (" + "; ".join(notes) + ")"
        if blocked:
            text += "; " + blocked_advice(self.ports.name, blocked)
        recovery = self.ports.clients.recovery
        step = FailedStep(
            step=n,
            error=text,
            kind="interrupted" if stopped else type(exc).__name__,
            sample_ids=tuple(s.id for s in samples),
            blocked=blocked,
            trainer=failed.trainer,
            interrupted=stopped,
            went_on=went_on,
            skipped=failed.skipped,
            retries=recovery.of(n) if recovery is not None else {},
        )
        if went_on:
            self.summary.went_past.append(step)
        else:
            self.summary.failure = step
        if not step.skipped:
            self.metrics.failed.inc()
        self.printer.failed(step.row())


class RunOptions(TypedDict, total=False):
    """What a run reports and keeps besides its steps (:func:`run_loop`)."""

    trace: str | None
    dump_dir: str | None
    #: ``--measure``'s probe: its report is the summary's ``switching``.
    measure: RunProbeSpec | None
    trackers: Trackers | None


async def drive(
    ports: StepPorts,
    printer: Printer,
    *,
    steps: int,
    initial_version: str | None = None,
    residency: dict[str, Any] | None = None,
    first_step: int = 0,
    on_trained: Callable[[int], Awaitable[None]] | None = None,
    on_finished: Callable[[Finished], Awaitable[None]] | None = None,
    failed_before: Sequence[int] = (),
    **options: Unpack[RunOptions],
) -> RunSummary:
    """Run steps ``first_step`` to ``steps - 1`` on ``ports``, as :func:`run_loop` (which
    calls it); ``failed_before``: a resumed run's failed steps gone past."""
    trace, dump_dir = options.get("trace"), options.get("dump_dir")
    trackers = options.get("trackers")
    began = time.perf_counter()
    summary = RunSummary(ports.name, steps, trace=trace, first_step=first_step)
    summary.startup_seconds = time.monotonic() - printer.began
    report = _Report(ports, printer, summary, trace=trace, dump_dir=dump_dir, trackers=trackers)
    if residency is not None:
        report.timeline.describe("residency", residency)
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
    coordinator, rollout = ports.coordinator, ports.rollout
    probe: RunProbe | None = None
    driver: StepDriver | None = None
    measure = options.get("measure")
    if measure is not None:

        def step_of(direction: str) -> int:
            if driver is None:
                return 0
            return driver.committing if direction == "offload" else driver.generating

        probe = measure.start(
            heads=ports.heads or _no_heads, generation_role=ports.generation_role, step_of=step_of
        )
        coordinator, rollout = probe.coordinator(coordinator), probe.rollout(rollout)
    summary.weight_versions.append(initial_version)
    background = BackgroundEvals(on_result=report.evaluation, deadline=ports.run.request_timeout)
    if ports.clients.recovery is None:  # retries counted per step, rebuilds through the lease
        ports.clients.recovery = Recovery(
            ports.recover or getattr(coordinator, "recover", None), on_retry=report.retried
        )
    driver = StepDriver(
        DriverSettings.of(ports.run, steps, first_step, failed_before),
        coordinator=coordinator,
        rollout=rollout,
        initial_version=initial_version,
        timeline=report.timeline,
        finalizer=report.finalizer,
        on_step=report.step,
        on_progress=report.progress,
        on_trained=on_trained,
        background=background,
        on_failed=functools.partial(report.failed, went_on=True),
        on_finished=on_finished,
        **{name: getattr(ports, name) for name in _DRIVEN},
    )
    signals = ShutdownSignals(printer.progress_out, command="relax run", say=printer.say)
    async with signals.cancelling():
        try:
            try:
                await driver.run()
            except _StepFailure as failed:
                if interrupted(failed.error):
                    summary.interrupted_step = failed.step
                    signals.handled()
                await report.failed(failed)
            if probe is not None and not summary.interrupted:
                step_seconds = sum(r["seconds"] for r in summary.committed)
                summary.switching = await probe.report(ports.trainer, step_seconds)
            if summary.failure is None and summary.committed:
                summary.final_push = await _final_push(ports, steps)
                summary.weight_versions.append(summary.final_push["weight_version"])
        except asyncio.CancelledError:
            if not signals.received:
                raise
            signals.handled()
            summary.interrupted_step = driver.generating
        finally:
            summary.evaluations = background.counts
    summary.seconds = time.perf_counter() - began
    return summary


def role_recovery(
    coordinator: Any, unleased: Mapping[str, Sequence[Any]], *, timeout: float
) -> Callable[[str], Awaitable[Any]]:
    """``recover(role)``: a leased role through the coordinator, ``unleased`` ones through a
    lease engine of their own."""
    engine = LeaseEngine(
        {role: f"{role}:own" for role in unleased}, unleased, operation_timeout=timeout
    )

    async def recover(role: str) -> Any:
        if role in engine.handles:
            async with engine.lock(role):
                return await engine.recover(role)
        return await coordinator.recover(role)

    return recover


async def _no_heads(role: str) -> list[str]:
    return []


async def _final_push(ports: StepPorts, steps: int) -> dict[str, Any]:
    """Wake rollout once more and give it the last step's weights."""
    began = time.perf_counter()
    if not ports.free:  # a free rollout is awake
        async with asyncio.timeout(ports.run.operation_timeout):
            result = await ports.rollout.onload()
        reason = unconfirmed(result, "READY")
        if reason is not None:
            raise LifecycleError(f"the final weight push could not wake rollout: {reason}")
    try:
        pushed: dict[str, Any] = await ports.trainer.push(str(steps))
    except Exception as exc:
        # rebuilt, then the push (idempotent per version) sent again
        recovery = ports.clients.recovery
        if recovery is None:
            raise
        why = await recovery.recover(steps, ports.generation_role)
        try:
            pushed = await ports.trainer.push(str(steps))
        except Exception as again:
            again.add_note(
                f"the final push was sent twice: the first failed ({type(exc).__name__}: {exc})"
                + (f"; {why}" if why else f" and {ports.generation_role} was rebuilt between")
            )
            raise
    pushed["seconds_with_onload"] = time.perf_counter() - began
    return pushed


async def run_loop(
    job: RunJob,
    printer: Printer,
    *,
    steps: int,
    checkpoint_dir: str | None = None,
    resume: Checkpoint | None = None,
    **options: Unpack[RunOptions],
) -> RunSummary:
    """Run ``steps`` steps on the started ``job``; the summary (a failed step ends the run:
    ``summary.failure``; Ctrl-C or SIGTERM: ``interrupted_step``). ``options``: ``relax run``'s
    ``--trace``, ``--dump-samples``, ``--measure`` and the trackers (the caller closes them).

    :raises CheckpointError: a checkpoint could not be written (the previous one is kept)."""
    run, gen = job.run, job.generation_role
    pids = {"engine_pids": sorted(job.engine_pids), "router_pids": sorted(job.router_pids)}
    printer.started({"job": job.name, **pids, "startup_seconds": time.monotonic() - printer.began})
    trackers = options.get("trackers")
    if trackers is not None:
        trackers.log_config(run_description(job))
    note = async_overlap_note(job)
    if note is not None and run.mode == "async":
        printer.say(note)
    source = open_source(run.dataset, job.pm, seed=run.seed, base=run.base)
    first_step = 0 if resume is None else resume.step
    cursor = Cursor(source) if resume is None else Cursor.resumed(source, resume.cursor)
    model = job.generation_model
    PromptTokenizer(model.model_path, where=model.path)  # loads before any step begins
    registries = job.registries
    rollout = RayManagerHandle(job.rollout_actor, name=f"{gen}.{model.name}")
    async with InferenceClient(
        snapshot_provider=registries[gen].fetch, role=gen, timeout=run.request_timeout
    ) as client:
        generator = Generator(client, run, job.rollout_shape)
        ports = StepPorts(
            name=job.name,
            run=run,
            coordinator=job.coordinator,
            rollout=rollout,
            stages=job.stages,
            sink=job.sink,
            clients=RoleClients(
                {r: reg.fetch for r, reg in registries.items() if r != gen},
                timeout=run.request_timeout,
            ),
            producer=lambda: CursorProducer(generator, cursor),
            trainer=TrainerCalls(job.trainer),
            generation_role=gen,
            # every role that is not free takes turns: its stages never stream
            deferred_roles=tuple(r for r in job.slices if r not in job.residency.free and r != gen),
            switching=gen not in job.residency.free,
            discards=engine_spec(model, job.pm).discards_weights,
            free=gen in job.residency.free,
            heads=lambda role: _heads(registries[role]),
            recover=role_recovery(
                job.coordinator,
                {
                    role: [RayManagerHandle(a, name=f"{role}.{m}") for m, a in actors.items()]
                    for role, actors in job.actors.items()
                    if role != gen and role not in job.slices
                }
                # rollout (the coordinator holds no handle of it) through its own lease engine
                # too: free, or at its turn when it takes turns
                | {gen: [rollout]},
                timeout=run.operation_timeout,
            ),
        )
        checkpoints: Checkpointer | None = None
        if checkpoint_dir is not None:
            checkpoints = Checkpointer(
                checkpoint_dir,
                every=run.checkpoint_every,
                steps=steps,
                trainer=ports.trainer,
                cursor=cursor,
                job=job.name,
                job_file=None if job.config.source is None else os.path.abspath(job.config.source),
                settings=job_settings(
                    run, generation_model=model.name, model_path=model.model_path
                ),
                run_ids=trackers.run_ids if trackers is not None else dict,
                say=printer.say,
            )
        if resume is not None:
            assert checkpoint_dir is not None
            initial_version = await _resumed(ports, resume, checkpoint_dir, printer)
        else:
            initial_version = await rollout.weight_version()
        return await drive(
            ports,
            printer,
            steps=steps,
            initial_version=initial_version,
            residency=job.residency.to_dict(),
            first_step=first_step,
            on_finished=None if checkpoints is None else checkpoints.finished,
            failed_before=() if resume is None else resume.failed_steps,
            **options,
        )


async def _resumed(
    ports: StepPorts, resume: Checkpoint, run_dir: str, printer: Printer
) -> str | None:
    """Load ``resume``'s trainer state, push its weights; the weight version rollout serves."""
    state = os.path.join(run_dir, resume.trainer_dir)
    loaded = await ports.trainer.load(os.path.abspath(state))
    pushed = await ports.trainer.push(resume.weight_version)
    version = pushed.get("weight_version") if isinstance(pushed, dict) else None
    printer.say(
        f"relax run: resumed from {run_dir} at step {resume.step}: the trainer's state loaded "
        f"({', '.join(f'{k} {v}' for k, v in (loaded or {}).items()) or 'no numbers'}), "
        f"weights {version if version is not None else resume.weight_version} pushed to "
        f"{ports.generation_role}"
    )
    return None if version is None else str(version)
