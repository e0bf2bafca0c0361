"""A lean HTTP/1.1 client for the data path: pooled keep-alive connections, httptools parsing,
one write per request; a request that lost the keep-alive race is sent once more (docs/client.md).
Failures: :class:`ConnectError` / :class:`ConnectTimeout` (nothing sent),
:class:`ServerDisconnectedError` / :class:`PayloadError` (sent, then broken), ``TimeoutError``."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import socket
import time
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import Any
from urllib.parse import urlsplit

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

# A body buffered beyond this, unread, pauses reading from the socket until it is drained.
_HIGH_WATER = 1 << 20
_URL_CACHE_SIZE = 4096
# Headers the client writes itself (the body is always sent with its length).
_FRAMING = frozenset({"host", "content-length", "transfer-encoding"})
_LENGTHS = frozenset({b"content-length", b"transfer-encoding"})


class ConnectError(ConnectionError):
    """No connection could be opened (``os_error`` is the cause): nothing was sent."""

    def __init__(self, where: str, os_error: OSError) -> None:
        super().__init__(f"could not connect to {where}: {os_error}")
        self.os_error = os_error


class ConnectTimeout(TimeoutError):
    """Opening the connection took longer than the connect timeout: nothing was sent."""


class ServerDisconnectedError(ConnectionError):
    """The connection closed (or broke) after the request was written, before its answer."""


class _StaleConnectionError(ServerDisconnectedError):
    """A reused idle connection closed before any byte of the answer: the keep-alive race."""


class PayloadError(ConnectionError):
    """The connection closed or the bytes were not HTTP in the middle of the answer."""


class Http1Body:
    """The body of an answer as it arrives: ``readany`` returns what is there (or waits)."""

    __slots__ = ("_buf", "_conn", "_eof", "_exc", "_last", "_size", "_waiter")

    def __init__(self, conn: _Connection) -> None:
        self._buf: collections.deque[bytes] = collections.deque()
        self._size = 0
        self._last = -1e9  # loop time of the last read that returned bytes
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._conn: _Connection | None = conn

    def feed(self, data: bytes) -> None:
        self._buf.append(data)
        self._size += len(data)
        if self._size > _HIGH_WATER and self._conn is not None:
            self._conn.throttle(paused=True)
        self._wake()

    def feed_eof(self) -> None:
        self._eof = True
        self._conn = None
        self._wake()

    def set_exception(self, exc: BaseException) -> None:
        """Fail the current and every later read (after what was buffered) with ``exc``."""
        if self._exc is None:
            self._exc = exc
        waiter = self._take_waiter()
        if waiter is not None:
            waiter.set_exception(exc)

    def _wake(self) -> None:
        waiter = self._take_waiter()
        if waiter is not None:
            waiter.set_result(None)

    def _take_waiter(self) -> asyncio.Future[None] | None:
        """The waiting read's future, if one still waits; cleared, so each is woken once."""
        waiter, self._waiter = self._waiter, None
        return None if waiter is None or waiter.done() else waiter

    def at_eof(self) -> bool:
        """Whether the whole body was received and read."""
        return self._eof and not self._buf

    async def readany(self, coalesce: float = 0.0) -> bytes:
        """The bytes received since the last read (waits for some); ``b""`` at the end.
        ``coalesce`` (s): when the previous read returned bytes less than this long ago, hold the
        socket this long first, so a fast body's writes arrive as one read."""
        conn = self._conn
        if coalesce > 0.0 and conn is not None and not self._eof:
            loop = asyncio.get_running_loop()
            if loop.time() - self._last < coalesce:
                conn.throttle(held=True)
                try:
                    await asyncio.sleep(coalesce)
                finally:
                    if self._conn is conn:  # (else the answer ended and the hold with it)
                        conn.throttle(held=False)
        while not self._buf and not self._eof:
            if self._exc is not None:
                raise self._exc
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            await waiter
        buf = self._buf
        if not buf:
            return b""
        data = buf.popleft() if len(buf) == 1 else b"".join(buf)
        buf.clear()
        if self._size > _HIGH_WATER and self._conn is not None:
            self._conn.throttle(paused=False)
        self._size = 0
        if coalesce > 0.0:
            self._last = asyncio.get_running_loop().time()
        return data

    async def iter_any(self) -> AsyncIterator[bytes]:
        """Chunks as they arrive, until the end."""
        while data := await self.readany():
            yield data


class Http1Response:
    """An answer whose head has arrived: ``status``, headers, and ``content`` to read; then
    :meth:`release` (or :meth:`close`) it (the connection is reused only if it was complete)."""

    __slots__ = ("_conn", "_deadline", "_headers", "complete", "content", "raw_headers", "status")

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self.status = 0
        self.raw_headers: list[tuple[bytes, bytes]] = []
        self._headers: CIMultiDictProxy[str] | None = None
        self.content = Http1Body(conn)
        self.complete = False
        self._deadline: asyncio.TimerHandle | None = None

    @property
    def headers(self) -> CIMultiDictProxy[str]:
        """The response headers (case-insensitive; values decoded as latin-1)."""
        if self._headers is None:
            self._headers = CIMultiDictProxy(
                CIMultiDict((k.decode("latin-1"), v.decode("latin-1")) for k, v in self.raw_headers)
            )
        return self._headers

    async def read(self) -> bytes:
        """The whole body."""
        return b"".join([data async for data in self.content.iter_any()])

    def close(self) -> None:
        """Done with the answer: reuse the connection if it was complete, else close it.
        Idempotent (``release`` is the same)."""
        self.cancel_deadline()
        conn, self._conn = self._conn, None
        if conn is not None and not self.complete:
            conn.close()

    release = close

    def cancel_deadline(self) -> None:
        """Stop the request's deadline timer (idempotent)."""
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one upstream; answers one request at a time."""

    def __init__(self, pool: _HostPool) -> None:
        self._pool = pool
        self._parser = httptools.HttpResponseParser(self)
        self.transport: Any = None
        self.response: Http1Response | None = None
        self._head: asyncio.Future[Http1Response] | None = None
        self._informational = False
        self._eof_body = False
        self.closed = False
        self.idle_since = 0.0
        self.reused = False  # taken from the idle pool for its current request
        self._answered = False  # a byte of the current request's answer arrived
        self._paused = False  # the unread body is over the high-water mark
        self._held = False  # the reader is coalescing (see Http1Body.readany)
        # The client whose connection limit this connection counts against while busy.
        self.slot: Http1Client | None = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.response is None:
            self.close()  # bytes nobody asked for: the connection cannot be trusted
            return
        self._answered = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(PayloadError(f"the upstream's answer is not valid HTTP/1.1: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._pool.forget(self)
        resp = self.response
        if resp is None:
            self._free_slot()
            return
        why = f" ({exc})" if exc else ""
        if self._head is not None:
            stale = self.reused and not self._answered
            error = _StaleConnectionError if stale else ServerDisconnectedError
            self._fail(error(f"the upstream closed the connection before answering{why}"))
        elif self._eof_body:
            self._finish()  # a body delimited by the end of the connection
        else:
            self._fail(
                PayloadError(f"the upstream closed the connection in the middle of its answer{why}")
            )
        self._free_slot()

    def throttle(self, *, paused: bool | None = None, held: bool | None = None) -> None:
        """Read no more while the body is over the high-water mark or its reader coalesces."""
        was = self._paused or self._held
        self._paused = self._paused if paused is None else paused
        self._held = self._held if held is None else held
        now = self._paused or self._held
        transport = self.transport
        if now != was and transport is not None and not transport.is_closing():
            if now:
                transport.pause_reading()
            else:
                transport.resume_reading()

    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None and not self._informational:
            self.response.raw_headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.response
        if resp is None:
            return
        status = self._parser.get_status_code()
        if 100 <= status < 200:
            self._informational = True  # 100 Continue and friends: the real answer follows
            resp.raw_headers.clear()
            return
        resp.status = status
        lengths = {k.lower() for k, _ in resp.raw_headers} & _LENGTHS
        self._eof_body = not lengths and status not in (204, 304)
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_result(resp)

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response.content.feed(body)

    def on_message_complete(self) -> None:
        if self._informational:
            self._informational = False
            return
        self._finish()

    def _finish(self) -> None:
        resp, self.response = self.response, None
        if resp is None:
            return
        resp.complete = True
        resp.cancel_deadline()
        resp.content.feed_eof()
        self.throttle(paused=False, held=False)  # a body reader's hold ends with the body
        if self.closed or not self._parser.should_keep_alive():  # (close frees the slot)
            self.close()
        else:
            client = self.slot
            self._free_slot()
            self._pool.put(self)
            if client is not None and client._sweep is None:
                client._sweep_later()

    def _fail(self, exc: BaseException) -> None:
        head, self._head = self._head, None
        if head is not None and not head.done():
            head.set_exception(exc)
        resp, self.response = self.response, None
        if resp is not None:
            resp.content.set_exception(exc)

    def send(self, data: bytes, deadline: float | None) -> asyncio.Future[Http1Response]:
        """Write one request; the future resolves with the answer's head."""
        loop = asyncio.get_running_loop()
        resp = self.response = Http1Response(self)
        self._answered = False
        head = self._head = loop.create_future()
        if deadline is not None:
            resp._deadline = loop.call_at(deadline, self._on_deadline, resp)
        self.transport.write(data)
        return head

    def _on_deadline(self, resp: Http1Response) -> None:
        if self.response is resp:
            self._fail(TimeoutError("the request deadline passed"))
            self.close()

    def _free_slot(self) -> None:
        client, self.slot = self.slot, None
        if client is not None:
            client._release_slot()

    def close(self) -> None:
        self._free_slot()
        if not self.closed:
            self.closed = True
            self._pool.forget(self)
            if self.transport is not None:
                self.transport.close()


class _HostPool:
    __slots__ = ("host", "idle", "port")

    def __init__(self, host: str, port: int) -> None:
        self.host = host
        self.port = port
        self.idle: list[_Connection] = []

    def put(self, conn: _Connection) -> None:
        conn.idle_since = time.monotonic()
        self.idle.append(conn)

    def forget(self, conn: _Connection) -> None:
        with contextlib.suppress(ValueError):
            self.idle.remove(conn)


class Http1Client:
    """Keep-alive HTTP/1.1 connections to ``http://`` upstreams, at most ``max_connections``;
    one idle for ``keepalive_timeout`` s (below the servers' 5 s) is closed. One event loop."""

    def __init__(
        self,
        *,
        max_connections: int = 256,
        keepalive_timeout: float = 4.0,
        connect_timeout: float = 10.0,
    ) -> None:
        self.max_connections = max_connections
        self.keepalive_timeout = keepalive_timeout
        self.connect_timeout = connect_timeout
        self._pools: dict[tuple[str, int], _HostPool] = {}
        self._urls: dict[str, tuple[_HostPool, bytes]] = {}
        self._busy = 0
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()
        self._closed = False
        self._sweep: asyncio.TimerHandle | None = None

    def _sweep_later(self) -> None:
        self._sweep = asyncio.get_running_loop().call_later(
            self.keepalive_timeout, self._sweep_idle
        )

    def _sweep_idle(self) -> None:
        """Close the idle connections past the keep-alive; come back while any are idle."""
        self._sweep = None
        now = time.monotonic()
        left = False
        for pool in self._pools.values():
            for conn in list(pool.idle):
                if now - conn.idle_since >= self.keepalive_timeout or conn.closed:
                    conn.close()
                else:
                    left = True
        if left and not self._closed:
            self._sweep_later()

    def _route(self, url: str) -> tuple[_HostPool, bytes]:
        """The pool of ``url``'s host and its request-line target, cached per URL."""
        hit = self._urls.get(url)
        if hit is not None:
            return hit
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"{url!r}: the lean HTTP/1.1 client takes http:// URLs only")
        host, port = parts.hostname, parts.port or 80
        pool = self._pools.setdefault((host, port), _HostPool(host, port))
        netloc = f"[{host}]" if ":" in host else host
        if port != 80:
            netloc += f":{port}"
        target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        hit = (pool, f" {target} HTTP/1.1\r\nHost: {netloc}\r\n".encode("latin-1"))
        if len(self._urls) >= _URL_CACHE_SIZE:
            self._urls.clear()
        self._urls[url] = hit
        return hit

    async def _acquire(
        self, pool: _HostPool, deadline: float | None, *, fresh: bool = False
    ) -> _Connection:
        if self._closed:
            raise RuntimeError("this HTTP client was closed")
        while self._busy >= self.max_connections:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            except BaseException:
                if not waiter.cancelled() and waiter.done():
                    self._wake_one()
                raise
        self._busy += 1
        try:
            now = time.monotonic()
            idle = pool.idle
            conn = None
            while idle and not fresh:
                candidate = idle.pop()
                if (
                    not candidate.closed
                    and not candidate.transport.is_closing()
                    and now - candidate.idle_since < self.keepalive_timeout
                ):
                    conn = candidate
                    conn.reused = True
                    break
                candidate.close()
            if conn is None:
                conn = await self._connect(pool, deadline)
                conn.reused = False
        except BaseException:
            self._release_slot()
            raise
        conn.slot = self
        return conn

    async def _connect(self, pool: _HostPool, deadline: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        where = f"{pool.host}:{pool.port}"
        limit = self.connect_timeout
        if deadline is not None:
            limit = min(limit, max(deadline - loop.time(), 0.0))
        try:
            async with asyncio.timeout(limit):
                _, conn = await loop.create_connection(
                    lambda: _Connection(pool), pool.host, pool.port
                )
        except TimeoutError:
            raise ConnectTimeout(f"connecting to {where} took over {limit:g}s") from None
        except OSError as exc:
            raise ConnectError(where, exc) from exc
        sock = conn.transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    def _release_slot(self) -> None:
        self._busy -= 1
        self._wake_one()

    def _wake_one(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def request(
        self,
        method: str,
        url: str,
        headers: Mapping[str, str] | Iterable[tuple[str, str]],
        body: bytes,
        *,
        timeout: float | None,
    ) -> Http1Response:
        """Send one request; the answer once its head arrived (``timeout``: the whole exchange).
        Raises the module's errors, or ``ValueError`` for a header with a line break."""
        pool, line = self._route(url)
        parts = [method.encode("latin-1"), line]
        items = headers.items() if isinstance(headers, Mapping) else headers
        for name, value in items:
            if "\n" in value or "\r" in value or "\n" in name or "\r" in name:
                raise ValueError(f"header {name!r}: a line break in a header is not allowed")
            if name.lower() in _FRAMING:
                continue  # this client frames the message itself
            parts.append(f"{name}: {value}\r\n".encode("latin-1"))
        parts.extend((b"Content-Length: %d\r\n\r\n" % len(body), body))
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        data = b"".join(parts)
        conn = await self._acquire(pool, deadline)
        try:
            return await conn.send(data, deadline)
        except BaseException as exc:
            conn.close()  # an answer may still come on it: never reuse it
            if not isinstance(exc, _StaleConnectionError):
                raise
            stale = exc
        try:
            conn = await self._acquire(pool, deadline, fresh=True)
        except (ConnectError, ConnectTimeout) as exc:
            raise ServerDisconnectedError(
                f"{stale}; sending it again on a new connection failed: {exc}"
            ) from exc
        try:
            return await conn.send(data, deadline)
        except BaseException:
            conn.close()
            raise

    async def aclose(self) -> None:
        """Close every pooled connection (idempotent); requests after this fail."""
        self._closed = True
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        for pool in self._pools.values():
            for conn in list(pool.idle):
                conn.close()
        self._pools.clear()
        self._urls.clear()
