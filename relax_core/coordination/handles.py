"""Manager handles: how the coordinator and a deferred batch reach a model's InferenceManager.

A handle is anything with ``async onload()`` and ``async offload()`` returning a
:class:`~relax_core.manager.LifecycleResult` (one result per replica); one that also has
``async abort_and_offload()`` lets a failed or interrupted batch release its role without
waiting for requests nobody wants any more. Two adapters (both have it):

- :class:`RayManagerHandle`: a manager living in a Ray actor
  (:mod:`relax_core.manager.actor`); the call is ``await actor.onload.remote()``. This is how
  the coordinator drives deferred roles.
- :class:`LocalManagerHandle`: a manager in this process; the blocking call runs in a worker
  thread. This is how the generation role offloads *itself* before it acknowledges to the
  coordinator (the coordinator never calls back into its caller, so there is no self-RPC
  deadlock).

:func:`unconfirmed` says whether a result proves the asked-for state on every replica.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol, runtime_checkable

from relax_core.errors import LifecycleError
from relax_core.manager.results import LifecycleResult, Outcome

__all__ = ["LocalManagerHandle", "ManagerHandle", "RayManagerHandle", "unconfirmed"]


@runtime_checkable
class ManagerHandle(Protocol):
    """One model's manager, as the coordinator sees it. ``name`` is used in messages.

    Optional: ``async abort_and_offload() -> LifecycleResult``, an offload that aborts the
    requests in flight at once instead of draining them (the manager's ``offload(abort=True)``).
    The coordinator uses it to release a role for a FAILED batch, and ``offload()`` on a handle
    without it.
    """

    @property
    def name(self) -> str: ...

    async def onload(self) -> LifecycleResult:
        """Resume every tag on every replica; per-replica results."""
        ...

    async def offload(self) -> LifecycleResult:
        """Release every tag on every replica; per-replica results."""
        ...


def unconfirmed(result: object, expected: str) -> str | None:
    """Why ``result`` does not prove every replica is in state ``expected``; ``None`` if it does.

    A FAILED or SKIPPED replica, a replica left in another state, or something that is not a
    :class:`~relax_core.manager.LifecycleResult` is not a confirmation.
    """
    if not isinstance(result, LifecycleResult):
        return f"expected a LifecycleResult, got {type(result).__name__}"
    wrong = [
        f"{r.engine_id}: {r.outcome} {r.state}" + (f" ({r.error})" if r.error else "")
        for r in result.replicas
        if r.state != expected or r.outcome is Outcome.FAILED
    ]
    if wrong:
        return (
            f"{result.operation} of model {result.model_id!r}: {len(wrong)} of "
            f"{len(result.replicas)} replica(s) not {expected}: {'; '.join(wrong)}"
        )
    return None


class LocalManagerHandle:
    """A manager in this process; each call runs the blocking manager method in a thread.

    Not idempotent by itself, but the manager's onload/offload are (a repeated call is a no-op
    per replica).
    """

    def __init__(self, manager: Any, *, name: str | None = None) -> None:
        self.manager = manager
        self._name = name or str(getattr(manager, "model_id", "manager"))

    @property
    def name(self) -> str:
        """The model id (or the given name)."""
        return self._name

    async def onload(self) -> LifecycleResult:
        """``manager.onload()`` in a worker thread."""
        result: LifecycleResult = await asyncio.to_thread(self.manager.onload)
        return result

    async def offload(self) -> LifecycleResult:
        """``manager.offload()`` in a worker thread."""
        result: LifecycleResult = await asyncio.to_thread(self.manager.offload)
        return result

    async def abort_and_offload(self) -> LifecycleResult:
        """``manager.offload(abort=True)`` in a worker thread: the requests in flight are
        aborted, not drained."""
        result: LifecycleResult = await asyncio.to_thread(lambda: self.manager.offload(abort=True))
        return result

    async def weight_version(self) -> str | None:
        """The manager's published weight version."""
        return await asyncio.to_thread(lambda: self.manager.weight_version)

    async def failed(self) -> list[str]:
        """The engine ids of the manager's FAILED replicas."""
        states = await asyncio.to_thread(self.manager.states)
        return [engine for engine, state in states.items() if state == "FAILED"]

    async def recover(self) -> LifecycleResult:
        """``manager.recover()`` in a worker thread: rebuild the FAILED replicas."""
        result: LifecycleResult = await asyncio.to_thread(self.manager.recover)
        return result


class RayManagerHandle:
    """A manager hosted by a Ray actor (:func:`relax_core.manager.actor.start_manager_actor`).

    The Ray error of a failed call is re-raised as its cause when it has one (the manager's own
    :class:`~relax_core.errors.LifecycleError`), else as a ``LifecycleError`` naming the actor.
    """

    def __init__(self, actor: Any, *, name: str) -> None:
        self.actor = actor
        self._name = name

    @property
    def name(self) -> str:
        """The name given (``role.model``)."""
        return self._name

    async def _call(self, method: str, **kwargs: Any) -> Any:
        import ray

        try:
            return await getattr(self.actor, method).remote(**kwargs)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause
            if isinstance(cause, BaseException):
                raise cause from None
            raise LifecycleError(f"{self._name}: {method}() failed in its actor: {exc}") from exc
        except ray.exceptions.RayActorError as exc:
            raise LifecycleError(
                f"{self._name}: the manager actor died during {method}(): {exc}"
            ) from exc

    async def onload(self) -> LifecycleResult:
        """``actor.onload.remote()``."""
        result: LifecycleResult = await self._call("onload")
        return result

    async def offload(self) -> LifecycleResult:
        """``actor.offload.remote()``."""
        result: LifecycleResult = await self._call("offload")
        return result

    async def abort_and_offload(self) -> LifecycleResult:
        """``actor.offload.remote(abort=True)``: the requests in flight are aborted, not
        drained."""
        result: LifecycleResult = await self._call("offload", abort=True)
        return result

    async def weight_version(self) -> str | None:
        """``actor.weight_version.remote()``."""
        version: str | None = await self._call("weight_version")
        return version
