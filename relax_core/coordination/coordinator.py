"""LifecycleCoordinator: shared-GPU leases (over the ``LeaseEngine``), operation dedupe and the
training-batch commit gate: a batch commits only when every role sleeps and the batch sink
acknowledged the write (docs/coordination.md)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import attrs

from relax_core.coordination.handles import ManagerHandle, unconfirmed
from relax_core.coordination.leases import ABORT, LateReply, LeaseEngine, SwitchRecord
from relax_core.coordination.residency import ResidencyPlan
from relax_core.coordination.sink import SinkReceipt, partition_name
from relax_core.coordination.states import BatchState, LeaseState
from relax_core.errors import BatchFailedError, CoordinationError, LeaseBlockedError

#: The deadline of one manager onload/offload RPC, in seconds.
DEFAULT_OPERATION_TIMEOUT = 180.0
#: Committed batch ids remembered after eviction (late waiters and repeats still see COMMITTED).
COMMITTED_HISTORY = 1024
#: Fingerprints of evicted operations remembered (a reused id is still refused).
RETIRED_HISTORY = 8192

_L = LeaseState
_B = BatchState
Fingerprint = tuple[str, str, int]


@attrs.define
class _Batch:
    state: BatchState = BatchState.PENDING
    error: str | None = None
    rollout_released: bool = False
    student_scoring_started: bool = False


@attrs.define
class _Operation:
    fingerprint: Fingerprint
    task: asyncio.Future[Any]


@attrs.frozen
class RunFailure:
    """The run's first permanent failure: the batch it happened in and why."""

    batch_id: int
    cause: str


@attrs.frozen
class CoordinatorStatus:
    """A snapshot of the coordinator, for operators and tests (picklable)."""

    generation_role: str
    leases: Mapping[str, str]
    slices: Mapping[str, str]
    blocked: Mapping[str, str]
    current: int | None
    batch_state: str | None
    batch_error: str | None
    failure: RunFailure | None
    committed: int
    last_committed: int | None
    late_replies: tuple[LateReply, ...]
    operation_timeout: float
    residency: ResidencyPlan = attrs.field(factory=ResidencyPlan)
    #: role -> its last switch (where its seconds went)
    switches: Mapping[str, SwitchRecord] = attrs.field(factory=dict)

    @property
    def deferred_roles(self) -> tuple[str, ...]:
        """The leased roles the coordinator drives remotely (all but the generation role)."""
        return tuple(r for r in self.leases if r != self.generation_role)


class Coordinator(Protocol):
    """The coordinator's API: :class:`LifecycleCoordinator` (see it for each coroutine) and its
    client :class:`~relax_core.coordination.remote.RemoteCoordinator`, both checked against it."""

    async def begin_batch(self, batch_id: int) -> BatchState: ...
    async def acknowledge_rollout_offloaded(self, batch_id: int, result: Any) -> LeaseState: ...
    async def begin_student_scoring(self, batch_id: int) -> LeaseState: ...
    async def activate(
        self, role: str, operation_id: str, *, batch_id: int, models: Sequence[str] = ()
    ) -> LeaseState: ...
    async def deactivate(self, role: str, operation_id: str, *, batch_id: int) -> LeaseState: ...
    async def fail_batch(
        self, batch_id: int, error: str, *, release_unconfirmed: bool = False
    ) -> BatchState: ...
    async def commit_batch(self, batch_id: int, receipt: SinkReceipt) -> BatchState: ...
    async def wait_committed(self, batch_id: int, timeout: float | None = None) -> SinkReceipt: ...
    async def reset_blocked(self, role: str, *, confirm_clean: bool = False) -> LeaseState: ...
    async def recover(self, role: str) -> dict[str, list[str]]: ...
    async def go_on_after(self, batch_id: int) -> None: ...
    async def describe(self) -> CoordinatorStatus: ...


def _describe(fp: Fingerprint) -> str:
    method, role, batch_id = fp
    return f"{method}({role!r}, batch {batch_id})"


class LifecycleCoordinator:
    """Grants shared-GPU leases role by role, dedupes operations and gates batch commits.

    :param slices: role -> defer slice id (roles of a slice share its GPUs); roles not listed
        are not leased.
    :param managers: role -> the manager handles of its models; every leased role but the
        generation role needs at least one.
    :param generation_role: the role that generates; it has no handles here: it offloads itself
        and acknowledges (:meth:`acknowledge_rollout_offloaded`).
    :param operation_timeout: the deadline of one manager RPC; a timeout, an error or an
        unconfirmed result leaves the lease BLOCKED and fails the batch.
    :param residency: which roles of a slice may hold its GPUs at once (default: one).
    :raises ValueError: the inputs disagree (a role without handles, an unknown role).

    Every method is a coroutine of one event loop; state changes happen between awaits."""

    def __init__(
        self,
        *,
        slices: Mapping[str, str],
        managers: Mapping[str, Sequence[ManagerHandle]],
        generation_role: str,
        operation_timeout: float = DEFAULT_OPERATION_TIMEOUT,
        residency: ResidencyPlan | None = None,
    ) -> None:
        if generation_role not in slices:
            raise ValueError(
                f"generation_role {generation_role!r} is not in slices ({sorted(slices)})"
            )
        if unknown := set(managers) - set(slices):
            raise ValueError(f"managers for roles not in slices: {sorted(unknown)}")
        if managers.get(generation_role):
            raise ValueError(
                f"the generation role {generation_role!r} takes no manager handles: it offloads "
                "itself and acknowledges"
            )
        if missing := [r for r in slices if r != generation_role and not managers.get(r)]:
            raise ValueError(f"leased roles without manager handles: {sorted(missing)}")
        if not operation_timeout > 0:
            raise ValueError(f"operation_timeout={operation_timeout!r}: give seconds > 0")
        self.generation_role = generation_role
        self._residency = residency or ResidencyPlan()
        self._condition = asyncio.Condition()
        #: the leases, the switch, BLOCKED and late replies: shared with relax serve's wakes
        self._engine = LeaseEngine(slices, managers, operation_timeout=operation_timeout)
        self._roles = self._engine.leases
        self._blocked = self._engine.blocked
        #: role -> the handles its last confirmed activation onloaded (offloaded next)
        self._awake: dict[str, tuple[ManagerHandle, ...]] = {}
        self._batches: dict[int, _Batch] = {}
        self._current: int | None = None
        self._last_begun: int | None = None
        self._failure: RunFailure | None = None
        self._operations: dict[str, _Operation] = {}
        self._committed: collections.OrderedDict[int, SinkReceipt] = collections.OrderedDict()
        self._retired: collections.OrderedDict[str, Fingerprint] = collections.OrderedDict()

    # -- queries ---------------------------------------------------------------------------

    def lease(self, role: str) -> LeaseState:
        """The lease state of ``role``."""
        self._check_role(role)
        return self._roles[role]

    def leases(self) -> dict[str, LeaseState]:
        """Role -> lease state."""
        return dict(self._roles)

    def batch_state(self, batch_id: int) -> BatchState | None:
        """COMMITTED (within the history), the current batch's state, or ``None``."""
        if batch_id in self._committed:
            return BatchState.COMMITTED
        batch = self._batches.get(batch_id)
        return batch.state if batch is not None else None

    @property
    def failure(self) -> RunFailure | None:
        """The run's first permanent failure, if any."""
        return self._failure

    async def describe(self) -> CoordinatorStatus:
        """:meth:`status`, as a coroutine (the same API as the remote coordinator's)."""
        return self.status()

    def status(self) -> CoordinatorStatus:
        """Leases, slices, blocked roles with their reasons, the current batch, the failure."""
        batch = self._batches.get(self._current) if self._current is not None else None
        return CoordinatorStatus(
            generation_role=self.generation_role,
            leases={r: str(s) for r, s in self._roles.items()},
            slices=dict(self._engine.slices),
            blocked=dict(self._blocked),
            current=self._current,
            batch_state=str(batch.state) if batch is not None else None,
            batch_error=batch.error if batch is not None else None,
            failure=self._failure,
            committed=len(self._committed),
            last_committed=next(reversed(self._committed)) if self._committed else None,
            late_replies=tuple(self._engine.late),
            operation_timeout=self._engine.operation_timeout,
            residency=self._residency,
            switches=dict(self._engine.switches),
        )

    # -- the generation role ---------------------------------------------------------------

    async def begin_batch(self, batch_id: int) -> BatchState:
        """Open batch ``batch_id`` (ids increase) and give the generation role its lease.
        Idempotent (PENDING again, or COMMITTED within the history).

        :raises BatchFailedError: the run failed earlier.
        :raises LeaseBlockedError: a role on the generation role's slice is BLOCKED.
        :raises CoordinationError: another batch is pending, the id is older than the newest
            one, or a role on the slice still holds the GPUs."""
        _check_batch_id(batch_id)
        gen = self.generation_role
        async with self._engine.lock(gen), self._condition:
            if batch_id in self._committed:
                return BatchState.COMMITTED
            if self._failure is not None:
                raise self._run_failed(batch_id)
            current = self._batches.get(batch_id)
            if current is not None and current.state is _B.PENDING:
                return BatchState.PENDING
            if (pending := self._pending_id()) is not None:
                raise CoordinationError(
                    f"begin_batch({batch_id}): batch {pending} is still PENDING; commit or fail "
                    "it first (one closed batch at a time)"
                )
            if self._last_begun is not None and batch_id <= self._last_begun:
                raise CoordinationError(
                    f"begin_batch({batch_id}): batch ids increase and batch {self._last_begun} "
                    f"was already begun; batch {batch_id} is not in the newest "
                    f"{COMMITTED_HISTORY} committed batches"
                )
            self._grant_generation(f"begin_batch({batch_id})")
            self._open(batch_id)
            return BatchState.PENDING

    async def acknowledge_rollout_offloaded(self, batch_id: int, result: Any) -> LeaseState:
        """The generation role offloaded itself for the current batch: ``result`` (a
        ``LifecycleResult``) must show every replica SLEEPING. Idempotent.

        :raises LeaseBlockedError: ``result`` does not confirm it: the lease is now BLOCKED and
            the batch FAILED."""
        gen = self.generation_role
        async with self._engine.lock(gen), self._condition:
            batch = self._current_batch(batch_id, "acknowledge_rollout_offloaded")
            state = self._roles[gen]
            if state is _L.BLOCKED:
                raise LeaseBlockedError(gen, self._blocked[gen])
            reason = unconfirmed(result, "SLEEPING")
            if reason is not None:
                self._engine.block(gen, f"release unconfirmed: {reason}")
                self._fail(batch_id, f"{gen} release unconfirmed: {reason}")
                raise LeaseBlockedError(gen, self._blocked[gen])
            if state is _L.ACTIVE:
                self._engine.set(gen, _L.SLEEPING)
            batch.rollout_released = True
            return self._roles[gen]

    async def begin_student_scoring(self, batch_id: int) -> LeaseState:
        """Give the generation role its lease again, for student scoring (it onloads itself):
        needs its release acknowledged and the slice free. Idempotent while it is held.

        :raises CoordinationError: the release was not acknowledged or a role holds the GPUs."""
        gen = self.generation_role
        async with self._engine.lock(gen), self._condition:
            batch = self._pending(batch_id, "begin_student_scoring")
            if batch.student_scoring_started and self._roles[gen] is _L.ACTIVE:
                return _L.ACTIVE
            if not batch.rollout_released:
                raise CoordinationError(
                    f"begin_student_scoring({batch_id}): the {gen} release was not acknowledged "
                    "(acknowledge_rollout_offloaded first)"
                )
            self._grant_generation(f"begin_student_scoring({batch_id})")
            batch.student_scoring_started = True
            return _L.ACTIVE

    # -- deferred roles ---------------------------------------------------------------------

    async def activate(
        self, role: str, operation_id: str, *, batch_id: int, models: Sequence[str] = ()
    ) -> LeaseState:
        """Onload ``role``'s ``models`` (handle ``role.m``; empty: all) for pending batch
        ``batch_id``; an ACTIVE role already holding them is not onloaded again. Refused (and the
        batch FAILED) while another role on the slice is not SLEEPING. Deduped by
        ``operation_id``: the same id and request share one execution; another request errs.

        :raises LeaseBlockedError: the role is BLOCKED, or its onload was not confirmed within
            the operation timeout (the lease is now BLOCKED and the batch FAILED).
        :raises BatchFailedError: the batch failed.
        :raises CoordinationError: a model has no handle here, or the role is ACTIVE with other
            models (deactivate it first)."""
        handles = self._chosen(role, models)
        what = role if not models else f"{role}[{','.join(sorted(set(models)))}]"

        def admit() -> str | None:
            self._pending(batch_id, f"activate({role!r})")
            state = self._roles[role]
            if state is _L.ACTIVE:
                awake = self._awake.get(role, ())
                if other := [h.name for h in handles if h not in awake]:
                    raise CoordinationError(
                        f"activate({role!r}): the role is ACTIVE with "
                        f"{sorted(h.name for h in awake)}, not {other}; deactivate it first"
                    )
            if state not in (_L.BLOCKED, _L.ACTIVE):  # else answered by _switch
                try:
                    self._refuse_busy(role, f"activate({role!r})", include_self=False)
                except CoordinationError as exc:
                    self._fail(batch_id, str(exc))
                    raise
            return None

        switch = functools.partial(self._switch, role, batch_id, admit, handles, out=False)
        return await self._dedupe(operation_id, ("activate", what, batch_id), switch)

    async def deactivate(self, role: str, operation_id: str, *, batch_id: int) -> LeaseState:
        """Offload ``role`` (what its activation onloaded; all after a failed switch) for the
        current batch, PENDING or FAILED (then its requests are aborted, not drained); a SLEEPING
        role is not offloaded again. Deduped by ``operation_id`` as :meth:`activate`.

        :raises LeaseBlockedError: the role is BLOCKED, or its offload was not confirmed
            within the operation timeout (the lease is now BLOCKED and the batch FAILED)."""
        self._handles(role)

        def admit() -> str | None:
            batch = self._current_batch(batch_id, f"deactivate({role!r})")
            # A failed batch uses nothing its requests would answer: abort them, do not wait.
            return ABORT if batch.state is _B.FAILED else None

        def switch() -> Awaitable[LeaseState]:
            handles = self._awake.get(role) or self._handles(role)
            return self._switch(role, batch_id, admit, handles, out=True)

        return await self._dedupe(operation_id, ("deactivate", role, batch_id), switch)

    # -- batches ---------------------------------------------------------------------------

    async def fail_batch(
        self, batch_id: int, error: str, *, release_unconfirmed: bool = False
    ) -> BatchState:
        """Mark ``batch_id`` FAILED (the first cause kept; a batch never begun too) and wake its
        waiters; ``release_unconfirmed``: the generation lease is kept BLOCKED. Idempotent.

        :raises CoordinationError: the batch is committed, or another batch is pending."""
        _check_batch_id(batch_id)
        gen = self.generation_role
        async with self._condition:
            if batch_id in self._committed:
                raise CoordinationError(f"fail_batch({batch_id}): the batch is COMMITTED")
            if batch_id not in self._batches:
                if (pending := self._pending_id()) is not None:
                    raise CoordinationError(
                        f"fail_batch({batch_id}): batch {pending} is the pending batch"
                    )
                self._open(batch_id)
            cause = str(error)
            if release_unconfirmed:
                cause += f" (release unconfirmed: the {gen} lease is kept BLOCKED)"
                if self._roles[gen] is _L.ACTIVE:
                    self._engine.block(gen, f"release unconfirmed after a failure: {error}")
            self._fail(batch_id, cause)
            return BatchState.FAILED

    async def commit_batch(self, batch_id: int, receipt: SinkReceipt) -> BatchState:
        """Commit ``batch_id`` (every role SLEEPING; ``receipt``: the put that closed
        ``train_{batch_id}``) and wake every waiter. Idempotent (within the history).

        :raises BatchFailedError: the batch failed.
        :raises CoordinationError: a role is not SLEEPING, the release was not acknowledged, or
            the receipt does not close the batch's partition (nothing changes)."""
        _check_batch_id(batch_id)
        async with self._condition:
            if batch_id in self._committed:
                return BatchState.COMMITTED
            batch = self._current_batch(batch_id, "commit_batch")
            _raise_if_failed(batch_id, batch)
            where = f"commit_batch({batch_id})"
            if not isinstance(receipt, SinkReceipt):
                raise CoordinationError(
                    f"{where}: needs the SinkReceipt of a successful sink put, got "
                    f"{type(receipt).__name__}"
                )
            want = partition_name(batch_id)
            if receipt.partition != want or not receipt.is_last:
                raise CoordinationError(
                    f"{where}: the receipt is for partition {receipt.partition!r} "
                    f"(is_last={receipt.is_last}); it must close {want!r}"
                )
            free = self._residency.free
            awake = {
                r: str(s)
                for r, s in self._roles.items()
                if s is not _L.SLEEPING and not (r in free and s is _L.ACTIVE)
            }
            if awake:
                raise CoordinationError(
                    f"{where}: every role must be SLEEPING; not SLEEPING: {awake}"
                )
            if not batch.rollout_released and self.generation_role not in free:
                raise CoordinationError(
                    f"{where}: the {self.generation_role} release was not acknowledged"
                )
            batch.state = _B.COMMITTED
            self._committed[batch_id] = receipt
            while len(self._committed) > COMMITTED_HISTORY:
                self._committed.popitem(last=False)
            self._condition.notify_all()
            return BatchState.COMMITTED

    async def wait_committed(self, batch_id: int, timeout: float | None = None) -> SinkReceipt:
        """Wait until ``batch_id`` is committed; its sink receipt (a batch evicted beyond the
        history waits until ``timeout``).

        :raises BatchFailedError: the batch, or the run at this or an earlier batch, failed.
        :raises TimeoutError: not committed within ``timeout`` seconds."""
        _check_batch_id(batch_id)
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        async with self._condition:
            while (receipt := self._commit_outcome(batch_id)) is None:
                left = None if deadline is None else deadline - loop.time()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"batch {batch_id} was not committed within {timeout}s "
                        f"(current batch: {self._current})"
                    )
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await self._condition.wait()
            return receipt

    # -- recovery mid-run ---------------------------------------------------------------------

    async def recover(self, role: str) -> dict[str, list[str]]:
        """A stage's request to ``role`` failed mid-run: :meth:`LeaseEngine.recover` under the
        slice's lock; nothing for the generation role or a BLOCKED one (the operator's).

        :raises CoordinationError: ``role`` is not one of the job's."""
        self._check_role(role)
        if role == self.generation_role or self._roles[role] is LeaseState.BLOCKED:
            return {"rebuilt": [], "failed": []}
        async with self._engine.lock(role):
            return await self._engine.recover(role)

    async def go_on_after(self, batch_id: int) -> None:
        """Go on past FAILED batch ``batch_id`` (``[run] max_failed_steps``): the run's failure is
        cleared; the batch and any BLOCKED lease stay as they are. Idempotent.

        :raises CoordinationError: batch ``batch_id`` is not FAILED."""
        _check_batch_id(batch_id)
        async with self._condition:
            batch = self._batches.get(batch_id)
            if batch is None or batch.state is not _B.FAILED:
                raise CoordinationError(
                    f"go_on_after({batch_id}): the batch is not FAILED; only a failed batch is "
                    "gone past"
                )
            if self._failure is not None and self._failure.batch_id == batch_id:
                self._failure = None

    # -- the operator -----------------------------------------------------------------------

    async def reset_blocked(self, role: str, *, confirm_clean: bool = False) -> LeaseState:
        """Operator only: a BLOCKED lease back to SLEEPING once ``confirm_clean`` (its engines hold
        no GPU memory); the run's failure is kept.

        :raises CoordinationError: not confirmed, or the lease is not BLOCKED."""
        self._check_role(role)
        if confirm_clean is not True:
            raise CoordinationError(
                f"refusing to reset role {role!r}: confirm first that its GPUs are clean (its "
                "engines stopped or confirmed offloaded on every node), then pass "
                "confirm_clean=True (`relax coordinator reset --confirm-clean`)"
            )
        async with self._engine.lock(role), self._condition:
            state = self._roles[role]
            if state is not _L.BLOCKED:
                raise CoordinationError(
                    f"role {role!r} lease is {state}, not BLOCKED: nothing to reset"
                )
            self._engine.reset(role)
            return _L.SLEEPING

    # -- internals ---------------------------------------------------------------------------

    async def _switch(
        self,
        role: str,
        batch_id: int,
        admit: Callable[[], str | None],
        handles: tuple[ManagerHandle, ...],
        *,
        out: bool,
    ) -> LeaseState:
        """``admit()`` under the condition, then :meth:`LeaseEngine.switch`; unconfirmed: FAILED."""
        moving, done = (_L.DRAINING, _L.SLEEPING) if out else (_L.ONLOADING, _L.ACTIVE)
        async with self._engine.lock(role):
            async with self._condition:
                method = admit()
                state = self._roles[role]
                if state is _L.BLOCKED:
                    raise LeaseBlockedError(role, self._blocked[role])
                if state is done:
                    return done
                self._engine.set(role, moving)
            reason = await self._engine.switch(role, handles, out=out, method=method)
            async with self._condition:
                if reason is None:
                    self._awake[role] = () if out else handles
                    return done
                self._awake[role] = self._engine.handles[role]
                self._fail(batch_id, f"{'deactivate' if out else 'activate'} {role}: {reason}")
            raise LeaseBlockedError(role, reason)

    async def _dedupe(
        self, operation_id: str, fp: Fingerprint, run: Callable[[], Awaitable[LeaseState]]
    ) -> LeaseState:
        if not isinstance(operation_id, str) or not operation_id:
            raise CoordinationError(f"{_describe(fp)}: give a non-empty operation id")
        op = self._operations.get(operation_id)
        if op is None:
            retired = self._retired.get(operation_id)
            if retired is not None:
                if retired != fp:
                    raise self._reused(operation_id, retired, fp)
                raise CoordinationError(
                    f"operation {operation_id!r} ({_describe(fp)}) already ran, for a batch that "
                    "is no longer current; it is not run again"
                )
            task = asyncio.ensure_future(run())
            # Retrieved: the outcome reaches every caller and the batch state, never "unawaited".
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
            op = _Operation(fp, task)
            self._operations[operation_id] = op
        elif op.fingerprint != fp:
            raise self._reused(operation_id, op.fingerprint, fp)
        return cast(LeaseState, await asyncio.shield(op.task))

    @staticmethod
    def _reused(operation_id: str, old: Fingerprint, new: Fingerprint) -> CoordinationError:
        return CoordinationError(
            f"operation id {operation_id!r} was used for {_describe(old)}; this request is "
            f"{_describe(new)}: give each operation its own id"
        )

    def _open(self, batch_id: int) -> None:
        """Make ``batch_id`` current; the previous one's finished operations retired."""
        self._batches = {batch_id: _Batch()}
        self._current = batch_id
        self._last_begun = batch_id if self._last_begun is None else max(batch_id, self._last_begun)
        for op_id, op in list(self._operations.items()):
            if op.task.done():
                del self._operations[op_id]
                self._retired[op_id] = op.fingerprint
                self._retired.move_to_end(op_id)
        while len(self._retired) > RETIRED_HISTORY:
            self._retired.popitem(last=False)

    def _commit_outcome(self, batch_id: int) -> SinkReceipt | None:
        receipt = self._committed.get(batch_id)
        if receipt is not None:
            return receipt
        _raise_if_failed(batch_id, self._batches.get(batch_id))
        failure = self._failure
        if failure is not None and batch_id >= failure.batch_id:
            raise self._run_failed(batch_id)
        return None

    def _run_failed(self, batch_id: int) -> BatchFailedError:
        assert self._failure is not None
        return BatchFailedError(batch_id, self._failure.cause, failed_batch=self._failure.batch_id)

    def _fail(self, batch_id: int, cause: str) -> None:
        batch = self._batches.get(batch_id)
        if batch is None or batch.state is not _B.PENDING:
            return
        batch.state = _B.FAILED
        batch.error = cause
        if self._failure is None:
            self._failure = RunFailure(batch_id, cause)
        self._condition.notify_all()

    def _refuse_busy(self, role: str, where: str, *, include_self: bool) -> None:
        """Refuse ``role`` the slice while a role holding it (``role`` too, with ``include_self``)
        is BLOCKED, or awake and not allowed beside it by the residency plan."""
        slices = self._engine.slices
        busy = {
            r: s
            for r, s in self._roles.items()
            if slices[r] == slices[role] and s is not _L.SLEEPING and (include_self or r != role)
        }
        if not busy:
            return
        blocked = self._engine.blocked_beside(role)
        if blocked is not None:
            raise LeaseBlockedError(*blocked)
        settled = all(s is _L.ACTIVE for r, s in busy.items() if r != role)
        if settled and self._residency.fits(slices[role], {*busy, role}):
            return
        raise CoordinationError(
            f"{where}: roles on defer slice {slices[role]!r} still hold its GPUs: "
            f"{ {r: str(s) for r, s in busy.items()} }; release them first"
        )

    def _grant_generation(self, where: str) -> None:
        gen = self.generation_role
        self._refuse_busy(gen, where, include_self=True)
        if self._roles[gen] is not _L.ACTIVE:  # a free generation role stays ACTIVE
            self._engine.set(gen, _L.ACTIVE)

    def _pending_id(self) -> int | None:
        return next((i for i, batch in self._batches.items() if batch.state is _B.PENDING), None)

    def _current_batch(self, batch_id: int, where: str) -> _Batch:
        batch = self._batches.get(batch_id)
        if batch is None:
            raise CoordinationError(
                f"{where}: batch {batch_id} is not the current batch (current: {self._current})"
            )
        return batch

    def _pending(self, batch_id: int, where: str) -> _Batch:
        batch = self._current_batch(batch_id, where)
        _raise_if_failed(batch_id, batch)
        if batch.state is not _B.PENDING:
            raise CoordinationError(f"{where}: batch {batch_id} is {batch.state}")
        return batch

    def _chosen(self, role: str, models: Sequence[str]) -> tuple[ManagerHandle, ...]:
        """The handles of ``role``'s ``models`` (every handle when ``models`` is empty)."""
        handles = self._handles(role)
        if not models:
            return handles
        if isinstance(models, str):
            raise CoordinationError(f"activate({role!r}): give models as a sequence of names")
        by_model = {h.name.partition(".")[2] or h.name: h for h in handles}
        if unknown := sorted(set(models) - set(by_model)):
            raise CoordinationError(
                f"activate({role!r}): no handle of model(s) {unknown} (the role's models here: "
                f"{sorted(by_model)})"
            )
        return tuple(h for m, h in by_model.items() if m in models)

    def _handles(self, role: str) -> tuple[ManagerHandle, ...]:
        self._check_role(role)
        if role == self.generation_role:
            raise CoordinationError(
                f"role {role!r} is the generation role: it offloads itself and calls "
                "acknowledge_rollout_offloaded (and begin_student_scoring to come back)"
            )
        return self._engine.handles[role]

    def _check_role(self, role: str) -> None:
        if role not in self._roles:
            raise CoordinationError(
                f"role {role!r} is not leased by this coordinator (leased: {sorted(self._roles)})"
            )


def _raise_if_failed(batch_id: int, batch: _Batch | None) -> None:
    if batch is not None and batch.state is _B.FAILED:
        raise BatchFailedError(batch_id, batch.error or "failed")


def _check_batch_id(batch_id: object) -> None:
    if not isinstance(batch_id, int) or isinstance(batch_id, bool) or batch_id < 0:
        raise CoordinationError(f"batch id {batch_id!r}: give an int >= 0")
