"""An upstream exchange's request (:class:`PreparedRequest`), answer
(:class:`UpstreamResponse`) and failures, classified by whether the request may have reached
the upstream (:func:`classify_failure`)."""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple, cast

import aiohttp
import attrs
import orjson

from relax_core._http.headers import _DROP_RESPONSE_RAW, forward_headers
from relax_core._http.http1 import ConnectError, ConnectTimeout, Http1Body
from relax_core._quote import quote_body
from relax_core.errors import (
    RequestNotReplayedError,
    StreamStalledError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamUnreachableError,
)

if TYPE_CHECKING:
    from relax_core.discovery.routing import RouteTarget


class PreparedRequest(NamedTuple):
    """A routed request, ready to send: exactly the bytes and headers that go on the wire;
    ``target`` is the resolver's decision (``None`` only for requests built by hand)."""

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
    exc: BaseException,
    prepared: PreparedRequest,
    deadline: float | None,
    *,
    answer_started: bool = False,
) -> UpstreamError:
    """The error for an aiohttp/OS failure of ``prepared``: ``UpstreamUnreachableError`` when
    nothing was sent, else ``RequestNotReplayedError`` (504 for a deadline, else 502) with
    ``answer_started`` (the failure came mid-answer)."""
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
            answer_started=True,
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
            answer_started=answer_started,
        )
    return RequestNotReplayedError(
        502,
        f"{prepared.method} {where} failed after it was sent: {type(exc).__name__}: {exc}; "
        f"it is not replayed (request id {rid})",
        request_id=rid,
        answer_started=answer_started,
    )


class _IdleWatch:
    """Fails a body read that waited longer than its limit for the next bytes: one timer per
    limit period (not per chunk) that fails the stream or re-arms for the current wait's end."""

    __slots__ = ("_content", "_first", "_handle", "_idle", "_loop", "since", "started")

    def __init__(self, content: Any, idle: float | None, first: float | None) -> None:
        self._content = content
        self._loop = asyncio.get_running_loop()
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
        since, limit = self.since, self._idle if self.started else self._first
        if since is None or limit is None:
            return  # no read is waiting (the next one re-arms the timer), or no limit
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


@attrs.define(eq=False)
class UpstreamResponse:
    """An upstream's answer whose headers have arrived; read the body once (:meth:`read`,
    :meth:`json`, :meth:`iter_chunks`, :meth:`iter_sse`), then :meth:`aclose` it (``async
    with``). A failure while reading raises ``RequestNotReplayedError`` (and calls
    ``on_failure(error)``), a 504 one when a piece-by-piece read waits past ``idle_timeout`` /
    ``first_chunk_timeout`` (``None``: no limit). The status is not checked."""

    _resp: Any
    prepared: PreparedRequest
    _on_close: Any = attrs.field(default=None, kw_only=True)
    _on_failure: Any = attrs.field(default=None, kw_only=True)
    _idle_timeout: float | None = attrs.field(default=None, kw_only=True)
    _first_chunk_timeout: float | None = attrs.field(default=None, kw_only=True)
    _closed: bool = attrs.field(default=False, init=False)

    @property
    def status(self) -> int:
        """The upstream's HTTP status."""
        return cast(int, self._resp.status)

    @property
    def request_id(self) -> str:
        """The id this request travelled with."""
        return self.prepared.request_id

    @property
    def headers(self) -> Mapping[str, str]:
        """The upstream's response headers (case-insensitive, as received)."""
        return cast("Mapping[str, str]", self._resp.headers)

    @property
    def target(self) -> RouteTarget | None:
        """Where the resolver sent this request."""
        return self.prepared.target

    def forward_headers(self) -> dict[str, str]:
        """The response headers a gateway forwards (see :func:`forward_headers`)."""
        return forward_headers(self._resp.headers.items(), response=True)

    def asgi_headers(self, skip: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
        """:meth:`forward_headers` as ASGI pairs of the raw bytes (lower-case names), without
        the names in ``skip`` (lower-case bytes)."""
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
        err = classify_failure(exc, self.prepared, None, answer_started=True)
        if self._on_failure is not None:
            self._on_failure(err)
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
        return decode_answer(body, self.prepared, f"answered {self.status} with a body")

    def raise_for_status(self, body: bytes = b"") -> None:
        """Raise :class:`UpstreamStatusError` if the status is 400 or above."""
        if self.status >= 400:
            raise status_error(self.status, body, self._resp.headers, self.prepared)

    async def iter_chunks(self, coalesce: float = 0.0) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive, under the idle limits; ``coalesce``: see
        :meth:`relax_core._http.http1.Http1Body.readany`."""
        content = self._resp.content
        read: Callable[[], Awaitable[bytes]] = content.readany
        if coalesce > 0.0 and isinstance(content, Http1Body):
            read = functools.partial(content.readany, coalesce)
        watch = _IdleWatch(content, self._idle_timeout, self._first_chunk_timeout)
        try:
            while True:
                watch.waiting()
                chunk = await read()
                watch.since = None
                if not chunk:
                    break
                watch.started = True
                yield chunk
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise self._fail(exc) from exc
        finally:
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
                yield decode_answer(data, self.prepared, "sent an event")

    async def aclose(self) -> None:
        """Release the connection (idempotent). An unread body closes it instead."""
        if self._closed:
            return
        self._closed = True
        if self._resp.content.at_eof():
            self._resp.release()
        else:  # an unread or half-read body: the connection cannot be reused
            self._resp.close()
        if self._on_close is not None:
            self._on_close()

    def add_close_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` too when the response is closed (after any callback before it)."""
        before = self._on_close

        def both() -> None:
            try:
                if before is not None:
                    before()
            finally:
                callback()

        self._on_close = both

    async def __aenter__(self) -> UpstreamResponse:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def decode_answer(data: bytes, prepared: PreparedRequest, what: str) -> Any:
    """``data`` from the upstream of ``prepared`` (``what``: ``"sent an event"``, ...) as JSON.

    :raises UpstreamError: 502, ``data`` is not JSON (the message quotes its start)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(
            502,
            f"{_where(prepared)} {what} that is not JSON ({data[:120]!r})",
            request_id=prepared.request_id,
        ) from exc


def status_error(
    status: int, body: bytes, headers: Mapping[str, str], prepared: PreparedRequest
) -> UpstreamStatusError:
    """The :class:`UpstreamStatusError` for an error answer."""
    snippet = quote_body(body)
    return UpstreamStatusError(
        status,
        f"{_where(prepared)} answered {status}: {snippet}",
        body=body,
        url=prepared.url,
        request_id=prepared.request_id,
        retry_after=parse_retry_after(headers.get("Retry-After")),
    )
