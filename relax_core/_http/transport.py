"""The HTTP data path under the inference client and the role gateways: sends a
:class:`PreparedRequest` (``http://`` through the lean ``Http1Client``, the rest through aiohttp)
and classifies every failure; it knows nothing of discovery or routing (docs/client.md)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import aiohttp

from relax_core._http.http1 import Http1Client
from relax_core._http.upstream import PreparedRequest, classify_failure


class Transport:
    """Pooled connections to upstreams with Relax's failure classification.

    ``timeout``: the default deadline of one whole exchange; ``stream_idle_timeout``: the longest
    a streamed body may stay silent once its first bytes arrived (``None``: no limit);
    ``stream_first_chunk_timeout``: before them (default: only the deadline); ``session``: use
    this one (never closed here) instead of creating one."""

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

    def _deadline(self, timeout: float | None) -> float | None:
        if timeout is None:
            return self.timeout
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: give a positive number of seconds")
        return timeout

    async def open(self, prepared: PreparedRequest, timeout: float | None = None) -> Any:
        """Send ``prepared``; the response (an ``Http1Response`` or an ``aiohttp.ClientResponse``)
        once its headers arrived. Failures raise as :func:`classify_failure` says."""
        deadline = self._deadline(timeout)
        try:
            if self._owns_session and prepared.url.startswith("http://"):
                return await self.http1.request(
                    prepared.method, prepared.url, prepared.headers, prepared.body, timeout=deadline
                )
            return await self.session.request(
                prepared.method,
                prepared.url,
                data=prepared.body,
                headers=prepared.headers,
                timeout=self._client_timeout
                if timeout is None
                else aiohttp.ClientTimeout(total=deadline, sock_connect=self.connect_timeout),
                allow_redirects=False,
            )
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise classify_failure(exc, prepared, deadline) from exc

    async def exchange(
        self, prepared: PreparedRequest, timeout: float | None = None
    ) -> tuple[int, Mapping[str, str], bytes]:
        """Send ``prepared`` and read the whole answer: ``(status, headers, body)``; raises like
        :meth:`open`."""
        resp = await self.open(prepared, timeout)
        try:
            body = await resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            deadline = self._deadline(timeout)
            raise classify_failure(exc, prepared, deadline, answer_started=True) from exc
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
