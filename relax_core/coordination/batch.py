"""DeferredBatch: stage a closed batch on CPU, score it role by role on shared GPUs, validate,
write back, publish to the batch sink and commit — or fail it, with nothing half-published.

The producer (the rollout workload) calls ``begin_batch(N)``, generates, and hands every
completed group to a :class:`DeferredCollector` instead of the sink. :class:`DeferredBatch` then
runs the reference's fixed sequence::

    stage copies of the samples
    -> generation role offload (local) + acknowledgment
    -> each reward stage   (its role activated, scored, deactivated)
    -> each teacher stage  (the same)
    -> each student stage  (begin_student_scoring, local onload, weight-version check, prefill,
                            local offload + acknowledgment — in ``finally``)
    -> validate the staged fields
    -> write them back to the original samples
    -> sink put (train_N, is_last=True)  -> finalizer  -> commit_batch(N, receipt)

Publication settles once: a failed put deletes what it may have written, a finalizer that fails
after the put deletes the partition, a refused commit deletes it too — and none of them commits.
Any failure fails the batch at the coordinator (waking ``wait_committed`` waiters) and is
re-raised; so does a cancellation (Ctrl-C), recorded as ``interrupted``. A stage's role is
deactivated whatever the stage did; when the stage failed or was interrupted the batch is
FAILED first, so the coordinator aborts the role's requests still in flight rather than
waiting for them.

If the producer fails after ``begin_batch``, :func:`abort_generation` releases the generation
role locally (its requests in flight aborted) and acknowledges only a confirmed release;
otherwise the batch error says "release unconfirmed" and the lease stays BLOCKED.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import attrs

from relax_core.coordination.coordinator import Coordinator
from relax_core.coordination.handles import ManagerHandle, unconfirmed
from relax_core.coordination.sample import Sample
from relax_core.coordination.sink import BatchSink, SinkReceipt, partition_name
from relax_core.coordination.stages import (
    RoleClients,
    Stage,
    StageContext,
    StageReport,
    check_stages,
)
from relax_core.coordination.timeline import Timeline
from relax_core.coordination.validation import check_samples
from relax_core.errors import (
    BatchFailedError,
    CoordinationError,
    LifecycleError,
    SinkError,
)

T = TypeVar("T")

__all__ = [
    "DEFAULT_MAX_SAMPLES",
    "BatchResult",
    "DeferredBatch",
    "DeferredCollector",
    "abort_generation",
]

#: The most samples one deferred batch stages (the collector and the batch share it).
DEFAULT_MAX_SAMPLES = 65536


class DeferredCollector:
    """Captures the completed groups of batch ``batch_id`` on CPU (where the generator would
    have written them to the sink).

    :raises ValueError: (from :meth:`add`) an empty group, a group mixing group ids, a group id
        or sample id seen before, or more than ``max_samples`` samples in all.
    """

    def __init__(self, batch_id: int, *, max_samples: int = DEFAULT_MAX_SAMPLES) -> None:
        self.batch_id = batch_id
        self.max_samples = max_samples
        self._samples: list[Sample] = []
        self._groups: set[str] = set()
        self._ids: set[str] = set()

    def add(self, group: Sequence[Sample]) -> None:
        """Capture one completed group (all the samples of one prompt)."""
        if not group:
            raise ValueError(f"batch {self.batch_id}: an empty group")
        gid = group[0].group_id
        for s in group:
            if not isinstance(s, Sample):
                raise ValueError(f"batch {self.batch_id}: {type(s).__name__} is not a Sample")
            if s.group_id != gid:
                raise ValueError(
                    f"batch {self.batch_id}: group {gid!r} holds sample {s.id!r} of group "
                    f"{s.group_id!r}; add each group separately"
                )
            if s.id in self._ids:
                raise ValueError(f"batch {self.batch_id}: sample id {s.id!r} added twice")
        if gid in self._groups:
            raise ValueError(f"batch {self.batch_id}: group {gid!r} added twice")
        if len(self._samples) + len(group) > self.max_samples:
            raise ValueError(
                f"batch {self.batch_id}: more than max_samples={self.max_samples} samples"
            )
        self._groups.add(gid)
        self._ids.update(s.id for s in group)
        self._samples.extend(group)

    @property
    def samples(self) -> list[Sample]:
        """Every captured sample, in capture order (the original objects)."""
        return list(self._samples)

    @property
    def groups(self) -> int:
        """Groups captured."""
        return len(self._groups)


@attrs.frozen
class BatchResult:
    """A committed batch: its receipt, sample count, each stage's report and phase timings."""

    batch_id: int
    receipt: SinkReceipt
    samples: int
    reports: tuple[StageReport, ...]
    phases: dict[str, float]


Finalizer = Callable[[int, Sequence[Sample]], Any]


class DeferredBatch:
    """One closed batch's deferred scoring, from staging to commit.

    :param batch_id: the batch the producer began (``coordinator.begin_batch``).
    :param samples: the original samples (e.g. ``collector.samples``); they are only written
        to by the write-back, after every stage passed and validated.
    :param coordinator: a :class:`~relax_core.coordination.coordinator.Coordinator`: the
        :class:`~relax_core.coordination.coordinator.LifecycleCoordinator` or a
        :class:`~relax_core.coordination.remote.RemoteCoordinator`.
    :param rollout: the generation role's manager handle in this process (a
        :class:`~relax_core.coordination.handles.LocalManagerHandle`; with student stages it
        needs ``weight_version()`` too).
    :param stages: in the reference's order (reward, teacher, student); checked here.
    :param sink: where the batch is published (partition ``train_N``).
    :param clients: each role's discovery source, for stages that call engines.
    :param finalizer: ``finalizer(batch_id, samples)`` (sync or async) after the put and before
        the commit: debug dumps, metrics. If it raises, the partition is deleted.
    :param timeline: where phase durations go (default: a private one).
    :param release_timeout: deadline of the generation role's local offload and onload.
    :raises ValueError: stages out of order or more samples than ``max_samples``.
    """

    def __init__(
        self,
        batch_id: int,
        samples: Sequence[Sample],
        *,
        coordinator: Coordinator,
        rollout: ManagerHandle,
        stages: Sequence[Stage],
        sink: BatchSink,
        clients: RoleClients | None = None,
        finalizer: Finalizer | None = None,
        timeline: Timeline | None = None,
        release_timeout: float = 180.0,
        max_samples: int = DEFAULT_MAX_SAMPLES,
    ) -> None:
        check_stages(stages)
        if len(samples) > max_samples:
            raise ValueError(f"batch {batch_id}: {len(samples)} samples > {max_samples}")
        self.batch_id = batch_id
        self.originals = list(samples)
        self.coordinator = coordinator
        self.rollout = rollout
        self.stages = tuple(stages)
        self.sink = sink
        self.clients = clients or RoleClients({})
        self.finalizer = finalizer
        self.timeline = timeline or Timeline()
        self.release_timeout = release_timeout
        self.staged: list[Sample] = []
        self._committed = False

    async def run(self) -> BatchResult:
        """Score, validate, write back, publish and commit; return the result.

        :raises RelaxError: whatever failed (a :class:`~relax_core.errors.LeaseBlockedError`,
            :class:`~relax_core.errors.ScoringError`, :class:`~relax_core.errors.SinkError`,
            :class:`~relax_core.errors.BatchFailedError`, …); the batch is FAILED at the
            coordinator and nothing was committed.
        """
        try:
            result = await self._run()
        except BaseException as exc:
            if not self._committed:
                await self._fail(exc)
            self._flush(exc)
            raise
        try:
            self.timeline.flush()
        except OSError as exc:
            exc.add_note(
                f"batch {self.batch_id} was committed; only its trace file could not be written"
            )
            raise
        return result

    def _flush(self, failure: BaseException) -> None:
        """Write the trace of a failed batch too; a trace that cannot be written is noted on
        the batch's own error (which is what the caller must see)."""
        try:
            self.timeline.flush()
        except OSError as exc:
            failure.add_note(f"the trace file could not be written either: {exc}")

    async def _run(self) -> BatchResult:
        n, tl = self.batch_id, self.timeline
        writes = frozenset().union(*(s.writes for s in self.stages))
        with tl.phase(n, "stage_copies"):
            self.staged = [s.staged_copy() for s in self.originals]
            for s in self.staged:
                s.clear_scored(writes)
        status = await self.coordinator.describe()
        gen: str = status.generation_role
        deferred = set(status.deferred_roles)
        ctx = StageContext(n, self.clients)
        await release_generation(
            self.coordinator, n, self.rollout, gen, tl, timeout=self.release_timeout
        )
        reports: list[StageReport] = []
        for stage in self.stages:
            if stage.phase == "student":
                reports.append(await self._student(stage, gen, ctx))
            elif stage.role == gen:
                raise CoordinationError(
                    f"stage {stage.name!r} ({stage.phase}) uses the generation role {gen!r}; only "
                    "a student stage may (its weights are restored for it)"
                )
            elif stage.role in deferred:
                reports.append(await self._leased(stage, ctx))
            else:
                reports.append(await self._run_stage(stage, ctx))
        top_k = max((s.top_k for s in self.stages), default=0)
        with tl.phase(n, "validate"):
            check_samples(self.staged, writes, top_k)
        with tl.phase(n, "write_back"):
            for original, staged in zip(self.originals, self.staged, strict=True):
                original.write_back(staged)
        receipt = await self._publish()
        self._committed = True
        return BatchResult(n, receipt, len(self.originals), tuple(reports), tl.phases(n))

    async def _leased(self, stage: Stage, ctx: StageContext) -> StageReport:
        """Activate the stage's role, run it, deactivate the role whatever happened.

        A stage that failed or was interrupted fails the batch *before* the deactivation, so
        the coordinator aborts the role's requests still in flight instead of waiting for
        them. An activation that was interrupted goes on in the coordinator: the role is
        deactivated after it too.
        """
        n, tl, role = self.batch_id, self.timeline, stage.role
        assert role is not None
        op = f"{n}:{stage.name}:{role}"

        async def deactivate(failure: BaseException | None) -> None:
            if failure is not None:
                await self._fail(failure)
            with tl.phase(n, f"{role}.offload", lane="leases"):
                await self.coordinator.deactivate(role, f"{op}:deactivate", batch_id=n)

        what = f"deactivating {role!r}"
        try:
            with tl.phase(n, f"{role}.onload", lane="leases"):
                await self.coordinator.activate(role, f"{op}:activate", batch_id=n)
        except BaseException as exc:
            if interrupted(exc):
                await _noting(deactivate(exc), exc, what)
            raise
        return await _then(self._run_stage(stage, ctx), deactivate, what)

    async def _student(self, stage: Stage, gen: str, ctx: StageContext) -> StageReport:
        """Restore the policy, check its weight version, prefill, release it again (finally)."""
        n, tl = self.batch_id, self.timeline
        await self.coordinator.begin_student_scoring(n)

        async def restore_and_run() -> StageReport:
            with tl.phase(n, f"{gen}.onload", lane="leases"):
                result = await _deadline(self.rollout.onload(), self.release_timeout)
            reason = unconfirmed(result, "READY")
            if reason is not None:
                raise LifecycleError(f"student restore of {gen!r}: {reason}")
            await self._check_weight_version(gen)
            return await self._run_stage(stage, ctx)

        async def release(failure: BaseException | None) -> None:
            await release_generation(
                self.coordinator,
                n,
                self.rollout,
                gen,
                tl,
                timeout=self.release_timeout,
                abort=failure is not None,
            )

        return await _then(restore_and_run(), release, f"releasing {gen!r}")

    async def _run_stage(self, stage: Stage, ctx: StageContext) -> StageReport:
        with self.timeline.phase(self.batch_id, stage.name, lane=stage.name):
            return await stage.run(self.staged, ctx)

    async def _check_weight_version(self, gen: str) -> None:
        versions = {s.weight_version for s in self.originals}
        if len(versions) > 1:
            raise LifecycleError(
                f"student scoring: the batch mixes weight versions {sorted(map(str, versions))}"
            )
        wanted = next(iter(versions), None)
        get = getattr(self.rollout, "weight_version", None)
        if get is None:
            raise LifecycleError(
                f"student scoring: the {gen!r} handle cannot report its weight version"
            )
        have = await get()
        if have != wanted:
            raise LifecycleError(
                f"student restore of {gen!r}: it came back with weight version {have!r}, but the "
                f"batch was generated with {wanted!r}; student log-probs would not match"
            )

    async def _publish(self) -> SinkReceipt:
        """Put, finalize, commit — settled once: on any failure the partition is deleted."""
        n, tl = self.batch_id, self.timeline
        partition = partition_name(n)
        try:
            with tl.phase(n, "sink_put"):
                receipt = await self.sink.put(partition, self.originals, is_last=True)
        except BaseException as exc:
            raise SinkError(
                partition, f"put failed ({type(exc).__name__}: {exc}){await self._delete()}"
            ) from exc
        if (
            not isinstance(receipt, SinkReceipt)
            or receipt.partition != partition
            or not receipt.is_last
            or receipt.count != len(self.originals)
        ):
            raise SinkError(
                partition,
                f"the sink answered {receipt!r} for a put of {len(self.originals)} samples "
                f"closing {partition!r}{await self._delete()}",
            )
        if self.finalizer is not None:
            try:
                with tl.phase(n, "finalize"):
                    out = self.finalizer(n, self.originals)
                    if inspect.isawaitable(out):
                        await out
            except BaseException as exc:
                raise BatchFailedError(
                    n,
                    f"the finalizer failed after the sink put ({type(exc).__name__}: {exc})"
                    f"{await self._delete()}; not committed",
                ) from exc
        try:
            with tl.phase(n, "commit"):
                await self.coordinator.commit_batch(n, receipt)
        except BaseException as exc:
            exc.add_note(f"commit refused{await self._delete()}")
            raise
        return receipt

    async def _delete(self) -> str:
        """Delete this batch's partition; a note for the error saying what happened."""
        partition = partition_name(self.batch_id)
        try:
            existed = await self.sink.delete(partition)
        except Exception as exc:
            return (
                f"; deleting partition {partition!r} failed too ({type(exc).__name__}: {exc}): "
                "it may be left in the sink, delete it before training"
            )
        return f"; partition {partition!r} deleted" if existed else ""

    async def _fail(self, exc: BaseException) -> None:
        try:
            await self.coordinator.fail_batch(self.batch_id, describe_failure(exc))
        except BatchFailedError:
            pass  # already failed, with its first cause
        except Exception as fail_exc:
            exc.add_note(f"failing batch {self.batch_id} at the coordinator failed: {fail_exc}")


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is an interruption (the task cancelled, Ctrl-C), not a failure."""
    return isinstance(exc, asyncio.CancelledError | KeyboardInterrupt)


def describe_failure(exc: BaseException) -> str:
    """``Type: message`` of a failure; ``interrupted`` for an interruption."""
    if interrupted(exc):
        return "interrupted (its task was cancelled: Ctrl-C or a shutdown)"
    return f"{type(exc).__name__}: {exc}"


async def _noting(cleanup: Awaitable[None], exc: BaseException, what: str) -> None:
    """Await ``cleanup`` while ``exc`` is being raised: its failure becomes a note on ``exc``
    saying ``what`` failed too."""
    try:
        await cleanup
    except BaseException as second:
        exc.add_note(f"then {what} failed too: {type(second).__name__}: {second}")


async def _then(
    body: Awaitable[T], cleanup: Callable[[BaseException | None], Awaitable[None]], what: str
) -> T:
    """Await ``body``, then ``cleanup(failure)`` whatever happened (``failure``: the body's
    error, or ``None``). When both fail, the body's error is raised with a note saying
    ``what`` failed too; when only the cleanup fails, its error."""
    try:
        result = await body
    except BaseException as exc:
        await _noting(cleanup(exc), exc, what)
        raise
    await cleanup(None)
    return result


async def _deadline(call: Any, timeout: float) -> Any:
    """Await ``call`` for at most ``timeout`` s; the call itself is not cancelled (a blocking
    manager call in a thread cannot be), its late result is ignored."""
    task = asyncio.ensure_future(call)
    try:
        return await asyncio.wait_for(asyncio.shield(task), timeout)
    except TimeoutError:
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise


async def release_generation(
    coordinator: Coordinator,
    batch_id: int,
    rollout: ManagerHandle,
    gen: str,
    timeline: Timeline,
    *,
    timeout: float,
    abort: bool = False,
) -> None:
    """Offload the generation role locally and acknowledge it — only when confirmed.

    ``abort``: its requests in flight are of no use (the batch failed or was interrupted):
    abort them instead of draining them (``abort_and_offload()``, where the handle has it).

    :raises LifecycleError: the offload failed, timed out or was not confirmed: the batch is
        FAILED with "release unconfirmed" and the lease stays BLOCKED.
    """
    offload = getattr(rollout, "abort_and_offload", None) if abort else None
    try:
        with timeline.phase(batch_id, f"{gen}.offload", lane="leases"):
            result = await _deadline((offload or rollout.offload)(), timeout)
    except BaseException as exc:
        what = f"{type(exc).__name__}: {exc}" if not isinstance(exc, TimeoutError) else (
            f"not confirmed within {timeout:g}s"
        )  # fmt: skip
        await coordinator.fail_batch(
            batch_id, f"{gen} offload failed: {what}", release_unconfirmed=True
        )
        raise LifecycleError(f"{gen} release unconfirmed: its offload {what}") from exc
    reason = unconfirmed(result, "SLEEPING")
    if reason is not None:
        await coordinator.fail_batch(
            batch_id, f"{gen} offload not confirmed: {reason}", release_unconfirmed=True
        )
        raise LifecycleError(f"{gen} release unconfirmed: {reason}")
    with timeline.phase(batch_id, f"{gen}.ack", lane="leases"):
        await coordinator.acknowledge_rollout_offloaded(batch_id, result)


async def abort_generation(
    coordinator: Coordinator,
    batch_id: int,
    rollout: ManagerHandle,
    error: BaseException | str,
    *,
    timeline: Timeline | None = None,
    timeout: float = 180.0,
) -> BatchFailedError:
    """The producer failed after ``begin_batch``: release the generation role, fail the batch.

    The generation role is offloaded locally, its requests in flight aborted rather than
    drained; only a confirmed release is acknowledged (the lease goes back to SLEEPING).
    Otherwise the lease stays BLOCKED and the error says "release unconfirmed". Returns the
    error to raise (it names the batch and the cause).
    """
    status = await coordinator.describe()
    gen = status.generation_role
    cause = error if isinstance(error, str) else describe_failure(error)
    try:
        await release_generation(
            coordinator,
            batch_id,
            rollout,
            gen,
            timeline or Timeline(),
            timeout=timeout,
            abort=True,
        )
    except LifecycleError as exc:
        await coordinator.fail_batch(batch_id, f"generation failed: {cause}")
        return BatchFailedError(batch_id, f"generation failed: {cause}; {exc}")
    await coordinator.fail_batch(batch_id, f"generation failed: {cause}")
    return BatchFailedError(batch_id, f"generation failed: {cause}")
