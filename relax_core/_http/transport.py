"""The HTTP data path under :class:`~relax_core.client.client.InferenceClient` and the role
gateways.

Requests to ``http://`` engines go through :class:`~relax_core._http.http1.Http1Client`, a lean
pooled HTTP/1.1 client (one write per request, httptools parsing): an aiohttp request costs
about 100 µs of CPU on a small machine and one through it about 15 µs, which is most of what a
gateway spends per request. ``https://`` upstreams, discovery GETs and a caller's own
``session=`` use a pooled :class:`aiohttp.ClientSession` (aiohttp, not httpx: httpx's
``AsyncClient`` pool is about ten times slower at concurrency 32). ``relax bench client`` and
``relax bench gateway`` measure this data path.

This module knows nothing about discovery or routing: it sends a :class:`PreparedRequest` and
classifies every failure by whether the request may have reached the upstream
(:mod:`relax_core._http.upstream`):

- :class:`~relax_core.errors.UpstreamUnreachableError` — the connection could not be opened,
  so nothing was sent; trying again (on a fresh snapshot) is safe.
- :class:`~relax_core.errors.RequestNotReplayedError` — the request was (or may have been) sent
  and then the exchange failed (reset, disconnect, deadline, truncated body, a stream silent
  past its idle limit). It is never sent again: the upstream may have executed it.
- :class:`~relax_core.errors.UpstreamStatusError` — the upstream answered with an HTTP error
  status.

Headers (:mod:`relax_core._http.headers`): ``forward_headers`` drops hop-by-hop headers (RFC
9110 section 7.6.1) and the ones the next message recomputes, and keeps everything else, including
``X-Request-ID`` and ``X-SMG-Routing-Key``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import aiohttp

from relax_core._http.http1 import Http1Client
from relax_core._http.upstream import (
    PreparedRequest,
    classify_failure,
)

__all__ = ["Transport"]


class Transport:
    """Pooled connections to upstreams with Relax's failure classification.

    ``timeout``: the default deadline of one exchange (connect, send, whole answer);
    ``connect_timeout``: of opening a connection. ``stream_idle_timeout``: the longest a
    streamed body (read piece by piece) may stay silent once its first bytes arrived (default
    60 s; ``None``: no limit): it catches an engine that died or stopped behind a proxy that
    keeps the connection open, long before the deadline. ``stream_first_chunk_timeout``: the
    same for the wait before the first body bytes (default ``None``, only the deadline): an
    SGLang stream sends its headers at once but its first event only after queueing and the
    prefill, which takes long for long prompts on a busy engine. ``session``: use this one (it
    is never closed here) instead of creating one lazily on the first request. The session
    belongs to the event loop it was created on.
    """

    def __init__(
        self,
        *,
        timeout: float | None = 300.0,
        connect_timeout: float = 10.0,
        max_connections: int = 256,
        keepalive_timeout: float = 4.0,
        stream_idle_timeout: float | None = 60.0,
        stream_first_chunk_timeout: float | None = None,
        session: aiohttp.ClientSession | None = None,
    ) -> None:
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: give a positive number of seconds or None")
        if not connect_timeout > 0:
            raise ValueError(f"connect_timeout={connect_timeout!r}: give a positive number")
        for name, value in (
            ("stream_idle_timeout", stream_idle_timeout),
            ("stream_first_chunk_timeout", stream_first_chunk_timeout),
        ):
            if value is not None and not 0 < value < math.inf:
                raise ValueError(f"{name}={value!r}: give a positive number of seconds or None")
        self.stream_idle_timeout = stream_idle_timeout
        self.stream_first_chunk_timeout = stream_first_chunk_timeout
        if max_connections < 1:
            raise ValueError(f"max_connections={max_connections!r}: give at least 1")
        self.timeout = timeout
        self.connect_timeout = connect_timeout
        self._client_timeout = aiohttp.ClientTimeout(total=timeout, sock_connect=connect_timeout)
        self._max_connections = max_connections
        # Below the 5 s keep-alive of uvicorn (SGLang's server): a connection the server is
        # about to close is never picked for a POST, which could then not be retried.
        self._keepalive_timeout = keepalive_timeout
        self._session = session
        self._owns_session = session is None
        # http:// requests go through the lean client, unless the caller gave its own session.
        self._http1: Http1Client | None = None

    @property
    def http1(self) -> Http1Client:
        """The lean HTTP/1.1 client for ``http://`` upstreams (created on first use)."""
        client = self._http1
        if client is None:
            client = self._http1 = Http1Client(
                max_connections=self._max_connections,
                keepalive_timeout=self._keepalive_timeout,
                connect_timeout=self.connect_timeout,
            )
        return client

    @property
    def session(self) -> aiohttp.ClientSession:
        """The session (created on first use, inside the running event loop)."""
        session = self._session
        if session is None or session.closed:
            if session is not None and not self._owns_session:
                raise RuntimeError("the aiohttp session given to this client was closed")
            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=self._keepalive_timeout,
                ttl_dns_cache=300,
            )
            session = aiohttp.ClientSession(
                connector=connector,
                timeout=self._client_timeout,
                skip_auto_headers=("Accept-Encoding",),
                auto_decompress=False,
                # No cookie jar: an engine's Set-Cookie must not travel with other callers'
                # requests (a gateway forwards many callers over one session).
                cookie_jar=aiohttp.DummyCookieJar(),
            )
            self._session = session
        return session

    def client_timeout(self, timeout: float | None) -> aiohttp.ClientTimeout:
        """The aiohttp timeout for one request (``None``: the transport's default)."""
        if timeout is None:
            return self._client_timeout
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: give a positive number of seconds")
        return aiohttp.ClientTimeout(total=timeout, sock_connect=self.connect_timeout)

    async def open(self, prepared: PreparedRequest, timeout: float | None = None) -> Any:
        """Send ``prepared``; return the response once its headers arrived.

        The response is an :class:`~relax_core._http.http1.Http1Response` (``http://`` through the
        lean client) or an :class:`aiohttp.ClientResponse` (``https://``, or a session of the
        caller's); both have ``status``, ``headers``, ``raw_headers``, ``content``, ``read()``,
        ``release()`` and ``close()``. Raises
        :class:`~relax_core.errors.UpstreamUnreachableError` (nothing sent)
        or :class:`~relax_core.errors.RequestNotReplayedError` (sent, then failed).
        Cancellation propagates as it is (the connection is dropped, not reused).
        """
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: give a positive number of seconds")
        deadline = self.timeout if timeout is None else timeout
        try:
            if self._owns_session and prepared.url.startswith("http://"):
                return await self.http1.request(
                    prepared.method,
                    prepared.url,
                    prepared.headers,
                    prepared.body,
                    timeout=deadline,
                )
            return await self.session.request(
                prepared.method,
                prepared.url,
                data=prepared.body,
                headers=prepared.headers,
                timeout=self.client_timeout(timeout),
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise classify_failure(exc, prepared, deadline) from exc

    async def exchange(
        self, prepared: PreparedRequest, timeout: float | None = None
    ) -> tuple[int, Mapping[str, str], bytes]:
        """Send ``prepared`` and read the whole answer: ``(status, headers, body)``.

        Raises like :meth:`open`; a failure while reading the body raises
        :class:`~relax_core.errors.RequestNotReplayedError`.
        """
        resp = await self.open(prepared, timeout)
        try:
            body = await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise classify_failure(
                exc, prepared, self.timeout if timeout is None else timeout, answer_started=True
            ) from exc
        finally:
            resp.release()
        return resp.status, resp.headers, body

    async def get_json(self, url: str, *, timeout: float) -> tuple[int, bytes]:
        """``GET url``: ``(status, body)``; aiohttp errors and timeouts propagate as they are."""
        async with self.session.get(
            url, timeout=aiohttp.ClientTimeout(total=timeout), allow_redirects=False
        ) as resp:
            return resp.status, await resp.read()

    async def aclose(self) -> None:
        """Close the session and connections if this transport created them (idempotent)."""
        http1, self._http1 = self._http1, None
        if http1 is not None:
            await http1.aclose()
        session, self._session = self._session, None
        if session is not None and self._owns_session and not session.closed:
            await session.close()
