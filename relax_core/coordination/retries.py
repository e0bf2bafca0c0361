"""Retries of a stage's idempotent requests, and the rebuild of a role's dead replicas between
them (``docs/reliability.md``).

An idempotent request (a judge's verdict, a teacher's prefill) may be sent again after a
transport failure or a 5xx (:func:`retryable`), never after a 4xx. Between two attempts the
run's :class:`Recovery` has the role's FAILED replicas rebuilt (the lease engine's rule:
:meth:`~relax_core.coordination.leases.LeaseEngine.recover`). A generation request is never
sent again: its group is regenerated as a new group of the same prompt (:class:`Regeneration`).
Every retry and rebuild is counted per batch and stage."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import attrs

from relax_core.errors import RoutingError, UpstreamError, UpstreamStatusError

#: The stage a regenerated group is counted under (the step's ``retries``, the trace).
GENERATE = "generate"

T = TypeVar("T")

#: batch id -> name (a stage, a role) -> how many
_Counts = dict[int, collections.Counter[str]]
#: The longest pause between two attempts (a 503's ``Retry-After`` is followed up to it).
MAX_PAUSE = 2.0


class _Deadline:
    """The deadline of one :func:`stage_deadline` block, stopped while any of its requests
    waits for a rebuild (the time left is kept, then given back when the last wait ends)."""

    def __init__(self, timeout: asyncio.Timeout) -> None:
        self._timeout = timeout
        self._waiting = 0
        self._left: float | None = None

    def pause(self) -> None:
        self._waiting += 1
        when = self._timeout.when()
        if self._waiting == 1 and when is not None and not self._timeout.expired():
            self._left = when - asyncio.get_running_loop().time()
            self._timeout.reschedule(None)

    def resume(self) -> None:
        self._waiting -= 1
        if self._waiting == 0 and self._left is not None and not self._timeout.expired():
            self._timeout.reschedule(asyncio.get_running_loop().time() + max(self._left, 0.0))
            self._left = None


_DEADLINE: contextvars.ContextVar[_Deadline | None] = contextvars.ContextVar(
    "relax_stage_deadline", default=None
)


@contextlib.asynccontextmanager
async def stage_deadline(seconds: float) -> AsyncIterator[None]:
    """Within the block, ``seconds`` of a stage's own time: :func:`retrying`'s waits for its
    role's rebuild (an engine start, bounded by the manager's own start timeout) do not count,
    so a judge rebuilt mid-step does not fail the step it is rebuilt for.

    :raises TimeoutError: the block's own time ran out (its task is cancelled first)."""
    async with asyncio.timeout(seconds) as timeout:
        token = _DEADLINE.set(_Deadline(timeout))
        try:
            yield
        finally:
            _DEADLINE.reset(token)


def retryable(exc: BaseException) -> bool:
    """Whether a stage's idempotent request that raised ``exc`` may be sent again: a transport
    failure or a 5xx answer (:class:`~relax_core.errors.UpstreamError`, a routing 503 while
    its model is not READY), never a 4xx nor anything else."""
    if isinstance(exc, UpstreamStatusError):
        return exc.status >= 500
    if isinstance(exc, UpstreamError):
        return True
    if isinstance(exc, RoutingError):
        return exc.status >= 500
    return False


class Recovery:
    """A run's retries and rebuilds: ``recover(role)`` rebuilds ``role``'s dead replicas (the
    coordinator's :meth:`~relax_core.coordination.coordinator.LifecycleCoordinator.recover`;
    ``None``: retries only), one call per role at a time (concurrent failures of one role wait
    for the same rebuild); ``on_retry(batch_id, stage, error)`` hears each retry (the trace).

    ``retries``: batch id -> stage -> requests sent again; ``rebuilds``: batch id -> role ->
    replicas rebuilt. Not thread-safe: one event loop."""

    def __init__(
        self,
        recover: Callable[[str], Awaitable[Any]] | None = None,
        *,
        on_retry: Callable[[int, str, str], None] | None = None,
    ) -> None:
        self._recover = recover
        self._on_retry = on_retry
        self.retries: _Counts = collections.defaultdict(collections.Counter)
        self.rebuilds: _Counts = collections.defaultdict(collections.Counter)
        #: role -> the rebuild in flight
        self._inflight: dict[str, asyncio.Future[Any]] = {}

    def counted(self, batch_id: int, stage: str, error: BaseException) -> None:
        """One request of ``stage`` in batch ``batch_id`` is sent again after ``error``."""
        self.retries[batch_id][stage] += 1
        if self._on_retry is not None:
            self._on_retry(batch_id, stage, f"{type(error).__name__}: {error}")

    async def recover(self, batch_id: int, role: str | None) -> str | None:
        """Rebuild ``role``'s FAILED replicas (a dead engine is found by a probe first); a
        rebuild already in flight for ``role`` is awaited instead of a second one. What the
        rebuild could not confirm, or that it found nothing to rebuild, is returned, not
        raised: the retry that follows fails on its own (and carries it as a note)."""
        if role is None or self._recover is None:
            return None
        fut = self._inflight.get(role)
        first = fut is None
        if fut is None:
            fut = self._inflight[role] = asyncio.ensure_future(self._recover(role))
            fut.add_done_callback(lambda _: self._inflight.pop(role, None))
        try:
            result = await asyncio.shield(fut)
        except Exception as exc:
            return f"the rebuild of {role!r} raised {type(exc).__name__}: {exc}"
        rebuilt = result.get("rebuilt", ()) if isinstance(result, dict) else ()
        failed = result.get("failed", ()) if isinstance(result, dict) else ()
        if first and rebuilt:
            self.rebuilds[batch_id][role] += len(rebuilt)
        if failed:
            return f"the rebuild of {role!r} failed: {'; '.join(failed)}"
        if not rebuilt:
            return (
                f"no replica of {role!r} was rebuilt: its managers report none FAILED (the "
                "engine answers their probe, or the role has no manager here)"
            )
        return None

    def of(self, batch_id: int) -> dict[str, Any]:
        """Batch ``batch_id``'s counts: ``retries`` (stage -> requests sent again) and
        ``rebuilt`` (role -> replicas rebuilt)."""
        return {
            "retries": dict(self.retries.get(batch_id, {})),
            "rebuilt": dict(self.rebuilds.get(batch_id, {})),
        }


async def retrying(
    send: Callable[[], Awaitable[Any]],
    *,
    batch_id: int,
    stage: str,
    role: str | None,
    retries: int,
    recovery: Recovery | None,
) -> Any:
    """``send()``, sent again up to ``retries`` times while it fails :func:`retryable`; the
    role's dead replicas rebuilt before each new attempt (``recovery``), that wait outside any
    :func:`stage_deadline`. The last failure is raised."""

    async def heal(exc: Exception, attempt: int) -> str | None:
        why = None
        if recovery is not None:
            recovery.counted(batch_id, stage, exc)
            deadline = _DEADLINE.get()
            if deadline is not None:
                deadline.pause()
            try:
                why = await recovery.recover(batch_id, role)
            finally:
                if deadline is not None:
                    deadline.resume()
        pause = getattr(exc, "retry_after", None)
        await asyncio.sleep(min(MAX_PAUSE, pause if pause else 0.1 * attempt))
        return why

    return await _attempts(lambda _: send(), retries, heal, "sent {n} times ({k} retries)")


async def _attempts(
    call: Callable[[int], Awaitable[T]],
    retries: int,
    heal: Callable[[Exception, int], Awaitable[str | None]],
    tried: str,
) -> T:
    """``call(attempt)`` until it returns, up to ``retries`` more times while it fails
    :func:`retryable`, ``heal(exc, attempt)`` before each; the last failure is raised with a
    note ``tried`` (``{n}`` attempts, ``{k}`` again) and each thing ``heal`` said."""
    attempt = 0
    notes: list[str] = []
    while True:
        try:
            return await call(attempt)
        except Exception as exc:
            if attempt >= retries or not retryable(exc):
                if attempt:
                    exc.add_note(tried.format(n=attempt + 1, k=attempt))
                for note in dict.fromkeys(notes):
                    exc.add_note(note)
                raise
            attempt += 1
            why = await heal(exc, attempt)
            if why is not None:
                notes.append(why)


@attrs.frozen
class Regeneration:
    """How a step's producer generates a group again whose generation failed :func:`retryable`
    (its engine died, a 5xx): up to ``retries`` times per group, each after ``heal()`` (the
    generation role's dead replicas rebuilt and given the trainer's weights; it says why that
    did not help, or ``None``), each counted in ``recovery`` for batch ``batch_id`` under
    :data:`GENERATE`. A 4xx, or anything else, is raised at once."""

    batch_id: int
    retries: int
    recovery: Recovery
    heal: Callable[[], Awaitable[str | None]]

    async def group(
        self, generate: Callable[[int], Awaitable[T]], index: int, again: Callable[[], int]
    ) -> T:
        """``generate(index)``; while it fails :func:`retryable` and retries are left, the role
        healed and ``generate(again())``: a new group (a new index, so new ids and requests),
        never the failed request sent again. The last failure is raised, with a note of the
        attempts and of every rebuild that did not help."""
        indexes = [index]

        async def heal(exc: Exception, attempt: int) -> str | None:
            self.recovery.counted(self.batch_id, GENERATE, exc)
            why = await self.heal()
            indexes.append(again())
            return why

        return await _attempts(
            lambda attempt: generate(indexes[attempt]),
            self.retries,
            heal,
            "the group was generated {n} times ({k} regenerated as new groups after a rebuild)",
        )
