"""Per-replica circuit breakers of an inference client: connect failures in a row to a DIRECT
head open its breaker until a GET probe closes it, so no POST is ever replayed (docs/client.md)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import attrs


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if isinstance(value, bool) or not 0 < value < float("inf"):
        raise ValueError(f"BreakerSettings.{attribute.name}={value!r}: give a positive number")


@attrs.frozen
class BreakerSettings:
    """When a replica's breaker opens (``failures`` connect failures in a row) and how it
    probes: ``probe_path`` GET after ``cooldown`` seconds, doubled after each failed probe up
    to ``max_cooldown``, each within ``probe_timeout``. :raises ValueError: a value out of range."""

    failures: int = attrs.field(default=3, validator=_positive)
    cooldown: float = attrs.field(default=1.0, validator=_positive)
    max_cooldown: float = attrs.field(default=30.0, validator=_positive)
    probe_timeout: float = attrs.field(default=5.0, validator=_positive)
    probe_path: str = "/health_generate"


@attrs.define
class _Breaker:
    url: str
    failures: int = 0
    open: bool = False
    task: asyncio.Task[None] | None = None


#: ``probe(url, timeout)``: the HTTP status of ``GET url`` (raises when it could not be sent).
Probe = Callable[[str, float], Awaitable[int]]


class ReplicaBreakers:
    """The breakers of one client's DIRECT heads, by base URL: ``probe`` sends a probe;
    ``published(url)``: whether the role's snapshot still has that head (else its breaker is
    forgotten). One event loop; not thread-safe."""

    def __init__(
        self,
        settings: BreakerSettings,
        probe: Probe,
        *,
        published: Callable[[str], bool] | None = None,
    ) -> None:
        self.settings = settings
        self._probe = probe
        self._published = published
        self._breakers: dict[str, _Breaker] = {}
        #: the URLs whose breaker is open now (read for every request; rebuilt on every change)
        self.open_urls: frozenset[str] = frozenset()
        #: breakers opened / closed by a probe, since the client was made
        self.opened = 0
        self.closed = 0

    def connect_failed(self, url: str) -> bool:
        """Count a connect failure to ``url``; whether its breaker is open now (opening it
        starts its probe on the running event loop)."""
        b = self._breakers.setdefault(url, _Breaker(url))
        b.failures += 1
        if not b.open and b.failures >= self.settings.failures:
            b.open = True
            self.opened += 1
            self.open_urls = self.open_urls | {url}
            b.task = asyncio.get_running_loop().create_task(self._probe_until_closed(b))
        return b.open

    def reached(self, url: str) -> None:
        """A request to ``url`` connected: its count of failures in a row starts over."""
        b = self._breakers.get(url)
        if b is not None and not b.open:
            del self._breakers[url]

    async def _probe_until_closed(self, b: _Breaker) -> None:
        s = self.settings
        cooldown = s.cooldown
        while True:
            await asyncio.sleep(cooldown)
            if self._published is not None and not self._published(b.url):
                self._forget(b)
                return
            try:
                status = await self._probe(b.url.rstrip("/") + s.probe_path, s.probe_timeout)
            except Exception:  # any failure to get an answer: the head stays out of routing
                status = 0
            if status == 200:
                self._close(b)
                return
            cooldown = min(cooldown * 2, s.max_cooldown)

    def _close(self, b: _Breaker) -> None:
        b.open = False
        self.closed += 1
        self._forget(b)

    def _forget(self, b: _Breaker) -> None:
        b.task = None
        self._breakers.pop(b.url, None)
        self.open_urls = self.open_urls - {b.url}

    async def aclose(self) -> None:
        """Stop every probe (idempotent)."""
        tasks = [b.task for b in self._breakers.values() if b.task is not None]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
