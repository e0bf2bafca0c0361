"""The step loop of ``relax run``: generate, score deferred, commit, train, push — N times.

One step ``N`` (``docs/run.md`` draws it):

1. the trainer is asked for batch ``N`` first (``train(N)``): it waits on the coordinator's
   commit gate (``wait_committed``), as any training consumer does;
2. ``begin_batch(N)``: rollout takes its lease; from the second step on it is onloaded
   (``rollout.onload``: every role sleeps after a commit, unless the residency plan frees it:
   a rollout on no shared GPU never switches) and the previous step's weights are
   pushed (``weight_push``: the trainer's ``push``, the manager's fenced update; the weight
   version moves);
3. ``generate``: the step's prompts from the data source, ``samples_per_prompt`` samples each,
   through the rollout route, each group into the :class:`~relax_core.coordination.
   DeferredCollector` — a failure here releases rollout (``abort_generation``) and fails the
   batch;
4. the :class:`~relax_core.coordination.DeferredBatch`: rollout offloads itself, then the
   step's stages in the job file's order (:mod:`~relax_core.run.stages`; by default the reward
   stage — reward adapters, the reward role's lease when deferred — and the teacher's
   distillation prefill), each within its role's lease; a stage may drop groups and have more
   generated (the producer, rollout's lease taken back for it); validation of every field the
   stages declare, write-back, the sink put of ``train_N``, the finalizer (``--dump-samples``),
   ``commit_batch(N)``;
5. ``train``: the trainer's answer — it read ``train_N`` with every field, took an optimizer
   step and deleted the partition.

After the last step rollout is onloaded once more and takes the last weights (the run ends
with the trained policy served). The first failure ends the run: nothing is committed for the
failed step, and its report lists the ids of the samples it generated.

Ctrl-C (SIGINT) or SIGTERM while the steps run cancels the step in flight: its batch is failed
at the coordinator, the role it was using is released with its requests in flight aborted
(not drained), and the summary says ``interrupted``; later signals are held meanwhile.
"""

from __future__ import annotations

import asyncio
import collections
import json
import math
import os
import signal
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from relax_core.client.client import InferenceClient
from relax_core.coordination.batch import (
    BatchResult,
    DeferredBatch,
    DeferredCollector,
    abort_generation,
    describe_failure,
    interrupted,
    onload_generation,
)
from relax_core.coordination.handles import RayManagerHandle, unconfirmed
from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import RoleClients
from relax_core.errors import LifecycleError
from relax_core.run.data import open_source
from relax_core.run.generate import Generator, PromptTokenizer, StepProducer
from relax_core.run.job import RunJob
from relax_core.run.measure import MeasuredCoordinator, MeasuredHandle, SwitchProbe, switch_report
from relax_core.run.metrics import RunMetrics
from relax_core.run.progress import PhaseEvent, PhaseTimeline, Printer
from relax_core.tracking.hub import Trackers
from relax_core.tracking.metrics import reward_by_key, sample_rows, step_metrics
from relax_core.tracking.tracker import PhaseSpan

__all__ = ["FailedStep", "RunSummary", "blocked_advice", "run_description", "run_loop"]


@attrs.frozen
class FailedStep:
    """The step that ended the run: its error, the ids of the samples it had generated (none
    of them committed), the leases left BLOCKED (role → why) and what the trainer saw;
    ``interrupted``: Ctrl-C (or SIGTERM) ended it, not a failure (``kind`` ``interrupted``)."""

    step: int
    error: str
    kind: str
    sample_ids: tuple[str, ...]
    blocked: dict[str, str]
    trainer: str
    interrupted: bool = False

    def row(self) -> dict[str, Any]:
        """The JSON object of the failed step."""
        return {
            "step": self.step,
            "failed": True,
            "interrupted": self.interrupted,
            "error": self.error,
            "kind": self.kind,
            "samples_generated": len(self.sample_ids),
            "sample_ids": list(self.sample_ids),
            "blocked": self.blocked,
            "trainer": self.trainer,
        }


@attrs.define
class RunSummary:
    """What a run did: each committed step's row, the failure (if any), every weight version
    rollout published (first: the one it started with), the switch report (``--measure``);
    ``interrupted_step``: the step Ctrl-C (or SIGTERM) interrupted, if one did.

    ``seconds`` is the steps' loop (the final push and ``--measure``'s copies included),
    ``startup_seconds`` the command's time before it (from the printer's ``began``).
    """

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
        }


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


async def _trainer_saw(ref: Any, wait: float) -> str:
    try:
        result = await asyncio.wait_for(asyncio.wrap_future(ref.future()), wait)
    except TimeoutError:
        return f"nothing within {wait:g}s"
    except Exception as exc:
        cause = getattr(exc, "cause", None)
        seen: BaseException = cause if isinstance(cause, BaseException) else exc
        return f"{type(seen).__name__}: {seen}"
    return f"trained on {result.get('samples')} samples (unexpected for a failed batch)"


def run_description(job: RunJob) -> dict[str, Any]:
    """What trackers hear of the run first (``log_config``): the job, its ``[run]`` settings,
    its roles' models, the placement and the residency plan (which roles share which GPUs)."""
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


class _Loop:
    def __init__(
        self,
        job: RunJob,
        printer: Printer,
        *,
        trace: str | None,
        dump_dir: str | None,
        trackers: Trackers | None = None,
    ):
        self.job = job
        self.run = job.run
        self.printer = printer
        self.dump_dir = dump_dir
        self.trackers = trackers
        self.metrics = RunMetrics.of()
        self.timeline = PhaseTimeline(self._event, trace_path=trace, run=f"relax run {job.name}")
        self.timeline.describe("residency", job.residency.to_dict())
        #: the phase an interruption stopped first (the innermost one), if one did
        self.interrupted_phase: str | None = None
        self.step = 0
        gen, model = job.generation_role, job.generation_model
        self.rollout: Any = RayManagerHandle(job.rollout_actor, name=f"{gen}.{model.name}")
        self.coordinator: Any = job.coordinator
        self.probe: SwitchProbe | None = None
        #: the trainer's ``train`` of the step in flight (awaited by the step or its report)
        self.train: Any = None
        self.clients = RoleClients(
            {r: reg.fetch for r, reg in job.registries.items() if r != gen},
            timeout=self.run.request_timeout,
        )
        self.stages = job.stages

    def measure(self) -> None:
        registries = self.job.registries
        self.probe = SwitchProbe(lambda role: _heads(registries[role]))
        self.coordinator = MeasuredCoordinator(self.coordinator, self.probe)
        self.rollout = MeasuredHandle(
            self.rollout, self.probe, self.job.generation_role, lambda: self.step
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

    def committed(self, row: dict[str, Any], samples: Sequence[Sample]) -> None:
        """A step committed: its metrics to Prometheus and to the trackers, with a few of its
        samples (``tracker_samples``)."""
        self.metrics.committed(row)
        if self.trackers is not None:
            self.trackers.log_metrics(row["step"], step_metrics(row))
            self.trackers.log_samples(row["step"], sample_rows(samples, self.run.tracker_samples))

    def _finalizer(self, batch_id: int, samples: Sequence[Sample]) -> None:
        if self.dump_dir is not None:
            _dump(self.dump_dir, f"batch-{batch_id}.jsonl", samples)

    async def one(self, n: int, producer: StepProducer, push: bool) -> dict[str, Any]:
        """Step ``n``; its row.

        :raises _Failed: the step failed or was interrupted before its commit (the run ends);
            its batch is FAILED and the role it was using released.
        :raises asyncio.CancelledError: interrupted after the commit, while the trainer trains.
        """
        job, run, tl = self.job, self.run, self.timeline
        gen = job.generation_role
        self.step = n
        began = time.perf_counter()
        train = self.train = job.trainer.train.remote(n)
        collector = DeferredCollector(n)
        pushed = None
        try:
            await self.coordinator.begin_batch(n)
        except BaseException as exc:
            if interrupted(exc):
                # The call may have gone through: the trainer's wait must end either way.
                await _fail_batch(self.coordinator, n, exc)
            raise _Failed(exc, collector, train) from exc
        try:
            if n > 0 and gen not in job.residency.free:  # a free rollout never slept
                await onload_generation(self.rollout, gen, tl, n, timeout=run.operation_timeout)
            if push:
                with tl.phase(n, "weight_push"):
                    pushed = await job.trainer.push.remote(str(n))
            spp = run.samples_per_prompt
            with (
                tl.phase(n, "generate"),
                self.printer.waiting(
                    f"step {n} generate", total=run.prompts_per_step * spp, unit="samples"
                ) as bar,
            ):
                await producer.first(n, collector, on_group=lambda done: bar.update(done * spp))
        except BaseException as exc:
            error = await abort_generation(
                self.coordinator, n, self.rollout, exc, timeline=tl, timeout=run.operation_timeout
            )
            raise _Failed(exc if interrupted(exc) else error, collector, train) from exc
        batch = DeferredBatch(
            n,
            collector.samples,
            coordinator=self.coordinator,
            rollout=self.rollout,
            stages=self.stages,
            sink=job.sink,
            clients=self.clients,
            finalizer=self._finalizer,
            timeline=tl,
            release_timeout=run.operation_timeout,
            producer=producer,
            target_groups=run.prompts_per_step,
        )
        try:
            result = await batch.run()
        except BaseException as exc:
            raise _Failed(exc, collector, train, batch) from exc
        with tl.phase(n, "train"):
            trained = await train
        self.train = None
        if self.dump_dir is not None and batch.dropped_samples:
            _dump(self.dump_dir, f"dropped-{n}.jsonl", batch.dropped_samples)
        row = self._row(n, result, batch.originals, began, pushed, trained)
        self.committed(row, batch.originals)
        return row

    def _row(
        self,
        n: int,
        result: BatchResult,
        samples: Sequence[Sample],
        began: float,
        pushed: Any,
        trained: dict[str, Any],
    ) -> dict[str, Any]:
        """The committed step's JSON object."""
        rewards = [float(s.reward or 0.0) for s in samples]
        failures = [
            v
            for stage, r in zip(self.stages, result.reports, strict=False)
            if stage.role is not None
            for k, v in r.counts.items()
            if k.endswith("parse_failures")
        ]
        names = sorted({f for s in samples for f in s.fields})
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
            "teacher_kl": trained.get("teacher_kl"),
            "teacher_logprob_mean": trained.get("teacher_logprob_mean"),
            "tokens": sum(len(s.response_ids) for s in samples),
            "weight_version": samples[0].weight_version if samples else None,
            "fields": {f: sum(f in s.fields for s in samples) for f in names},
            "stages": {r.stage: dict(r.counts) for r in result.reports},
            "dropped": {
                "groups": len(result.dropped),
                "samples": sum(len(d.samples) for d in result.dropped),
                "reasons": dict(
                    collections.Counter(f"{d.stage}: {d.reason}" for d in result.dropped)
                ),
            },
            "generated_groups": result.generated_groups,
            "switches": self.timeline.switches(n),
            "seconds": time.perf_counter() - began,
            "phases": self.timeline.phases(n),
            "pushed_before": pushed,
            "train": {
                k: trained.get(k)
                for k in (
                    "samples",
                    "loss",
                    "policy_loss",
                    "distill_loss",
                    "ratio_mean",
                    "clip_fraction",
                    "grad_norm",
                    "train_seconds",
                    "optimizer_steps",
                    "fields",
                )
            },
        }

    async def failure(self, n: int, failed: _Failed) -> FailedStep:
        """The report of the step that failed or was interrupted."""
        exc = failed.error
        stopped = interrupted(exc)
        samples = failed.samples
        if self.dump_dir is not None:
            _dump(self.dump_dir, f"failed-{n}.jsonl", samples)
        blocked: dict[str, str] = {}
        try:
            status = await self.job.coordinator.describe()
            blocked = dict(status.blocked)
        except Exception as err:  # the coordinator itself may be what failed
            blocked = {"?": f"the coordinator could not be asked: {err}"}
        if stopped:
            text = f"interrupted during {self.interrupted_phase or 'the step'}"
        else:
            text = f"{type(exc).__name__}: {exc}"
        notes = getattr(exc, "__notes__", None)
        if notes:
            text += " (" + "; ".join(notes) + ")"
        if blocked:
            text += "; " + blocked_advice(self.job.name, blocked)
        self.train = None
        return FailedStep(
            step=n,
            error=text,
            kind="interrupted" if stopped else type(exc).__name__,
            sample_ids=tuple(s.id for s in samples),
            blocked=blocked,
            # The batch is FAILED: the trainer's wait ends at once (an interrupted run does
            # not wait long for it either way).
            trainer=(
                failed.trainer or "not asked"
                if failed.train is None
                else await _trainer_saw(failed.train, 5.0 if stopped else 30.0)
            ),
            interrupted=stopped,
        )


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


async def _fail_batch(coordinator: Any, batch_id: int, exc: BaseException) -> None:
    """Fail ``batch_id`` at the coordinator because of ``exc`` (a note on ``exc`` if that
    fails too: the coordinator may be what failed)."""
    try:
        await coordinator.fail_batch(batch_id, describe_failure(exc))
    except Exception as err:
        exc.add_note(f"failing batch {batch_id} at the coordinator failed: {err}")


class _Interrupts:
    """Ctrl-C (SIGINT) and SIGTERM while the steps run, on the running event loop: the first
    cancels the loop's task — the step in flight fails its batch and releases its role, so
    the cancellation reaches every await of it, never the middle of a callback as a
    ``KeyboardInterrupt`` would; later ones are held (``say`` tells the user). Outside the
    main thread nothing is installed."""

    def __init__(self, say: Callable[[str], None]) -> None:
        self.say = say
        self.received = 0
        self._task: asyncio.Task[Any] | None = None
        self._previous: dict[int, Any] = {}
        self._uncancelled = False

    def install(self) -> None:
        """Take SIGINT and SIGTERM over (the handlers before are kept for :meth:`remove`)."""
        if threading.current_thread() is not threading.main_thread():
            return
        self._task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            self._previous[sig] = signal.getsignal(sig)
            loop.add_signal_handler(sig, self._handle)

    def remove(self) -> None:
        """Give SIGINT and SIGTERM back to the handlers they had."""
        loop = asyncio.get_running_loop()
        for sig, previous in self._previous.items():
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous = {}

    def handled(self) -> None:
        """The interruption was dealt with: the task's later awaits are not cancelled again
        (``Task.uncancel``, so ``asyncio.timeout`` blocks of the report work as usual)."""
        if self._task is not None and self.received and not self._uncancelled:
            self._uncancelled = True
            self._task.uncancel()

    def _handle(self) -> None:
        self.received += 1
        if self.received == 1:
            if self._task is not None:
                self._task.cancel()
            return
        self.say("relax run: still stopping the step in flight, please wait …")


class _Failed(Exception):
    """A step failed: the error, the step's collector (and batch, once it began), the
    trainer's pending ``train`` (``None`` in async mode, which asks the trainer only after a
    commit: ``trainer`` then says what it did)."""

    def __init__(
        self,
        error: BaseException,
        collector: DeferredCollector,
        train: Any,
        batch: DeferredBatch | None = None,
        *,
        generated: Sequence[Sample] | None = None,
        trainer: str | None = None,
    ) -> None:
        super().__init__(str(error))
        self.error = error
        self.collector = collector
        self.train = train
        self.batch = batch
        self.generated = None if generated is None else list(generated)
        self.trainer = trainer

    @property
    def samples(self) -> list[Sample]:
        """Every sample the step generated: the batch's (with what stages added and dropped)
        once it began, else the collector's."""
        if self.generated is not None:
            return self.generated
        if self.batch is None:
            return self.collector.samples
        return self.batch.generated_samples()


async def run_loop(
    job: RunJob,
    printer: Printer,
    *,
    steps: int,
    trace: str | None = None,
    dump_dir: str | None = None,
    measure: bool = False,
    trackers: Trackers | None = None,
) -> RunSummary:
    """Run ``steps`` steps on the started ``job``; the summary (a failed step ends the run
    and is in ``summary.failure``; every committed step was printed as it committed).

    Ctrl-C (SIGINT) or SIGTERM, in the main thread, stops the run too: the step in flight is
    cancelled, its batch failed and its roles released (requests in flight aborted), and the
    summary returned has ``interrupted_step``; the signals' handlers are given back on return.

    ``trace``: the Perfetto trace file (rewritten after every batch). ``dump_dir``: each
    committed batch's samples as ``batch-N.jsonl``, a failed step's as ``failed-N.jsonl``.
    ``measure``: time every phase switch and compare it with a copy of its bytes.
    ``trackers``: told the run's config first, then each phase as it ends and each committed
    step's metrics and samples (the caller closes them; with ``strict_trackers`` a tracker's
    failure is raised here, :class:`~relax_core.errors.TrackerError`, after the step in flight).
    """
    began = time.perf_counter()
    summary = RunSummary(job.name, steps, trace=trace)
    summary.startup_seconds = time.monotonic() - printer.began
    printer.started(
        {
            "job": job.name,
            "engine_pids": sorted(job.engine_pids),
            "router_pids": sorted(job.router_pids),
            "startup_seconds": summary.startup_seconds,
        }
    )
    if trackers is not None:
        trackers.log_config(run_description(job))
    loop = _Loop(job, printer, trace=trace, dump_dir=dump_dir, trackers=trackers)
    if measure:
        loop.measure()
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
    signals = _Interrupts(printer.say)
    signals.install()
    try:
        await _steps(loop, summary, steps, signals)
    except asyncio.CancelledError:
        if not signals.received:
            raise
        # Interrupted between steps' own handling (after a commit, the final push): the step
        # in flight, if any, is reported; its batch is committed or failed already.
        signals.handled()
        summary.interrupted_step = loop.step
        if loop.train is not None:
            await _trainer_saw(loop.train, 5.0)
    finally:
        signals.remove()
    summary.seconds = time.perf_counter() - began
    return summary


async def _steps(loop: _Loop, summary: RunSummary, steps: int, signals: _Interrupts) -> None:
    """The steps, then ``--measure``'s copies and the final push, into ``summary``."""
    job, run, printer = loop.job, loop.run, loop.printer
    if run.mode == "async":
        await _async_steps(loop, summary, steps, signals)
        return
    source = open_source(run.dataset, job.pm, seed=run.seed, base=run.base)
    model = job.generation_model
    tokenizer = PromptTokenizer(model.model_path, where=model.path)
    gen_registry = job.registries[job.generation_role]
    step_seconds = 0.0
    async with InferenceClient(
        snapshot_provider=gen_registry.fetch,
        role=job.generation_role,
        timeout=run.request_timeout,
    ) as client:
        generator = Generator(client, tokenizer, model.name, run, shape=job.rollout_shape)
        producer = StepProducer(generator, source)
        summary.weight_versions.append(await loop.rollout.weight_version())
        for n in range(steps):
            try:
                row = await loop.one(n, producer, push=n > 0)
            except _Failed as failed:
                if interrupted(failed.error):
                    summary.interrupted_step = n
                    signals.handled()
                summary.failure = await loop.failure(n, failed)
                loop.metrics.failed.inc()
                printer.failed(summary.failure.row())
                break
            if row["pushed_before"] is not None:
                summary.weight_versions.append(row["pushed_before"]["weight_version"])
            step_seconds += row["seconds"]
            summary.committed.append(row)
            printer.step(row)
    if loop.probe is not None and not summary.interrupted:
        sizes = sorted({s.weight_bytes for s in loop.probe.switches})
        copies = await job.trainer.measure_copy.remote(sizes)
        summary.switching = switch_report(loop.probe.switches, copies, step_seconds)
    if summary.failure is None and summary.committed:
        summary.final_push = await _final_push(job, steps)
        summary.weight_versions.append(summary.final_push["weight_version"])


class _RayTrainer:
    """The trainer actor as the async driver calls it."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def train(self, batch_id: int) -> dict[str, Any]:
        result: dict[str, Any] = await self.actor.train.remote(batch_id)
        return result

    async def push(self, version: str) -> dict[str, Any]:
        result: dict[str, Any] = await self.actor.push.remote(version)
        return result


def async_overlap_note(job: RunJob) -> str | None:
    """What async steps cannot overlap in the started ``job``, or ``None`` (everything): where
    the generation role is not free in the residency plan it takes turns with the roles on its
    GPUs, so only training overlaps generation (the driver's ``switching`` mode)."""
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


async def _async_steps(loop: _Loop, summary: RunSummary, steps: int, signals: _Interrupts) -> None:
    """``mode = "async"``: the steps through the :class:`~relax_core.run.pipeline.AsyncDriver`,
    then the final push, into ``summary``."""
    from relax_core.run.pipeline import AsyncDriver, AsyncSettings, StepOutcome, _StepFailure

    job, run, printer = loop.job, loop.run, loop.printer
    note = async_overlap_note(job)
    if note is not None:
        printer.say(note)
    switching = note is not None
    source = open_source(run.dataset, job.pm, seed=run.seed, base=run.base)
    model = job.generation_model
    tokenizer = PromptTokenizer(model.model_path, where=model.path)
    gen_registry = job.registries[job.generation_role]
    total = run.prompts_per_step

    def on_step(outcome: StepOutcome) -> None:
        n, batch = outcome.step, outcome.batch
        loop.step = n
        if loop.dump_dir is not None and batch.dropped_samples:
            _dump(loop.dump_dir, f"dropped-{n}.jsonl", batch.dropped_samples)
        row = loop._row(
            n, outcome.result, batch.originals, outcome.began, outcome.pushed_before,
            outcome.trained,
        )  # fmt: skip
        row["latency_seconds"] = row["seconds"]
        row["seconds"] = outcome.seconds
        row["async"] = outcome.metrics
        for key in ("importance_weight_mean", "truncated_fraction"):  # the off-policy correction
            if outcome.trained.get(key) is not None:
                row["train"][key] = outcome.trained[key]
        loop.committed(row, batch.originals)
        if outcome.pushed_before is not None:
            summary.weight_versions.append(outcome.pushed_before.get("weight_version"))
        summary.committed.append(row)
        printer.step(row)

    def on_progress(step: int, done: int) -> None:
        printer.status(f"step {step} generate: {done}/{total} groups")

    async with InferenceClient(
        snapshot_provider=gen_registry.fetch,
        role=job.generation_role,
        timeout=run.request_timeout,
    ) as client:
        generator = Generator(client, tokenizer, model.name, run, shape=job.rollout_shape)
        initial = await loop.rollout.weight_version()
        summary.weight_versions.append(initial)
        driver = AsyncDriver(
            AsyncSettings(
                steps=steps,
                prompts_per_step=run.prompts_per_step,
                max_staleness=run.max_staleness,
                stale_action=run.stale_action,
                stream_scoring=run.stream_scoring,
                stream_concurrency=run.stream_concurrency,
                release_timeout=run.operation_timeout,
            ),
            coordinator=loop.coordinator,
            rollout=loop.rollout,
            stages=loop.stages,
            sink=job.sink,
            clients=loop.clients,
            producer=lambda: StepProducer(generator, source),
            trainer=_RayTrainer(job.trainer),
            generation_role=job.generation_role,
            # every role that is not free takes turns: its stages never stream
            deferred_roles=tuple(
                r for r in job.slices if r not in job.residency.free and r != job.generation_role
            ),
            initial_version=initial,
            switching=switching,
            timeline=loop.timeline,
            finalizer=loop._finalizer,
            on_step=on_step,
            on_progress=on_progress,
        )
        try:
            await driver.run()
        except _StepFailure as failed:
            n = failed.step
            loop.step = n
            if interrupted(failed.error):
                summary.interrupted_step = n
                signals.handled()
            report = _Failed(
                failed.error,
                DeferredCollector(n),
                None,
                failed.batch,
                generated=[*failed.samples, *failed.ahead],
                trainer=failed.trainer,
            )
            summary.failure = await loop.failure(n, report)
            loop.metrics.failed.inc()
            printer.failed(summary.failure.row())
    if summary.failure is None and summary.committed:
        summary.final_push = await _final_push(job, steps)
        summary.weight_versions.append(summary.final_push["weight_version"])


async def _final_push(job: RunJob, steps: int) -> dict[str, Any]:
    """Wake rollout once more (every other role sleeps: the run is over) and give it the last
    step's weights."""
    handle = RayManagerHandle(job.rollout_actor, name=job.generation_role)
    began = time.perf_counter()
    if job.generation_role not in job.residency.free:  # a free rollout is awake
        result = await asyncio.wait_for(handle.onload(), job.run.operation_timeout)
        reason = unconfirmed(result, "READY")
        if reason is not None:
            raise LifecycleError(f"the final weight push could not wake rollout: {reason}")
    pushed: dict[str, Any] = await job.trainer.push.remote(str(steps))
    pushed["seconds_with_onload"] = time.perf_counter() - began
    return pushed
