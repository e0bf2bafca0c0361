"""Discovery for :class:`~relax_core.client.client.InferenceClient`: the cached schema-2
snapshot; every way discovery can fail is ``RoutingError(503, "registry unavailable: …")``."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import aiohttp
import attrs
import orjson

from relax_core._http.transport import Transport
from relax_core._quote import quote_body
from relax_core.discovery.schema import RoleSnapshot, WeightSources
from relax_core.errors import RoutingError, SnapshotError
from relax_core.plugins import get_plugin_manager

#: A callable returning the role's snapshot (or its schema-2 dict), directly or awaitably.
SnapshotProvider = Callable[
    [], "RoleSnapshot | Mapping[str, Any] | Awaitable[RoleSnapshot | Mapping[str, Any]]"
]

_REGISTRY_RETRY_AFTER = 1.0


def _unavailable(why: str) -> RoutingError:
    return RoutingError(503, f"registry unavailable: {why}", retry_after=_REGISTRY_RETRY_AFTER)


@attrs.define(eq=False)
class SnapshotCache:
    """The role snapshot of one client, fetched on demand (from ``base_url`` or ``provider``)
    and cached for ``ttl`` seconds; concurrent refreshes share one fetch. One event loop."""

    base_url: str | None
    _provider: SnapshotProvider | None
    role: str | None = attrs.field(kw_only=True)
    ttl: float = attrs.field(kw_only=True)
    discovery_timeout: float = attrs.field(kw_only=True)
    _transport: Transport = attrs.field(kw_only=True)
    _weight_sources: WeightSources | None = attrs.field(kw_only=True)
    _snapshot: RoleSnapshot | None = attrs.field(default=None, init=False)
    _expires: float = attrs.field(default=0.0, init=False)
    _fetches: int = attrs.field(default=0, init=False)
    _invalidations: int = attrs.field(default=0, init=False)
    _lock: asyncio.Lock | None = attrs.field(default=None, init=False)

    @property
    def source(self) -> str:
        """Where snapshots come from: the base URL, or the provider's ``repr``."""
        return self.base_url or repr(self._provider)

    @property
    def fetches(self) -> int:
        """How many fetches have completed: the age of the cached snapshot, for :meth:`refetch`."""
        return self._fetches

    @property
    def latest(self) -> RoleSnapshot | None:
        """The last snapshot fetched, fresh or not (``None`` before the first; no I/O)."""
        return self._snapshot

    def fresh(self) -> RoleSnapshot | None:
        """The cached snapshot while it is fresh, else ``None`` (no I/O: the hot path)."""
        snap = self._snapshot
        return snap if snap is not None and time.monotonic() < self._expires else None

    def invalidate(self) -> None:
        """Forget the cached snapshot (a fetch under way does not count as fresh either)."""
        self._expires = 0.0
        self._invalidations += 1

    async def snapshot(self, force: bool = False) -> RoleSnapshot:
        """The role's snapshot: the cached one while fresh, else (or with ``force``) a new one.
        :raises RoutingError: 503 when the registry cannot be reached or answers badly."""
        snap = None if force else self.fresh()
        return snap if snap is not None else await self._refresh(self._fetches, force)

    async def refetch(self, seen: int) -> RoleSnapshot:
        """A snapshot fetched after fetch number ``seen`` (see :attr:`fetches`): one another
        caller fetched meanwhile, else a new fetch even when fresh. Raises like :meth:`snapshot`."""
        return await self._refresh(seen, True)

    async def _refresh(self, seen: int, force: bool) -> RoleSnapshot:
        """A snapshot newer than fetch number ``seen`` (``force``) or fresh; fetch if needed."""
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            snap = self._snapshot
            if snap is not None and (
                self._fetches != seen or (not force and time.monotonic() < self._expires)
            ):
                # Another caller fetched while this one waited for the lock.
                return snap
            invalidations = self._invalidations
            fresh = await self._fetch()
            if snap is not None and fresh == snap:
                fresh = snap  # keep the resolver's per-snapshot indexes warm
            self._snapshot = fresh
            self._fetches += 1
            if invalidations == self._invalidations:
                self._expires = time.monotonic() + self.ttl
            return fresh

    async def _fetch(self) -> RoleSnapshot:
        source = self.base_url or "snapshot provider"
        try:
            if self._provider is not None:
                raw: Any = self._provider()
                if inspect.isawaitable(raw):
                    raw = await raw
            else:
                raw = await self._get_discovery()
            if isinstance(raw, RoleSnapshot):
                snap = raw
            else:
                if self._weight_sources is None:
                    self._weight_sources = get_plugin_manager()
                snap = RoleSnapshot.from_json(raw, weight_sources=self._weight_sources)
        except RoutingError:
            raise
        except SnapshotError as exc:
            raise _unavailable(f"{source} gave an invalid schema-2 snapshot: {exc}") from exc
        except Exception as exc:
            raise _unavailable(f"{source} failed: {type(exc).__name__}: {exc}") from exc
        if self.role is not None and snap.role != self.role:
            raise _unavailable(
                f"{source} serves role {snap.role!r}, this client is for role {self.role!r}; "
                f"point it at the {self.role} registry"
            )
        return snap

    async def _get_discovery(self) -> Any:
        url = f"{self.base_url}/engines?schema=2"
        try:
            status, body = await self._transport.get_json(url, timeout=self.discovery_timeout)
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            reason = "timed out" if isinstance(exc, TimeoutError) else f"{exc}"
            raise _unavailable(f"GET {url} {reason}") from exc
        if status != 200:
            raise _unavailable(f"GET {url} answered {status}: {quote_body(body)}")
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise _unavailable(
                f"GET {url} answered a body that is not JSON ({body[:120]!r})"
            ) from exc
