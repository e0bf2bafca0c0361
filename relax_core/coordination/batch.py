"""DeferredBatch: stage a closed batch on CPU, run the step's stages role by role on shared GPUs,
validate, write back, publish and commit — or fail it, nothing half-published
(``docs/coordination.md``)."""

from __future__ import annotations

import asyncio
import collections
import inspect
import itertools
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, Protocol, Unpack

import attrs

from relax_core.coordination.coordinator import Coordinator
from relax_core.coordination.handles import ManagerHandle, unconfirmed
from relax_core.coordination.residency import ResidencyPlan
from relax_core.coordination.sample import Sample
from relax_core.coordination.sink import BatchSink, SinkReceipt, partition_name
from relax_core.coordination.stages import (
    MoreGroups,
    RoleClients,
    Stage,
    StageContext,
    StageReport,
    check_samples,
    check_stages,
    more_groups,
    stage_fields,
)
from relax_core.coordination.timeline import Timeline
from relax_core.errors import (
    BatchFailedError,
    CoordinationError,
    EmptyBatchError,
    LifecycleError,
    SinkError,
)

#: The most samples one deferred batch stages (the collector and the batch share it).
DEFAULT_MAX_SAMPLES = 65536


class DeferredCollector:
    """Captures the completed groups of batch ``batch_id`` on CPU.

    :raises ValueError: (from :meth:`add`) an empty or mixed group, an id seen before, or more
        than ``max_samples`` samples in all."""

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
class Dropped:
    """A group a stage took out of the batch (never committed), with its samples' ids."""

    group_id: str
    samples: tuple[str, ...]
    stage: str
    reason: str


@attrs.frozen
class BatchResult:
    """A committed batch: its receipt, samples, stage reports, phases and what stages dropped
    or generated."""

    batch_id: int
    receipt: SinkReceipt
    samples: int
    reports: tuple[StageReport, ...]
    phases: dict[str, float]
    dropped: tuple[Dropped, ...] = ()
    generated_groups: int = 0


@attrs.define
class Streamed:
    """What streaming scoring already ran on a batch's groups: the staged copies, how many
    leading stages ran and their reports, the groups dropped before the batch."""

    staged: list[Sample]
    stages: int
    reports: list[StageReport]
    dropped: list[Dropped] = attrs.field(factory=list)
    dropped_samples: list[Sample] = attrs.field(factory=list)


class Producer(Protocol):
    """Generates groups for a batch in flight, called with the generation role's lease held."""

    async def generate(self, batch_id: int, **request: Unpack[MoreGroups]) -> list[list[Sample]]:
        """The groups ``request`` asks for, one list of samples each."""
        ...


Finalizer = Callable[[int, Sequence[Sample]], Any]


class DeferredBatch:
    """One closed batch's stages, from staging to commit.

    :param samples: the originals, written only by the write-back after every stage passed.
    :param rollout: the generation role's manager handle in this process.
    :param finalizer: ``finalizer(batch_id, samples)`` (sync or async) between the put and the
        commit; if it raises, the partition is deleted.
    :param release_timeout: deadline of the generation role's local offload and onload.
    :param producer: what generates more groups when a stage asks (none: such a stage fails).
    :param target_groups: what a filter fills the batch up to (default: ``samples``' groups).
    :raises ValueError: bad stages, more than ``max_samples`` samples, or ``streamed`` copies
        not those of ``samples``."""

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
        producer: Producer | None = None,
        target_groups: int | None = None,
        streamed: Streamed | None = None,
    ) -> None:
        check_stages(stages)
        if streamed is not None and (
            len(streamed.staged) != len(samples)
            or any(c.id != s.id for c, s in zip(streamed.staged, samples, strict=False))
            or not 0 <= streamed.stages <= len(stages)
            or len(streamed.reports) != streamed.stages
        ):
            raise ValueError(
                f"batch {batch_id}: the streamed copies ({len(streamed.staged)}) or stages "
                f"({streamed.stages}) do not match the batch's {len(samples)} samples and "
                f"{len(stages)} stages"
            )
        if len(samples) > max_samples:
            raise ValueError(f"batch {batch_id}: {len(samples)} samples > {max_samples}")
        self.batch_id = batch_id
        self.originals = list(samples)
        self.coordinator, self.rollout, self.stages = coordinator, rollout, tuple(stages)
        self.sink, self.clients = sink, clients or RoleClients({})
        self.finalizer, self.timeline, self.producer = finalizer, timeline or Timeline(), producer
        self.release_timeout, self.max_samples = release_timeout, max_samples
        self.target_groups = (
            target_groups if target_groups is not None else len({s.group_id for s in samples})
        )
        self.fields = stage_fields(self.stages)
        self.streamed = streamed
        self.staged: list[Sample] = []
        self.dropped: list[Dropped] = list(streamed.dropped) if streamed else []
        self.dropped_samples: list[Sample] = list(streamed.dropped_samples) if streamed else []
        self.generated_groups = 0
        self._generation_role = ""
        self._deferred: frozenset[str] = frozenset()
        self._slices: dict[str, str] = {}
        self._residency = ResidencyPlan()
        #: role -> its models awake for this batch
        self._awake: dict[str, tuple[str, ...]] = {}
        #: role -> the operation id of its activation
        self._operation: dict[str, str] = {}
        self._leases = itertools.count(1)  # a number new for each lease the batch takes
        self._committed = False

    async def run(self) -> BatchResult:
        """Score, validate, write back, publish and commit; the result.

        :raises RelaxError: whatever failed; the batch is FAILED and nothing was committed."""
        try:
            result = await self._run()
        except BaseException as exc:
            if not self._committed:
                await self._fail(exc)
            try:  # the trace of a failed batch too
                self.timeline.flush()
            except OSError as second:
                exc.add_note(f"the trace file could not be written either: {second}")
            raise
        try:
            self.timeline.flush()
        except OSError as exc:
            exc.add_note(
                f"batch {self.batch_id} was committed; only its trace file could not be written"
            )
            raise
        return result

    async def _run(self) -> BatchResult:
        n, tl = self.batch_id, self.timeline
        streamed = self.streamed
        with tl.phase(n, "stage_copies"):
            if streamed is not None:
                self.staged = list(streamed.staged)
            else:
                self.staged = [s.staged_copy(self.fields) for s in self.originals]
        status = await self.coordinator.describe()
        self._generation_role = gen = status.generation_role
        self._deferred = frozenset(status.deferred_roles)
        self._slices = dict(status.slices)
        self._residency = status.residency
        if gen not in self._residency.free:
            self._awake[gen] = ()  # the producer generated with it; it holds its lease
        reports: list[StageReport] = list(streamed.reports) if streamed else []
        first = streamed.stages if streamed else 0
        released: asyncio.Future[None] | None = None
        try:
            for index, stage in enumerate(self.stages[first:], first):
                ctx = StageContext(n, self.clients, _Control(self, index))
                reports.append(await self._run_leased(stage, self.staged, ctx))
            # The roles sleep while the batch is checked and put; the commit waits for them.
            released = asyncio.ensure_future(self._release_all(None))
            await asyncio.sleep(0)  # their first calls sent before the work below holds the loop
            if not self.originals:  # never committed nor trained: an empty batch has no signal
                reasons = collections.Counter(f"{d.stage}: {d.reason}" for d in self.dropped)
                raise EmptyBatchError(n, reasons)
            with tl.phase(n, "validate"):
                check_samples(self.staged, self.fields.values())
            with tl.phase(n, "write_back"):
                for original, staged in zip(self.originals, self.staged, strict=True):
                    original.write_back(staged, self.fields)
            receipt = await self._publish(released)
        except BaseException as exc:
            done = released or asyncio.ensure_future(self._release_all(exc))
            await asyncio.wait([done])
            if not done.cancelled() and (second := done.exception()) not in (None, exc):
                exc.add_note(
                    f"then releasing the roles it used failed too: {describe_failure(second)}"
                )
            raise
        self._committed = True
        return BatchResult(
            n,
            receipt,
            len(self.originals),
            tuple(reports),
            tl.phases(n),
            tuple(self.dropped),
            self.generated_groups,
        )

    async def _acquire(self, role: str, models: tuple[str, ...], *, student: bool = False) -> None:
        """Make ``role``'s ``models`` awake, releasing first every awake role it does not fit
        beside; ``student``: its weight version checked."""
        if role in self._residency.free:
            return
        held = self._awake.get(role)
        if held is not None and (role == self._generation_role or held == models):
            if student:
                await self._check_weight_version(role)
            return
        if held is not None:
            await self._release(role, None)
        slice_id = self._slices.get(role, role)
        keep: list[str] = []
        for other in list(self._awake):
            if self._slices.get(other, other) != slice_id:
                continue
            if self._residency.fits(slice_id, {*keep, other, role}):
                keep.append(other)
            else:
                await self._release(other, None)
        n, tl = self.batch_id, self.timeline
        self._awake[role] = models  # from here on a failure releases it (activation in flight)
        if role == self._generation_role:
            await self.coordinator.begin_student_scoring(n)
            what = f"{'student restore' if student else 'onload'} of {role!r}"
            timeout = self.release_timeout
            await onload_generation(self.rollout, role, tl, n, timeout=timeout, what=what)
            if student:
                await self._check_weight_version(role)
            return
        op = f"{n}:{role}:{next(self._leases)}"
        self._operation[role] = op
        with tl.phase(n, f"{role}.onload", lane="leases"):
            await self.coordinator.activate(role, f"{op}:activate", batch_id=n, models=models)

    async def _release(self, role: str, failure: BaseException | None) -> None:
        self._awake.pop(role, None)
        n, tl = self.batch_id, self.timeline
        if role == self._generation_role:
            timeout, abort = self.release_timeout, failure is not None
            await release_generation(
                self.coordinator, n, self.rollout, role, tl, timeout=timeout, abort=abort
            )
            return
        if failure is not None:
            await self._fail(failure)
        op = self._operation.pop(role, f"{n}:{role}:{next(self._leases)}")
        with tl.phase(n, f"{role}.offload", lane="leases"):
            await self.coordinator.deactivate(role, f"{op}:deactivate", batch_id=n)

    async def _release_all(self, failure: BaseException | None) -> None:
        """Release every role still awake, each tried; the first error raised, the rest noted."""
        errors: list[BaseException] = []
        for role in list(self._awake):
            try:
                await self._release(role, failure)
            except BaseException as exc:
                errors.append(exc)
        if errors:
            for other in errors[1:]:
                errors[0].add_note(f"releasing another role failed too: {other}")
            raise errors[0]

    async def _run_leased(
        self, stage: Stage, samples: Sequence[Sample], ctx: StageContext
    ) -> StageReport:
        role = stage.role
        if role is not None and (role == self._generation_role or role in self._deferred):
            await self._acquire(role, stage.models, student=role == self._generation_role)
        with self.timeline.phase(self.batch_id, stage.name, lane=stage.name):
            return await stage.run(samples, ctx)

    def generated_samples(self) -> list[Sample]:
        """Every sample generated into the batch: those it holds and those stages dropped."""
        return [*self.originals, *self.dropped_samples]

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

    async def _publish(self, released: Awaitable[None]) -> SinkReceipt:
        """Put, finalize, commit once ``released`` — settled once: a failure deletes the put."""
        n, tl = self.batch_id, self.timeline
        partition = partition_name(n)
        try:
            with tl.phase(n, "sink_put"):
                receipt = await self.sink.put(partition, self.originals, is_last=True)
        except BaseException as exc:
            raise SinkError(
                partition, f"put failed ({type(exc).__name__}: {exc}){await self._delete()}"
            ) from exc
        if receipt != SinkReceipt(partition, len(self.originals), True):
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
            await released  # every role asleep: the commit needs it
            with tl.phase(n, "commit"):
                await self.coordinator.commit_batch(n, receipt)
        except BaseException as exc:
            exc.add_note(f"the batch was put, not committed{await self._delete()}")
            raise
        return receipt

    async def _delete(self) -> str:
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


class _Control:
    """One stage's view of its batch (:class:`~relax_core.coordination.stages.BatchControl`)."""

    def __init__(self, batch: DeferredBatch, index: int) -> None:
        self._batch = batch
        self._index = index
        self._stage = batch.stages[index].name

    @property
    def upstream(self) -> tuple[Stage, ...]:
        return self._batch.stages[: self._index]

    @property
    def target_groups(self) -> int:
        return self._batch.target_groups

    async def generate(self, **request: Unpack[MoreGroups]) -> list[Sample]:
        b, stage = self._batch, self._stage
        n, tl, request = b.batch_id, b.timeline, more_groups(self._stage, request)
        if b.producer is None:
            raise CoordinationError(
                f"stage {stage!r} asks for more generation, but batch {n} has no producer; "
                "give DeferredBatch(producer=...) (relax run does)"
            )
        await b._acquire(b._generation_role, ())
        with tl.phase(n, f"{stage}.generate", lane="generate"):
            groups = await b.producer.generate(n, **request)
        samples = [s for group in groups for s in group]
        b.generated_groups += len({s.group_id for s in samples})
        return samples

    def add(self, samples: Sequence[Sample]) -> list[Sample]:
        b = self._batch
        n, ids, groups = b.batch_id, {s.id for s in b.originals}, {s.group_id for s in b.originals}
        if len(b.originals) + len(samples) > b.max_samples:
            raise ValueError(f"batch {n}: adding {len(samples)} samples passes {b.max_samples}")
        for s in samples:
            if not isinstance(s, Sample):
                raise ValueError(f"batch {n}: {type(s).__name__} is not a Sample")
            if s.id in ids or s.group_id in groups:
                raise ValueError(
                    f"batch {n}: sample {s.id!r} (group {s.group_id!r}) is in the batch already"
                )
        staged = [s.staged_copy(b.fields) for s in samples]
        b.originals.extend(samples)
        b.staged.extend(staged)
        return staged

    def drop(self, group_ids: Iterable[str], reason: str) -> int:
        b, wanted = self._batch, set(group_ids)
        kept: list[tuple[Sample, Sample]] = []
        gone: dict[str, list[Sample]] = {}
        for original, staged in zip(b.originals, b.staged, strict=True):
            if original.group_id in wanted:
                gone.setdefault(original.group_id, []).append(original)
            else:
                kept.append((original, staged))
        if unknown := wanted - set(gone):
            raise ValueError(
                f"stage {self._stage!r} dropped group(s) {sorted(unknown)} that are not in batch "
                f"{b.batch_id}"
            )
        b.originals = [o for o, _ in kept]
        b.staged = [s for _, s in kept]
        for gid, samples in gone.items():
            b.dropped.append(Dropped(gid, tuple(s.id for s in samples), self._stage, reason))
            b.dropped_samples.extend(samples)
        return sum(len(samples) for samples in gone.values())

    async def run_stage(self, stage: Stage, samples: Sequence[Sample]) -> StageReport:
        batch = self._batch
        ctx = StageContext(batch.batch_id, batch.clients, self)
        return await batch._run_leased(stage, samples, ctx)


def interrupted(exc: BaseException) -> bool:
    """Whether ``exc`` is an interruption (the task cancelled, Ctrl-C), not a failure."""
    return isinstance(exc, asyncio.CancelledError | KeyboardInterrupt)


def describe_failure(exc: BaseException) -> str:
    """``Type: message`` of a failure; ``interrupted`` for an interruption."""
    if interrupted(exc):
        return "interrupted (its task was cancelled: Ctrl-C or a shutdown)"
    return f"{type(exc).__name__}: {exc}"


async def _deadline(call: Any, timeout: float) -> Any:
    """Await ``call`` for at most ``timeout`` s; a late call is left running, its result ignored."""
    task = asyncio.ensure_future(call)
    try:
        async with asyncio.timeout(timeout):
            return await asyncio.shield(task)
    except TimeoutError:
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
        raise


async def onload_generation(
    rollout: ManagerHandle,
    gen: str,
    timeline: Timeline,
    batch_id: int,
    *,
    timeout: float,
    what: str | None = None,
) -> None:
    """Onload the generation role locally for batch ``batch_id``.

    :raises LifecycleError: (``what``: its message's start) the onload was not confirmed on
        every replica.
    :raises TimeoutError: it did not answer within ``timeout`` seconds (it is left running)."""
    with timeline.phase(batch_id, f"{gen}.onload", lane="leases"):
        result = await _deadline(rollout.onload(), timeout)
    reason = unconfirmed(result, "READY")
    if reason is not None:
        raise LifecycleError(f"{what or f'{gen} onload not confirmed'}: {reason}")


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
    """Offload the generation role locally (``abort``: its requests aborted, not drained) and
    acknowledge it once confirmed.

    :raises LifecycleError: not confirmed: the batch FAILED, the lease left BLOCKED."""
    offload = getattr(rollout, "abort_and_offload", None) if abort else None
    try:
        with timeline.phase(batch_id, f"{gen}.offload", lane="leases"):
            result = await _deadline((offload or rollout.offload)(), timeout)
    except BaseException as exc:
        timed_out = isinstance(exc, TimeoutError)
        what = f"not confirmed within {timeout:g}s" if timed_out else describe_failure(exc)
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
    """The producer failed after ``begin_batch``: release the generation role (aborting its
    requests) and fail the batch; the error to raise."""
    gen = (await coordinator.describe()).generation_role
    cause = error if isinstance(error, str) else describe_failure(error)
    why = ""
    try:
        timeline = timeline or Timeline()
        await release_generation(
            coordinator, batch_id, rollout, gen, timeline, timeout=timeout, abort=True
        )
    except LifecycleError as exc:
        why = f"; {exc}"
    await coordinator.fail_batch(batch_id, f"generation failed: {cause}")
    return BatchFailedError(batch_id, f"generation failed: {cause}{why}")
