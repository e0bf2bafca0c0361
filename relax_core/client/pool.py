"""One shared :class:`~relax_core.client.client.InferenceClient` per event loop, for code
called once per sample (a reward function) that should not build and close a client each time."""

from __future__ import annotations

import asyncio
import contextlib
import weakref
from collections.abc import AsyncGenerator
from typing import Any

from relax_core.client.cache import SnapshotProvider
from relax_core.client.client import InferenceClient


class _LoopClients:
    """The shared clients of one event loop, closed when the loop shuts down its async gens."""

    def __init__(self) -> None:
        self.clients: dict[tuple[Any, ...], InferenceClient] = {}
        self.closer: Any = None

    async def aclose(self) -> None:
        clients, self.clients = list(self.clients.values()), {}
        for client in clients:
            await client.aclose()


_LOOPS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopClients] = (
    weakref.WeakKeyDictionary()
)


async def _close_at_shutdown(pool: _LoopClients) -> AsyncGenerator[None, None]:
    # An async generator parked at its first yield: ``loop.shutdown_asyncgens()`` (which
    # ``asyncio.run`` calls before closing the loop) finalises it, closing the pool's clients
    # inside the loop that owns their sessions.
    try:
        yield
    finally:
        await pool.aclose()


def get_client(
    base_url: str | None = None,
    *,
    snapshot_provider: SnapshotProvider | None = None,
    role: str | None = None,
    **options: Any,
) -> InferenceClient:
    """The shared :class:`InferenceClient` of the running event loop (required) for
    ``(base_url or snapshot_provider, role, options)``, closed when the loop shuts down
    (``asyncio.run``, ``uvloop.run``) or by :func:`close_clients`."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise RuntimeError(
            "get_client() needs a running event loop: call it from a coroutine"
        ) from None
    pool = _LOOPS.get(loop)
    if pool is None:
        pool = _LOOPS[loop] = _LoopClients()
        pool.closer = _close_at_shutdown(pool)
        # Advance it to its first yield now, so the loop's async-gen hooks register it.
        with contextlib.suppress(StopIteration):
            pool.closer.asend(None).send(None)
    key = (base_url, snapshot_provider, role, tuple(sorted(options.items())))
    client = pool.clients.get(key)
    if client is None or client.closed:
        client = pool.clients[key] = InferenceClient(
            base_url, snapshot_provider=snapshot_provider, role=role, **options
        )
    return client


async def close_clients() -> None:
    """Close every shared client of the running event loop (idempotent)."""
    pool = _LOOPS.get(asyncio.get_running_loop())
    if pool is not None:
        await pool.aclose()
