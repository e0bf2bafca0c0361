"""One lease engine over GPU slices, driven by ``relax run``'s coordinator and ``relax serve``'s
wakes: who may hold a slice's GPUs, and the switch that moves a role on or off them; an
unconfirmed switch leaves the role BLOCKED until the operator resets it (docs/coordination.md)."""

from __future__ import annotations

import asyncio
import collections
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs

from relax_core.coordination.handles import ManagerHandle, unconfirmed
from relax_core.coordination.states import LeaseState, check_lease_transition
from relax_core.manager.results import LifecycleResult

_L = LeaseState
#: The optional handle method that offloads without draining (a failed batch's release).
ABORT = "abort_and_offload"


@attrs.frozen
class LateReply:
    """A manager reply that arrived after its deadline (it changed nothing)."""

    role: str
    handle: str
    method: str
    outcome: str
    at: float


@attrs.frozen
class SwitchRecord:
    """A role's last switch: its ``number`` (counted over the engine's switches), ``method``,
    the seconds of every handle's part (rebuilds included) and the results of ``method``
    (where those seconds went: ``relax run --measure``)."""

    number: int
    method: str
    seconds: float
    results: tuple[LifecycleResult, ...]


class LeaseEngine:
    """The leases of every role of the shared slices, and the switch (see the module).

    :param slices: role -> slice id; roles of one slice take turns on its GPUs.
    :param handles: role -> the handles of its models (may be none).
    :param on_event: told one line per rebuild and per BLOCKED lease.
    :param on_rebuild: told the role whose replicas a switch rebuilt.

    One event loop; not thread-safe. The caller holds the slice's :meth:`lock` around a switch."""

    def __init__(
        self,
        slices: Mapping[str, str],
        handles: Mapping[str, Sequence[ManagerHandle]],
        *,
        operation_timeout: float,
        on_event: Callable[[str], None] | None = None,
        on_rebuild: Callable[[str], None] | None = None,
    ) -> None:
        self.slices = dict(slices)
        self.handles = {role: tuple(handles.get(role, ())) for role in slices}
        self.operation_timeout = float(operation_timeout)
        #: role -> its lease
        self.leases: dict[str, LeaseState] = dict.fromkeys(slices, _L.SLEEPING)
        #: role -> why it is BLOCKED
        self.blocked: dict[str, str] = {}
        #: the newest replies that came after their deadline
        self.late: collections.deque[LateReply] = collections.deque(maxlen=64)
        #: role -> its last switch
        self.switches: dict[str, SwitchRecord] = {}
        self._results: dict[str, list[LifecycleResult]] = {}  # of the switch under way
        self._numbers = itertools.count(1)
        self._on_event = on_event or (lambda line: None)
        self._on_rebuild = on_rebuild or (lambda role: None)
        self._locks: dict[str, asyncio.Lock] = {}
        #: id -> the handles whose last switch was not confirmed (what they hold is not known)
        self._unsure: dict[int, ManagerHandle] = {}

    # -- the lease table --------------------------------------------------------------------

    def lock(self, role: str) -> asyncio.Lock:
        """The lock of ``role``'s slice (held around every switch of a role of the slice)."""
        return self._locks.setdefault(self.slices[role], asyncio.Lock())

    def set(self, role: str, state: LeaseState) -> None:
        """Move ``role``'s lease (a transition the state machine has).

        :raises CoordinationError: the transition does not exist."""
        check_lease_transition(role, self.leases[role], state)
        self.leases[role] = state

    def block(self, role: str, reason: str) -> None:
        """Leave ``role`` BLOCKED with ``reason`` (the first reason is kept)."""
        if self.leases[role] is not _L.BLOCKED:
            self.set(role, _L.BLOCKED)
            self.blocked[role] = reason
            self._on_event(f"{role}: BLOCKED ({reason})")

    def reset(self, role: str) -> None:
        """The operator's reset: a BLOCKED ``role`` back to SLEEPING (its GPUs confirmed clean).

        :raises CoordinationError: the lease is not BLOCKED."""
        self.set(role, _L.SLEEPING)
        del self.blocked[role]

    def blocked_beside(self, role: str) -> tuple[str, str] | None:
        """The first BLOCKED role of ``role``'s slice (``role`` too) and why: while there is
        one, nothing is granted the slice."""
        for other, slice_id in self.slices.items():
            if slice_id == self.slices[role] and self.leases[other] is _L.BLOCKED:
                return other, self.blocked[other]
        return None

    # -- the switch --------------------------------------------------------------------------

    async def switch(
        self,
        role: str,
        handles: Sequence[ManagerHandle] | None = None,
        *,
        out: bool,
        method: str | None = None,
    ) -> str | None:
        """Move ``role`` off (``out``) or onto its slice: ``handles`` (default: all the role's)
        rebuilt where FAILED, then ``method`` (default ``offload`` / ``onload``) called on each
        at once. ``None`` once every result is confirmed; else why not, and the role is BLOCKED.
        The caller holds :meth:`lock`."""
        moving, done, expected = (
            (_L.DRAINING, _L.SLEEPING, "SLEEPING") if out else (_L.ONLOADING, _L.ACTIVE, "READY")
        )
        method = method or ("offload" if out else "onload")
        if self.leases[role] is not moving:
            self.set(role, moving)
        chosen = self.handles[role] if handles is None else tuple(handles)
        began, self._results[role] = time.perf_counter(), []
        whys = await asyncio.gather(*(self._step(role, h, method, expected) for h in chosen))
        seconds, results = time.perf_counter() - began, tuple(self._results.pop(role))
        self.switches[role] = SwitchRecord(next(self._numbers), method, seconds, results)
        if reasons := [why for why in whys if why]:
            reason = "; ".join(reasons)
            self.block(role, reason)
            return reason
        self.set(role, done)
        return None

    async def heal(self, role: str) -> list[str]:
        """Rebuild the FAILED replicas of ``role``'s models (the slice's lock held, ``role``
        resident); why any rebuild was not confirmed."""
        handles = self.handles[role]
        reasons = await asyncio.gather(*(self._heal(h, role) for h in handles))
        return [f"{h.name}: {why}" for h, why in zip(handles, reasons, strict=True) if why]

    async def recover(self, role: str) -> dict[str, list[str]]:
        """A request to ``role`` (resident, the slice's lock held) failed mid-run: probe its
        replicas (``check_health()``), then :meth:`heal`. ``{"rebuilt": [handle names],
        "failed": [why not confirmed]}``; never BLOCKS the role."""
        handles = self.handles[role]
        await asyncio.gather(*(self._probe(h) for h in handles))
        found = await asyncio.gather(*(_failed(h) for h in handles))
        failed = [h.name for h, f in zip(handles, found, strict=True) if f]
        return {"rebuilt": failed, "failed": await self.heal(role)}

    async def _probe(self, handle: ManagerHandle) -> None:
        probe = getattr(handle, "check_health", None)
        if probe is None:
            return
        try:
            async with asyncio.timeout(self.operation_timeout):
                await probe()
        except Exception as exc:  # the rebuild that follows says what is wrong
            self._on_event(f"health probe of {handle.name} raised {type(exc).__name__}: {exc}")

    async def _step(
        self, role: str, handle: ManagerHandle, method: str, expected: str
    ) -> str | None:
        """One handle's part of a switch (rebuilt first where its last switch was not confirmed;
        rebuilt and called again on FAILED replicas); why not confirmed."""
        unsure = self._unsure.pop(id(handle), None) is handle
        why = await self._heal(handle, role) if unsure else None
        if why is None:
            why = await self._call(role, handle, method, expected)
            if why is not None and await _failed(handle):
                why = await self._rebuild(handle, role) or await self._call(
                    role, handle, method, expected
                )
        if why is None:
            return None
        self._unsure[id(handle)] = handle
        return f"{handle.name}: {why}"

    async def _heal(self, handle: ManagerHandle, role: str) -> str | None:
        return await self._rebuild(handle, role) if await _failed(handle) else None

    async def _rebuild(self, handle: ManagerHandle, role: str) -> str | None:
        why = await self._call(role, handle, "recover", "READY")
        self._on_rebuild(role)
        self._on_event(f"{role}: rebuilt the failed replicas of {handle.name}")
        return None if why is None else f"rebuild: {why}"

    async def _call(
        self, role: str, handle: ManagerHandle, method: str, expected: str
    ) -> str | None:
        """``handle.method()`` within the operation timeout; why its result does not confirm
        ``expected`` (``None`` when it does; a switch's result kept for its record). A reply
        past the deadline is recorded late."""
        name = method if method != ABORT or hasattr(handle, ABORT) else "offload"
        timeout = self.operation_timeout
        task = asyncio.ensure_future(getattr(handle, name)())
        try:
            async with asyncio.timeout(timeout):
                result = await asyncio.shield(task)
        except TimeoutError:
            task.add_done_callback(lambda t: self._late_reply(role, handle, name, expected, t))
            return (
                f"{method} not confirmed within {timeout:g}s (a late reply does not release "
                "the lease)"
            )
        except Exception as exc:
            return f"{method} raised {type(exc).__name__}: {exc}"
        if method != "recover" and isinstance(result, LifecycleResult):
            self._results.get(role, []).append(result)
        return unconfirmed(result, expected)

    def _late_reply(
        self, role: str, handle: ManagerHandle, method: str, expected: str, task: Any
    ) -> None:
        # The reply is recorded for the operator, never acted on.
        if task.cancelled():
            outcome = "cancelled"
        elif task.exception() is not None:
            exc = task.exception()
            outcome = f"raised {type(exc).__name__}: {exc}"
        else:
            why = unconfirmed(task.result(), expected)
            outcome = "confirmed" if why is None else f"unconfirmed: {why}"
        self.late.append(LateReply(role, handle.name, method, outcome, time.time()))


async def _failed(handle: ManagerHandle) -> bool:
    failed = getattr(handle, "failed", None)
    return failed is not None and bool(await failed())
