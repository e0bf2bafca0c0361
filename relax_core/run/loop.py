"""The step loop of ``relax run``: generate, score deferred, commit, train, push — N times.

One step ``N`` (``docs/run.md`` draws it):

1. the trainer is asked for batch ``N`` first (``train(N)``): it waits on the coordinator's
   commit gate (``wait_committed``), as any training consumer does;
2. ``begin_batch(N)``: rollout takes its lease; from the second step on it is onloaded
   (``rollout.onload``: every role sleeps after a commit) and the previous step's weights are
   pushed (``weight_push``: the trainer's ``push``, the manager's fenced update; the weight
   version moves);
3. ``generate``: the step's prompts from the data source, ``samples_per_prompt`` samples each,
   through the rollout route, each group into the :class:`~relax_core.coordination.
   DeferredCollector` — a failure here releases rollout (``abort_generation``) and fails the
   batch;
4. the :class:`~relax_core.coordination.DeferredBatch`: rollout offloads itself, the reward
   stage (reward adapters; the reward role's lease when deferred), the teacher stage (prefill
   for the teacher's log-probs or top-k), validation, write-back, the sink put of
   ``train_N``, the finalizer (``--dump-samples``), ``commit_batch(N)``;
5. ``train``: the trainer's answer — it read ``train_N`` with every field, took an optimizer
   step and deleted the partition.

After the last step rollout is onloaded once more and takes the last weights (the run ends
with the trained policy served). The first failure ends the run: nothing is committed for the
failed step, and its report lists the ids of the samples it generated.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Sequence
from typing import Any

import attrs

from relax_core.client.client import InferenceClient
from relax_core.coordination.batch import DeferredBatch, DeferredCollector, abort_generation
from relax_core.coordination.distill import DistillationStage
from relax_core.coordination.handles import RayManagerHandle, unconfirmed
from relax_core.coordination.rewards import RewardStage
from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import RoleClients, Stage
from relax_core.errors import LifecycleError
from relax_core.run.data import open_source
from relax_core.run.generate import Generator, PromptTokenizer
from relax_core.run.job import RunJob
from relax_core.run.measure import MeasuredCoordinator, MeasuredHandle, SwitchProbe, switch_report
from relax_core.run.progress import PhaseTimeline, Printer

__all__ = ["FailedStep", "RunSummary", "blocked_advice", "build_stages", "run_loop"]


@attrs.frozen
class FailedStep:
    """The step that ended the run: its error, the ids of the samples it had generated (none
    of them committed), the leases left BLOCKED (role → why) and what the trainer saw."""

    step: int
    error: str
    kind: str
    sample_ids: tuple[str, ...]
    blocked: dict[str, str]
    trainer: str

    def row(self) -> dict[str, Any]:
        """The JSON object of the failed step."""
        return {
            "step": self.step,
            "failed": True,
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
    rollout published (first: the one it started with), the switch report (``--measure``)."""

    job: str
    steps: int
    committed: list[dict[str, Any]] = attrs.field(factory=list)
    failure: FailedStep | None = None
    weight_versions: list[str | None] = attrs.field(factory=list)
    final_push: dict[str, Any] | None = None
    switching: dict[str, Any] | None = None
    seconds: float = 0.0
    trace: str | None = None

    def row(self) -> dict[str, Any]:
        """The summary JSON object."""
        return {
            "summary": True,
            "job": self.job,
            "steps": self.steps,
            "steps_committed": len(self.committed),
            "failed_step": None if self.failure is None else self.failure.step,
            "weight_versions": self.weight_versions,
            "final_push": self.final_push,
            "reward_means": [r["reward_mean"] for r in self.committed],
            "seconds": self.seconds,
            "trace": self.trace,
            "switching": self.switching,
        }


def build_stages(job: RunJob) -> list[Stage]:
    """The deferred batch's stages: the reward stage, then the teacher stage if any."""
    run = job.run
    adapters = [(job.pm.reward_adapter(r.adapter), r.weight) for r in run.rewards]
    stages: list[Stage] = [
        RewardStage(
            adapters,
            name=run.reward_role or "rewards",
            role=run.reward_role,
            timeout=run.request_timeout,
        )
    ]
    if run.teacher_role:
        stages.append(
            DistillationStage(
                run.teacher_role, top_k=run.teacher_top_k, timeout=run.request_timeout
            )
        )
    return stages


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


class _Loop:
    def __init__(self, job: RunJob, printer: Printer, *, trace: str | None, dump_dir: str | None):
        self.job = job
        self.run = job.run
        self.printer = printer
        self.dump_dir = dump_dir
        self.timeline = PhaseTimeline(printer.event, trace_path=trace, run=f"relax run {job.name}")
        self.step = 0
        gen, model = job.generation_role, job.generation_model
        self.rollout: Any = RayManagerHandle(job.rollout_actor, name=f"{gen}.{model.name}")
        self.coordinator: Any = job.coordinator
        self.probe: SwitchProbe | None = None
        self.clients = RoleClients(
            {r: reg.fetch for r, reg in job.registries.items() if r != gen},
            timeout=self.run.request_timeout,
        )
        self.stages = build_stages(job)

    def measure(self) -> None:
        registries = self.job.registries
        self.probe = SwitchProbe(lambda role: _heads(registries[role]))
        self.coordinator = MeasuredCoordinator(self.coordinator, self.probe)
        self.rollout = MeasuredHandle(
            self.rollout, self.probe, self.job.generation_role, lambda: self.step
        )

    def _finalizer(self, batch_id: int, samples: Sequence[Sample]) -> None:
        if self.dump_dir is not None:
            _dump(self.dump_dir, f"batch-{batch_id}.jsonl", samples)

    async def one(self, n: int, generator: Generator, prompts: Any, push: bool) -> dict[str, Any]:
        """Step ``n``; its row. :raises _Failed: the step failed (the run ends)."""
        job, run, tl = self.job, self.run, self.timeline
        gen = job.generation_role
        self.step = n
        began = time.perf_counter()
        train = job.trainer.train.remote(n)
        collector = DeferredCollector(n)
        pushed = None
        try:
            await self.coordinator.begin_batch(n)
        except Exception as exc:
            raise _Failed(exc, collector, train) from exc
        try:
            if n > 0:
                with tl.phase(n, f"{gen}.onload", lane="leases"):
                    result = await asyncio.wait_for(self.rollout.onload(), run.operation_timeout)
                reason = unconfirmed(result, "READY")
                if reason is not None:
                    raise LifecycleError(f"{gen} onload not confirmed: {reason}")
            if push:
                with tl.phase(n, "weight_push"):
                    pushed = await job.trainer.push.remote(str(n))
            with tl.phase(n, "generate"):
                await generator.generate(
                    n,
                    prompts,
                    collector,
                    on_group=lambda done: self.printer.status(
                        f"  step {n}  generate {done}/{len(prompts)} groups"
                    ),
                )
        except Exception as exc:
            error = await abort_generation(
                self.coordinator, n, self.rollout, exc, timeline=tl, timeout=run.operation_timeout
            )
            raise _Failed(error, collector, train) from exc
        try:
            result = await DeferredBatch(
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
            ).run()
        except Exception as exc:
            raise _Failed(exc, collector, train) from exc
        with tl.phase(n, "train"):
            trained = await train
        samples = collector.samples
        rewards = [float(s.reward or 0.0) for s in samples]
        failures = sum(
            v for r in result.reports for k, v in r.counts.items() if k.endswith("parse_failures")
        )
        teacher = "teacher_topk_ids" if run.teacher_top_k else "teacher_logprobs"
        return {
            "step": n,
            "batch_id": n,
            "partition": result.receipt.partition,
            "samples": result.samples,
            "groups": collector.groups,
            "reward_mean": statistics.fmean(rewards),
            "reward_std": statistics.pstdev(rewards),
            "parse_failures": int(failures) if run.reward_role else None,
            "teacher_kl": trained.get("teacher_kl"),
            "teacher_logprob_mean": trained.get("teacher_logprob_mean"),
            "tokens": sum(len(s.response_ids) for s in samples),
            "weight_version": samples[0].weight_version if samples else None,
            "fields": {
                "reward": sum(s.reward is not None for s in samples),
                "distill": sum(getattr(s, teacher) is not None for s in samples)
                if run.teacher_role
                else None,
            },
            "seconds": time.perf_counter() - began,
            "phases": tl.phases(n),
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
                )
            },
        }

    async def failure(self, n: int, failed: _Failed) -> FailedStep:
        """The report of the step that failed."""
        exc = failed.error
        samples = failed.collector.samples
        if self.dump_dir is not None:
            _dump(self.dump_dir, f"failed-{n}.jsonl", samples)
        blocked: dict[str, str] = {}
        try:
            status = await self.job.coordinator.describe()
            blocked = dict(status.blocked)
        except Exception as err:  # the coordinator itself may be what failed
            blocked = {"?": f"the coordinator could not be asked: {err}"}
        text = f"{type(exc).__name__}: {exc}"
        notes = getattr(exc, "__notes__", None)
        if notes:
            text += " (" + "; ".join(notes) + ")"
        if blocked:
            text += "; " + blocked_advice(self.job.name, blocked)
        return FailedStep(
            step=n,
            error=text,
            kind=type(exc).__name__,
            sample_ids=tuple(s.id for s in samples),
            blocked=blocked,
            trainer=await _trainer_saw(failed.train, 30.0),
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


class _Failed(Exception):
    """A step failed: the error, the step's collector, the trainer's pending ``train``."""

    def __init__(self, error: BaseException, collector: DeferredCollector, train: Any) -> None:
        super().__init__(str(error))
        self.error = error
        self.collector = collector
        self.train = train


async def run_loop(
    job: RunJob,
    printer: Printer,
    *,
    steps: int,
    trace: str | None = None,
    dump_dir: str | None = None,
    measure: bool = False,
) -> RunSummary:
    """Run ``steps`` steps on the started ``job``; the summary (a failed step ends the run
    and is in ``summary.failure``; every committed step was printed as it committed).

    ``trace``: the Perfetto trace file (rewritten after every batch). ``dump_dir``: each
    committed batch's samples as ``batch-N.jsonl``, a failed step's as ``failed-N.jsonl``.
    ``measure``: time every phase switch and compare it with a copy of its bytes.
    """
    run = job.run
    began = time.perf_counter()
    loop = _Loop(job, printer, trace=trace, dump_dir=dump_dir)
    if measure:
        loop.measure()
    if dump_dir is not None:
        os.makedirs(dump_dir, exist_ok=True)
    summary = RunSummary(job.name, steps, trace=trace)
    source = open_source(run.dataset, seed=run.seed)
    model = job.generation_model
    tokenizer = PromptTokenizer(model.model_path, where=model.path)
    gen_registry = job.registries[job.generation_role]
    step_seconds = 0.0
    async with InferenceClient(
        snapshot_provider=gen_registry.fetch,
        role=job.generation_role,
        timeout=run.request_timeout,
    ) as client:
        generator = Generator(client, tokenizer, model.name, run)
        summary.weight_versions.append(await loop.rollout.weight_version())
        for n in range(steps):
            try:
                row = await loop.one(n, generator, source.take(run.prompts_per_step), push=n > 0)
            except _Failed as failed:
                summary.failure = await loop.failure(n, failed)
                printer.failed(summary.failure.row())
                break
            if row["pushed_before"] is not None:
                summary.weight_versions.append(row["pushed_before"]["weight_version"])
            step_seconds += row["seconds"]
            summary.committed.append(row)
            printer.step(row)
    if loop.probe is not None:
        sizes = sorted({s.weight_bytes for s in loop.probe.switches})
        copies = await job.trainer.measure_copy.remote(sizes)
        summary.switching = switch_report(loop.probe.switches, copies, step_seconds)
    if summary.failure is None and summary.committed:
        summary.final_push = await _final_push(job, steps)
        summary.weight_versions.append(summary.final_push["weight_version"])
    summary.seconds = time.perf_counter() - began
    return summary


async def _final_push(job: RunJob, steps: int) -> dict[str, Any]:
    """Wake rollout once more (every other role sleeps: the run is over) and give it the last
    step's weights."""
    handle = RayManagerHandle(job.rollout_actor, name=job.generation_role)
    began = time.perf_counter()
    result = await asyncio.wait_for(handle.onload(), job.run.operation_timeout)
    reason = unconfirmed(result, "READY")
    if reason is not None:
        raise LifecycleError(f"the final weight push could not wake rollout: {reason}")
    pushed: dict[str, Any] = await job.trainer.push.remote(str(steps))
    pushed["seconds_with_onload"] = time.perf_counter() - began
    return pushed
