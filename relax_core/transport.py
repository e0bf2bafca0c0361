"""The HTTP data path under :class:`~relax_core.client.InferenceClient` and the role gateways.

One pooled :class:`aiohttp.ClientSession` per client (aiohttp, not httpx: on a small machine
httpx's ``AsyncClient`` pool is about ten times slower at concurrency 32; ``relax bench client``
measures this data path against bare aiohttp). This module knows nothing about discovery or
routing: it sends a :class:`PreparedRequest` and classifies every failure by whether the request
may have reached the upstream:

- :class:`UpstreamUnreachableError` — the connection could not be opened, so nothing was sent;
  trying again (on a fresh snapshot) is safe.
- :class:`~relax_core.errors.RequestNotReplayedError` — the request was (or may have been) sent
  and then the exchange failed (reset, disconnect, deadline, truncated body). It is never sent
  again: the upstream may have executed it.
- :class:`UpstreamStatusError` — the upstream answered with an HTTP error status.

Headers: :func:`forward_headers` drops hop-by-hop headers (RFC 9110 section 7.6.1) and the ones
aiohttp recomputes, and keeps everything else, including ``X-Request-ID`` and
``X-SMG-Routing-Key``.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Iterable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import aiohttp
import orjson

from relax_core.errors import RequestNotReplayedError, UpstreamError
from relax_core.http1 import ConnectError, ConnectTimeout, Http1Client

if TYPE_CHECKING:
    from relax_core.routing import RouteTarget

__all__ = [
    "HOP_BY_HOP_HEADERS",
    "REQUEST_ID_HEADER",
    "ROUTING_KEY_HEADER",
    "PreparedRequest",
    "StreamStalledError",
    "Transport",
    "UpstreamResponse",
    "UpstreamStatusError",
    "UpstreamUnreachableError",
    "caller_headers",
    "classify_failure",
    "forward_headers",
    "parse_retry_after",
    "status_error",
]

#: The header carrying a request's id end to end (kept by every hop).
REQUEST_ID_HEADER = "X-Request-ID"
#: The affinity header sglang-router / smg hash on (``consistent_hashing``); kept by every hop.
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"

#: Headers that describe one connection, not the message; a proxy never forwards them.
HOP_BY_HOP_HEADERS = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "proxy-connection",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
    }
)
# Recomputed by aiohttp for the new message (or, for accept-encoding, left out so that an
# upstream answers uncompressed bytes that can be forwarded as they are).
_RECOMPUTED_REQUEST_HEADERS = frozenset({"host", "content-length", "accept-encoding"})
_RECOMPUTED_RESPONSE_HEADERS = frozenset({"content-length"})


_DROP_REQUEST = HOP_BY_HOP_HEADERS | _RECOMPUTED_REQUEST_HEADERS
_DROP_RESPONSE = HOP_BY_HOP_HEADERS | _RECOMPUTED_RESPONSE_HEADERS
_DROP_RESPONSE_RAW = frozenset(name.encode() for name in _DROP_RESPONSE)


def forward_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str]], *, response: bool = False
) -> dict[str, str]:
    """Copy ``headers`` without hop-by-hop headers (and those named by ``Connection``).

    For a request (``response=False``) ``Host``, ``Content-Length`` and ``Accept-Encoding`` go
    too: the new message recomputes them. For a response ``Content-Length`` goes: the body is
    re-framed by the server that forwards it (bytes are never decoded, so ``Content-Encoding``
    stays true). Names keep their case; lookups elsewhere are case-insensitive.
    """
    items = headers.items() if isinstance(headers, Mapping) else headers
    dropped = _DROP_RESPONSE if response else _DROP_REQUEST
    out: dict[str, str] = {}
    named: set[str] | None = None
    for name, value in items:
        low = name.lower()
        if low in dropped:
            if low == "connection":
                named = (named or set()) | {t.strip().lower() for t in value.split(",")}
            continue
        out[name] = value
    if named:
        out = {k: v for k, v in out.items() if k.lower() not in named}
    return out


_TAKEN_FROM_CALLER = _DROP_REQUEST | {"x-request-id", "x-smg-routing-key", "content-type"}


def caller_headers(
    headers: Mapping[str, str] | Iterable[tuple[str, str]],
) -> tuple[dict[str, str], str | None, str | None]:
    """Split a gateway caller's request headers: ``(forwarded, request_id, routing_key)``.

    ``forwarded`` is :func:`forward_headers` of them without ``X-Request-ID``,
    ``X-SMG-Routing-Key`` and ``Content-Type`` (the client sets those itself); the two ids are
    the caller's values of those headers (``None`` when absent or named by ``Connection``).
    One pass: this runs for every request a gateway forwards.
    """
    items = headers.items() if isinstance(headers, Mapping) else headers
    out: dict[str, str] = {}
    request_id = routing_key = None
    named: set[str] | None = None
    for name, value in items:
        low = name.lower()
        if low in _TAKEN_FROM_CALLER:
            if low == "x-request-id":
                request_id = value
            elif low == "x-smg-routing-key":
                routing_key = value
            elif low == "connection":
                named = (named or set()) | {t.strip().lower() for t in value.split(",")}
            continue
        out[name] = value
    if named:
        out = {k: v for k, v in out.items() if k.lower() not in named}
        if "x-request-id" in named:
            request_id = None
        if "x-smg-routing-key" in named:
            routing_key = None
    return out, request_id, routing_key


class UpstreamUnreachableError(UpstreamError):
    """No connection to the upstream could be opened: nothing was sent, a retry is safe.

    ``status`` is 502 (refused, reset while connecting, name not resolved) or 504 (the
    connect deadline passed).
    """


class UpstreamStatusError(UpstreamError):
    """The upstream answered with an HTTP error status (4xx or 5xx).

    ``status`` is the upstream's own status, ``body`` its body (bytes, as received),
    ``retry_after`` its ``Retry-After`` in seconds when it sent one, ``url`` where the request
    went. The request reached the upstream and is never replayed.
    """

    def __init__(
        self,
        status: int,
        message: str,
        *,
        body: bytes,
        url: str,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, message, request_id=request_id)
        self.body = body
        self.url = url
        self.retry_after = retry_after

    def json(self) -> Any:
        """The body decoded as JSON (raises ``orjson.JSONDecodeError`` when it is not JSON)."""
        return orjson.loads(self.body)


class PreparedRequest(NamedTuple):
    """A routed request, ready to send: exactly the bytes and headers that go on the wire.

    ``target`` is the resolver's decision (``None`` only for requests built by hand);
    ``request_id`` is also in ``headers`` under :data:`REQUEST_ID_HEADER`. Immutable (a named
    tuple rather than an attrs class: one is built per request on the hot path).
    """

    url: str
    body: bytes
    headers: Mapping[str, str]
    request_id: str
    target: RouteTarget | None = None
    method: str = "POST"


def parse_retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds (delta-seconds form only), or ``None``."""
    if not value:
        return None
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def _where(prepared: PreparedRequest) -> str:
    target = prepared.target
    if target is None:
        return prepared.url
    engine = f" engine {target.engine_id}" if target.engine_id else ""
    return f"{prepared.url} (model {target.model_id!r}{engine})"


def classify_failure(
    exc: BaseException, prepared: PreparedRequest, deadline: float | None
) -> UpstreamError:
    """The error for an aiohttp/OS failure of ``prepared``: was it (possibly) sent or not?

    :class:`UpstreamUnreachableError` when the connection could not be opened (nothing sent),
    else :class:`~relax_core.errors.RequestNotReplayedError` (504 for a deadline, else 502).
    """
    where = _where(prepared)
    rid = prepared.request_id
    if isinstance(exc, StreamStalledError):
        when = "in the middle of its streamed answer" if exc.started else "before its first chunk"
        return RequestNotReplayedError(
            504,
            f"{prepared.method} {where} sent nothing for {exc.seconds:g}s {when}: the engine may "
            f"be dead or stopped behind a proxy that keeps the connection open. It was sent and "
            f"is not replayed (request id {rid}); raise {exc.setting} if the engine can "
            "legitimately stay silent that long",
            request_id=rid,
        )
    if isinstance(exc, aiohttp.ConnectionTimeoutError | ConnectTimeout):
        return UpstreamUnreachableError(
            504, f"connecting to {where} timed out; nothing was sent", request_id=rid
        )
    if isinstance(exc, aiohttp.ClientConnectorError | ConnectError):
        return UpstreamUnreachableError(
            502, f"could not connect to {where}: {exc.os_error}; nothing was sent", request_id=rid
        )
    if isinstance(exc, TimeoutError):
        limit = f" within {deadline:g}s" if deadline is not None else ""
        return RequestNotReplayedError(
            504,
            f"{prepared.method} {where} got no complete answer{limit}; it was sent and is not "
            f"replayed (request id {rid})",
            request_id=rid,
        )
    return RequestNotReplayedError(
        502,
        f"{prepared.method} {where} failed after it was sent: {type(exc).__name__}: {exc}; "
        f"it is not replayed (request id {rid})",
        request_id=rid,
    )


class StreamStalledError(TimeoutError):
    """A streamed body went silent for longer than its idle limit (see :class:`Transport`).

    ``seconds`` is the limit that passed, ``started`` whether any body bytes had arrived
    (the first chunk has its own limit), ``setting`` the option that sets that limit.
    :func:`classify_failure` turns it into a 504
    :class:`~relax_core.errors.RequestNotReplayedError`.
    """

    def __init__(self, seconds: float, started: bool) -> None:
        self.seconds = seconds
        self.started = started
        self.setting = "stream_idle_timeout" if started else "stream_first_chunk_timeout"
        super().__init__(f"no data for {seconds:g}s")


class _IdleWatch:
    """Fails a body read that waited longer than its limit for the next bytes.

    One timer per limit period, not one per chunk: a read only records when it started
    waiting; the timer, when it fires, either fails the stream (the read has waited the whole
    limit) or re-arms itself for the current wait's end. Time the consumer spends elsewhere
    (e.g. blocked on a slow downstream) does not count, because no read is waiting then.
    """

    __slots__ = ("_content", "_first", "_handle", "_idle", "_loop", "since", "started")

    def __init__(
        self,
        content: Any,
        loop: asyncio.AbstractEventLoop,
        idle: float | None,
        first: float | None,
    ) -> None:
        self._content = content
        self._loop = loop
        self._idle = idle
        self._first = first
        self._handle: asyncio.TimerHandle | None = None
        self.since: float | None = None
        self.started = False

    def waiting(self) -> None:
        """A read starts waiting now."""
        now = self.since = self._loop.time()
        if self._handle is None:
            limit = self._idle if self.started else self._first
            if limit is not None:
                self._handle = self._loop.call_at(now + limit, self._fire)

    def _fire(self) -> None:
        self._handle = None
        since = self.since
        if since is None:
            return  # no read is waiting; the next one re-arms the timer
        limit = self._idle if self.started else self._first
        if limit is None:
            return
        due = since + limit
        if self._loop.time() >= due:
            self._content.set_exception(StreamStalledError(limit, self.started))
        else:
            self._handle = self._loop.call_at(due, self._fire)

    def cancel(self) -> None:
        """Stop watching (idempotent)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class UpstreamResponse:
    """An upstream's answer whose headers have arrived; the body is read on demand.

    Read it once, with :meth:`read`, :meth:`json`, :meth:`iter_chunks` or :meth:`iter_sse`,
    then :meth:`aclose` it (``async with`` does). A failure while reading raises
    :class:`~relax_core.errors.RequestNotReplayedError`. ``idle_timeout`` /
    ``first_chunk_timeout`` (seconds, ``None``: no limit) bound how long a piece-by-piece read
    (:meth:`iter_chunks` and what builds on it) waits for the next bytes once the body has
    started / for its first bytes; past it the read raises a 504
    :class:`~relax_core.errors.RequestNotReplayedError`. The status is not checked here: a
    gateway forwards an upstream's 4xx/5xx as it is; :meth:`raise_for_status` raises
    :class:`UpstreamStatusError` for callers that want an exception.
    """

    __slots__ = (
        "_closed",
        "_first_chunk_timeout",
        "_idle_timeout",
        "_on_close",
        "_on_failure",
        "_resp",
        "prepared",
    )

    def __init__(
        self,
        resp: Any,
        prepared: PreparedRequest,
        *,
        on_close: Any = None,
        on_failure: Any = None,
        idle_timeout: float | None = None,
        first_chunk_timeout: float | None = None,
    ) -> None:
        self._resp = resp
        self.prepared = prepared
        self._on_close = on_close
        self._on_failure = on_failure
        self._idle_timeout = idle_timeout
        self._first_chunk_timeout = first_chunk_timeout
        self._closed = False

    @property
    def status(self) -> int:
        """The upstream's HTTP status."""
        status: int = self._resp.status
        return status

    @property
    def headers(self) -> Mapping[str, str]:
        """The upstream's response headers (case-insensitive, as received)."""
        headers: Mapping[str, str] = self._resp.headers
        return headers

    @property
    def request_id(self) -> str:
        """The id this request travelled with."""
        return self.prepared.request_id

    @property
    def target(self) -> RouteTarget | None:
        """Where the resolver sent this request."""
        return self.prepared.target

    def forward_headers(self) -> dict[str, str]:
        """The response headers a gateway forwards (see :func:`forward_headers`)."""
        return forward_headers(self._resp.headers.items(), response=True)

    def asgi_headers(self, skip: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
        """The response headers a gateway forwards, as ASGI pairs with lower-case names.

        The rule of :func:`forward_headers` (``response=True``), applied to the raw bytes as
        received (nothing decoded); names in ``skip`` (lower-case bytes) are left out too.
        """
        out: list[tuple[bytes, bytes]] = []
        named: set[bytes] | None = None
        for name, value in self._resp.raw_headers:
            low = name.lower()
            if low in _DROP_RESPONSE_RAW or low in skip:
                if low == b"connection":
                    named = (named or set()) | {t.strip().lower() for t in value.split(b",")}
                continue
            out.append((low, value))
        if named:
            out = [(k, v) for k, v in out if k not in named]
        return out

    def _fail(self, exc: BaseException) -> UpstreamError:
        err = classify_failure(exc, self.prepared, None)
        if self._on_failure is not None:
            self._on_failure()
        return err

    async def read(self) -> bytes:
        """The whole body."""
        try:
            body: bytes = await self._resp.read()
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise self._fail(exc) from exc
        finally:
            await self.aclose()
        return body

    async def json(self) -> Any:
        """The whole body decoded as JSON; an upstream error status raises first."""
        body = await self.read()
        self.raise_for_status(body)
        try:
            return orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            raise UpstreamError(
                502,
                f"{_where(self.prepared)} answered {self.status} with a body that is not JSON "
                f"({body[:120]!r})",
                request_id=self.request_id,
            ) from exc

    def raise_for_status(self, body: bytes = b"") -> None:
        """Raise :class:`UpstreamStatusError` if the status is 400 or above."""
        if self.status >= 400:
            raise status_error(self.status, body, self._resp.headers, self.prepared)

    async def iter_chunks(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, unparsed (for byte-level forwarding).

        A wait for the next bytes longer than the idle limits raises a 504
        :class:`~relax_core.errors.RequestNotReplayedError` (see the class docstring).
        """
        content = self._resp.content
        watch = None
        if self._idle_timeout is not None or self._first_chunk_timeout is not None:
            watch = _IdleWatch(
                content,
                asyncio.get_running_loop(),
                self._idle_timeout,
                self._first_chunk_timeout,
            )
        try:
            if watch is None:
                async for chunk in content.iter_any():
                    yield chunk
            else:
                readany = content.readany
                while True:
                    watch.waiting()
                    chunk = await readany()
                    watch.since = None
                    if not chunk:
                        break
                    watch.started = True
                    yield chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise self._fail(exc) from exc
        finally:
            if watch is not None:
                watch.cancel()
            await self.aclose()

    async def iter_sse(self) -> AsyncIterator[bytes]:
        """Whole server-sent events as they arrive (each without its blank-line terminator)."""
        buf = b""
        async for chunk in self.iter_chunks():
            buf += chunk.replace(b"\r\n", b"\n") if b"\r" in chunk else chunk
            while True:
                cut = buf.find(b"\n\n")
                if cut < 0:
                    break
                event, buf = buf[:cut], buf[cut + 2 :]
                if event:
                    yield event
        if buf.strip():
            yield buf.rstrip(b"\n")

    async def iter_events(self) -> AsyncIterator[Any]:
        """The JSON objects of an SGLang/OpenAI event stream's ``data:`` lines, up to ``[DONE]``."""
        async for event in self.iter_sse():
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                try:
                    yield orjson.loads(data)
                except orjson.JSONDecodeError as exc:
                    raise UpstreamError(
                        502,
                        f"{_where(self.prepared)} sent an event that is not JSON ({data[:120]!r})",
                        request_id=self.request_id,
                    ) from exc

    async def aclose(self) -> None:
        """Release the connection (idempotent). An unread body closes it instead."""
        if self._closed:
            return
        self._closed = True
        if self._resp.content.at_eof():
            self._resp.release()
        else:
            # An unread or half-read body: the connection cannot be reused.
            self._resp.close()
        if self._on_close is not None:
            self._on_close()

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def status_error(
    status: int, body: bytes, headers: Mapping[str, str], prepared: PreparedRequest
) -> UpstreamStatusError:
    """The :class:`UpstreamStatusError` for an error answer."""
    snippet = body[:200].decode("utf-8", "replace")
    return UpstreamStatusError(
        status,
        f"{_where(prepared)} answered {status}: {snippet}",
        body=body,
        url=prepared.url,
        request_id=prepared.request_id,
        retry_after=parse_retry_after(headers.get("Retry-After")),
    )


class Transport:
    """A pooled aiohttp session with Relax's failure classification.

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

        The response is an :class:`~relax_core.http1.Http1Response` (``http://`` through the
        lean client) or an :class:`aiohttp.ClientResponse` (``https://``, or a session of the
        caller's); both have ``status``, ``headers``, ``raw_headers``, ``content``, ``read()``,
        ``release()`` and ``close()``. Raises :class:`UpstreamUnreachableError` (nothing sent)
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
                exc, prepared, self.timeout if timeout is None else timeout
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
