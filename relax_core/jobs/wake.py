"""On-demand residency under ``relax serve``: a request for a sleeping role wakes it, evicting
the least recently used roles it does not fit beside; idle roles go back to sleep. The leases
are a :class:`~relax_core.coordination.leases.LeaseEngine`'s. See ``docs/serve.md``."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import math
import threading
import time
from collections.abc import Awaitable, Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import attrs
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from relax_core.config import ServeSettings
from relax_core.coordination.handles import ManagerHandle
from relax_core.coordination.leases import LeaseEngine
from relax_core.coordination.residency import ResidencyPlan
from relax_core.coordination.states import LeaseState
from relax_core.errors import ModelNotReadyError


class WakeState(enum.StrEnum):
    """Where one role of a shared slice is, as the controller drives it: its lease
    (:class:`~relax_core.coordination.states.LeaseState`) under the names serve reports."""

    SLEEPING = "SLEEPING"
    WAKING = "WAKING"
    AWAKE = "AWAKE"
    EVICTING = "EVICTING"
    BLOCKED = "BLOCKED"


_L = LeaseState
_WAKE_OF = {
    _L.SLEEPING: WakeState.SLEEPING,
    _L.ONLOADING: WakeState.WAKING,
    _L.ACTIVE: WakeState.AWAKE,
    _L.DRAINING: WakeState.EVICTING,
    _L.BLOCKED: WakeState.BLOCKED,
}
_LEASE_OF = {wake: lease for lease, wake in _WAKE_OF.items()}


@attrs.define
class WakeCounts:
    """What the controller did for one role (``/metrics``), and the latencies of the last
    1024 wakes requests waited for."""

    wakes: int = 0
    evictions: int = 0
    idle_sleeps: int = 0
    avoided: int = 0
    timeouts: int = 0
    blocked: int = 0
    rebuilds: int = 0
    wake_seconds: list[float] = attrs.field(factory=list)


@attrs.define
class _Role:
    name: str
    slice: str
    #: the leases, shared with relax run's coordinator: the state is the role's lease
    engine: LeaseEngine
    awake_since: float = 0.0
    last_used: float = 0.0
    inflight: int = 0
    #: Another role's wake is waiting to evict this one: new requests wait for it too.
    draining: bool = False
    counts: WakeCounts = attrs.field(factory=WakeCounts)

    @property
    def state(self) -> WakeState:
        """The role's lease, by its serve name."""
        return _WAKE_OF[self.engine.leases[self.name]]

    @state.setter
    def state(self, state: WakeState) -> None:
        self.engine.set(self.name, _LEASE_OF[state])

    @property
    def blocked(self) -> str:
        """Why the role is BLOCKED (empty when it is not)."""
        return self.engine.blocked.get(self.name, "")

    @property
    def resident(self) -> bool:
        """Whether the role may hold GPU memory (awake, moving either way, or BLOCKED)."""
        return self.state is not WakeState.SLEEPING


class WakeController:
    """Wakes sleeping roles on demand and puts idle ones back to sleep (see the module).

    :param roles: role -> ``(slice id, the handles of its models)``.
    :param residency: which roles of a slice may be resident together.
    :param awake: the roles awake at the start (the others are SLEEPING).
    :param on_event: called with one line per transition."""

    def __init__(
        self,
        roles: Mapping[str, tuple[str, Sequence[ManagerHandle]]],
        *,
        residency: ResidencyPlan,
        awake: Collection[str] = (),
        settings: ServeSettings | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[str], None] | None = None,
    ) -> None:
        self.settings = settings or ServeSettings()
        self.residency = residency
        self._clock = clock
        self._on_event = on_event or (lambda line: None)
        if unknown := sorted(set(awake) - set(roles)):
            raise ValueError(f"awake roles {unknown} are not among the roles {sorted(roles)}")
        now = clock()
        self.engine = LeaseEngine(
            {name: sid for name, (sid, _) in roles.items()},
            {name: handles for name, (_, handles) in roles.items()},
            operation_timeout=self.settings.operation_timeout,
            on_event=self._on_event,
            on_rebuild=self._rebuilt,
        )
        self._roles = {name: _Role(name, sid, self.engine) for name, (sid, _) in roles.items()}
        for name in awake:
            r = self._roles[name]
            r.state, r.awake_since, r.last_used = WakeState.AWAKE, now, now
        self._waking: dict[str, asyncio.Future[None]] = {}
        # In-flight counts, last use and the AWAKE -> EVICTING step, shared with gateway threads.
        self._guard = threading.Lock()
        #: set on the wakes' loop when the last request of a role being drained ends
        self._drained = asyncio.Event()
        self._drain_loop: asyncio.AbstractEventLoop | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._idle_task: asyncio.Task[None] | None = None

    # -- queries ---------------------------------------------------------------------------

    def states(self) -> dict[str, str]:
        """Role -> its :class:`WakeState` (BLOCKED with why)."""
        return {
            r.name: f"{r.state}: {r.blocked}" if r.state is WakeState.BLOCKED else str(r.state)
            for r in self._roles.values()
        }

    def roles(self) -> Collection[str]:
        """The roles the controller drives."""
        return self._roles.keys()

    def counts(self, role: str) -> WakeCounts:
        """What the controller did for ``role``."""
        return self._roles[role].counts

    def describe(self, role: str) -> dict[str, Any]:
        """``role``'s residency for ``/health`` and ``relax status``: its state, slice, the
        roles of the slice resident now, and the settings."""
        r = self._roles[role]
        return {
            "state": str(r.state),
            "slice": r.slice,
            "resident_on_slice": sorted(
                o.name for o in self._roles.values() if o.slice == r.slice and o.resident
            ),
            "inflight": r.inflight,
            "woken_on_demand": True,
            **({"blocked": r.blocked} if r.blocked else {}),
            "wake_waits": _quantiles(r.counts.wake_seconds),
            "wake_timeout_s": self.settings.wake_timeout,
            "idle_seconds": self.settings.idle_seconds,
            "min_residency_s": self.settings.min_residency,
        }

    def summary(self) -> list[str]:
        """One line per slice: its residency plan and where each role is now."""
        roles = self._roles.values()
        return [
            f"{sid}: " + ", ".join(f"{r.name} {r.state}" for r in roles if r.slice == sid)
            for sid in sorted({r.slice for r in roles})
        ]

    # -- what a gateway calls ----------------------------------------------------------------

    def ready(self, role: str) -> bool:
        """Whether a request for ``role`` would be admitted now, without a wake."""
        r = self._roles[role]
        with self._guard:
            return r.state is WakeState.AWAKE and not r.draining

    def enter(self, role: str, *, first: bool = True) -> bool:
        """Admit a request for ``role`` if it is awake and not being evicted, counted in flight
        until :meth:`end`. ``False``: :meth:`wake` it, then call again with ``first=False``.
        Thread-safe."""
        r = self._roles[role]
        with self._guard:
            if r.state is not WakeState.AWAKE or r.draining:
                return False
            r.inflight += 1
            r.last_used = self._clock()
            if first:
                r.counts.avoided += 1
            return True

    def end(self, role: str) -> None:
        """An admitted request for ``role`` has its whole answer (thread-safe)."""
        r = self._roles[role]
        with self._guard:
            r.inflight = max(0, r.inflight - 1)
            r.last_used = self._clock()
            if r.draining and not r.inflight and self._drain_loop is not None:
                with contextlib.suppress(RuntimeError):  # that loop closed: nobody waits
                    self._drain_loop.call_soon_threadsafe(self._drained.set)

    async def wake(self, role: str, *, timeout: float | None = None) -> None:
        """Make ``role`` awake; returns once it is.
        :raises ModelNotReadyError: (503) not awake within ``timeout`` (at most
            ``wake_timeout``), or the role or its slice is BLOCKED.
        :raises KeyError: the controller does not drive ``role``."""
        r = self._roles[role]
        if self.ready(role):
            return
        bound = min(self.settings.wake_timeout, math.inf if timeout is None else timeout)
        began = self._clock()
        # One wake per role at a time, shielded: a waiter that gives up stops no transition.
        task = self._waking.get(role)
        if task is None or task.done():
            task = self._waking[role] = asyncio.ensure_future(self._wake(r))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved
        try:
            async with asyncio.timeout(bound):
                await asyncio.shield(task)
        except TimeoutError:
            r.counts.timeouts += 1
            retry = max(1.0, self.settings.min_residency)
            raise _not_ready(
                role,
                str(r.state),
                f"could not be woken within {bound:g} s: the roles it shares its GPUs with are "
                f"in use, and a woken role stays resident at least "
                f"{self.settings.min_residency:g} s; no request was sent. Retry after {retry:g} s",
                retry_after=retry,
            ) from None
        except ModelNotReadyError:
            r.counts.blocked += 1
            raise
        r.counts.wake_seconds.append(self._clock() - began)
        del r.counts.wake_seconds[:-1024]

    # -- the transitions ---------------------------------------------------------------------

    def _rebuilt(self, role: str) -> None:
        self._roles[role].counts.rebuilds += 1

    async def _wake(self, r: _Role) -> None:
        async with self.engine.lock(r.name):
            blocked = self.engine.blocked_beside(r.name)
            if blocked is not None:
                name, why = blocked
                raise _not_ready(
                    r.name,
                    "BLOCKED",
                    f'cannot be woken: role "{name}" of the same GPUs is BLOCKED ({why}); what '
                    "its engines hold is not known, so nothing is woken beside them. Stop relax "
                    "serve, check the GPUs are free (nvidia-smi, the engines' /server_info), and "
                    "start it again. No request was sent",
                )
            if r.state is WakeState.AWAKE:
                return  # woken by an earlier wake of this lock
            victims = self._victims(r)
            for kept in self._roles.values():
                if kept.slice == r.slice and kept.resident and kept not in victims:
                    kept.counts.avoided += 1  # the plan lets it stay beside
            drain_until: float | None = None
            while victims:
                now = self._clock()
                ready_at = max(v.awake_since + self.settings.min_residency for v in victims)
                if ready_at <= now:
                    # Past the hysteresis: new requests for the victims wait; once those in
                    # flight are answered (or the bound passed) the victims are released.
                    if drain_until is None:
                        drain_until = now + self.settings.wake_timeout
                    with self._guard:
                        for v in victims:
                            v.draining = True
                        if now >= drain_until or not any(v.inflight for v in victims):
                            for v in victims:
                                v.state = WakeState.EVICTING
                            break
                # Hold this and every later request for the slice on the lock; look again when
                # a victim's last request ends, its hysteresis or drain bound passes, or (a clock
                # of the caller's) within 0.1 s.
                bound = ready_at if drain_until is None else drain_until
                self._drain_loop = asyncio.get_running_loop()
                self._drained.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._drained.wait(), max(0.01, min(bound - now, 0.1)))
            try:
                for victim in victims:
                    await self._switch(victim, out=True)
                    victim.counts.evictions += 1
            finally:
                with self._guard:
                    for v in victims:
                        v.draining = False
            await self._switch(r, out=False)
            r.counts.wakes += 1

    def _victims(self, r: _Role) -> list[_Role]:
        """The resident roles of ``r``'s slice to put to sleep so ``r`` fits (least recently
        used first; ``max_awake`` counted)."""
        keep = sorted(
            (o for o in self._roles.values() if o.slice == r.slice and o is not r and o.resident),
            key=lambda o: o.last_used,
        )
        limit = self.settings.max_awake
        victims: list[_Role] = []
        while keep and (
            not self.residency.fits(r.slice, {r.name, *(o.name for o in keep)})
            or (limit is not None and len(keep) + 1 > limit)
        ):
            victims.append(keep.pop(0))
        return victims

    async def _switch(self, r: _Role, *, out: bool) -> None:
        """Offload (``out``) or onload ``r``'s every model through the lease engine (failed
        replicas rebuilt first; see :meth:`LeaseEngine.switch`); one that is not confirmed
        leaves ``r`` BLOCKED, and raises."""
        method = "offload" if out else "onload"
        began = self._clock()
        reason = await self.engine.switch(r.name, out=out)
        if reason is not None:
            raise _not_ready(
                r.name,
                "BLOCKED",
                f"its {method} was not confirmed ({reason}); it is BLOCKED. Stop relax serve, "
                "check the GPUs are free, start it again. No request was sent",
                sep=": ",
            )
        now = self._clock()
        with self._guard:
            if not out:
                r.awake_since = r.last_used = now
        self._on_event(f"{r.name}: {r.state} ({method} {now - began:.2f}s)")

    async def sleep_idle(self) -> list[str]:
        """Put back to sleep every awake role with nothing in flight, unused for
        ``idle_seconds`` and resident at least ``min_residency``; the roles it did."""
        idle, res = self.settings.idle_seconds, self.settings.min_residency

        async def put_to_sleep(r: _Role) -> bool:
            now = self._clock()
            with self._guard:
                if r.inflight or now - r.last_used < idle or now - r.awake_since < res:
                    return False
                r.state = WakeState.EVICTING  # a request from now on waits for a wake
            with contextlib.suppress(ModelNotReadyError):  # BLOCKED: recorded
                await self._switch(r, out=True)
                r.counts.idle_sleeps += 1
                return True
            return False

        return await self._each_awake(put_to_sleep) if idle > 0 else []

    async def heal_awake(self) -> list[str]:
        """Rebuild the failed replicas of every awake role (an engine that died while it was
        resident; the health monitor only marks them FAILED); the roles healed."""

        async def heal(r: _Role) -> bool:
            if reasons := await self.engine.heal(r.name):
                self._on_event(f"{r.name}: a rebuild was not confirmed: {'; '.join(reasons)}")
            return True

        return await self._each_awake(heal)

    async def _each_awake(self, act: Callable[[_Role], Awaitable[bool]]) -> list[str]:
        """``act(r)`` on each AWAKE role under its slice's lock (none while a wake holds it);
        the roles it returned true for."""
        done = []
        for r in list(self._roles.values()):
            lock = self.engine.lock(r.name)
            if r.state is not WakeState.AWAKE or lock.locked():
                continue  # a wake is deciding what to do with the slice
            async with lock:
                if r.state is WakeState.AWAKE and await act(r):
                    done.append(r.name)
        return done

    # -- its own loop ----------------------------------------------------------------------

    def start(self) -> WakeController:
        """Run the controller on an event loop of its own (a daemon thread), its idle sleeper
        on it. Idempotent."""
        if self._thread is not None:
            return self
        ready = threading.Event()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self.loop = loop
            self._idle_task = loop.create_task(self.housekeep())
            loop.call_soon(ready.set)
            loop.run_forever()
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.close()

        self._thread = threading.Thread(target=run, name="wake-controller", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the wake controller's event loop did not start within 10 s")
        return self

    async def housekeep(self) -> None:
        """Rebuild dead engines of awake roles and put idle roles to sleep, every tick, for
        ever (:meth:`start` runs it; a caller driving the controller on a loop of its own runs
        it there)."""
        idle = self.settings.idle_seconds
        tick = max(0.05, min(1.0, idle / 4)) if idle > 0 else 1.0
        while True:
            await asyncio.sleep(tick)
            try:
                await self.heal_awake()
                await self.sleep_idle()
            except Exception as exc:  # reported, the sleeper goes on
                self._on_event(f"idle sleep failed: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        """Stop the loop (the roles stay as they are: teardown stops their engines)."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None:
            return
        if self._idle_task is not None:
            loop.call_soon_threadsafe(self._idle_task.cancel)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        self._thread = None
        self.loop = None

    def waker(self) -> ThreadWaker:
        """What a gateway in another thread calls (:meth:`start` first)."""
        return ThreadWaker(self)


class ThreadWaker:
    """A :class:`WakeController` reached from another thread's event loop (a gateway's): each
    wake runs on the controller's loop; ``enter``, ``end`` and ``describe`` are the
    controller's own (thread-safe as they are)."""

    def __init__(self, controller: WakeController) -> None:
        self.controller = controller
        self.enter, self.end = controller.enter, controller.end
        self.describe = controller.describe

    def wakes(self, role: str) -> bool:
        """Whether ``role`` is one the controller wakes."""
        return role in self.controller.roles()

    async def wake(self, role: str, *, timeout: float | None = None) -> None:
        """:meth:`WakeController.wake`, on the controller's loop."""
        loop = self.controller.loop
        if loop is None:
            raise _not_ready(
                role,
                "SLEEPING",
                "is asleep and the wake controller is not running (relax serve is shutting "
                "down); no request was sent",
            )
        future = asyncio.run_coroutine_threadsafe(self.controller.wake(role, timeout=timeout), loop)
        await asyncio.wrap_future(future)

    def collector(self, role: str) -> Collector:
        """``role``'s wake counters for its gateway's ``/metrics``."""
        return WakeCollector(self.controller, role)


class WakeCollector(Collector):
    """``relax_wake_*``: one role's wakes, evictions, idle sleeps, switches avoided, refusals
    and wake latency (a histogram of the last 1024 wakes requests waited for)."""

    def __init__(self, controller: WakeController, role: str) -> None:
        self.controller = controller
        self.role = role

    def collect(self) -> Iterator[Metric]:
        c = self.controller.counts(self.role)
        role = (self.role,)
        for name, value, doc in (
            ("wakes", c.wakes, "Times the role was woken for a request."),
            ("evictions", c.evictions, "Times the role was put to sleep for another role."),
            ("idle_sleeps", c.idle_sleeps, "Times the role was put to sleep for being idle."),
            (
                "switches_avoided",
                c.avoided,
                "Requests that found the role awake, and wakes of another role of its GPUs it "
                "stayed resident beside: switches a per-request swap would have made.",
            ),
            ("rebuilds", c.rebuilds, "Rebuilds of the role's failed replicas."),
        ):
            family = CounterMetricFamily(f"relax_wake_{name}", doc, labels=("role",))
            family.add_metric(role, value)
            yield family
        refused = CounterMetricFamily(
            "relax_wake_refused",
            "Requests answered 503 because their role could not be woken (timeout: within the "
            "bound; blocked: a transition was not confirmed).",
            labels=("role", "reason"),
        )
        refused.add_metric((self.role, "timeout"), c.timeouts)
        refused.add_metric((self.role, "blocked"), c.blocked)
        yield refused
        seconds = list(c.wake_seconds)
        buckets = [(str(b), sum(1 for s in seconds if s <= b)) for b in _WAKE_BUCKETS]
        buckets.append(("+Inf", len(seconds)))
        histo = HistogramMetricFamily(
            "relax_wake_seconds",
            "How long requests waited for their role to be woken (the last 1024 wakes).",
            labels=("role",),
        )
        histo.add_metric(role, buckets, sum(seconds))
        yield histo
        state = GaugeMetricFamily(
            "relax_wake_state",
            "The role's residency state (1 for the current one).",
            labels=("role", "state"),
        )
        now = self.controller.states()[self.role].split(":")[0]
        for s in WakeState:
            state.add_metric((self.role, s.value), 1.0 if s.value == now else 0.0)
        yield state


_WAKE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


def _not_ready(
    role: str, state: str, why: str, *, sep: str = " ", retry_after: float | None = None
) -> ModelNotReadyError:
    """The 503 of a request for ``role``: ``role "ROLE"{sep}{why}``."""
    message = f'role "{role}"{sep}{why}'
    return ModelNotReadyError(message, role=role, model="*", state=state, retry_after=retry_after)


def _quantiles(seconds: list[float]) -> dict[str, float | int]:
    """How long the last requests waited for a wake: their count and the median, 99th
    percentile and longest wait in seconds (nearest rank)."""
    if not seconds:
        return {"count": 0}
    ranked = sorted(seconds)
    n = len(ranked)
    return {
        "count": n,
        "p50_s": round(ranked[max(0, math.ceil(0.5 * n) - 1)], 6),
        "p99_s": round(ranked[max(0, math.ceil(0.99 * n) - 1)], 6),
        "max_s": round(ranked[-1], 6),
    }
