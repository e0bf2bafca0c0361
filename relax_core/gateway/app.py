"""The Starlette app of a role gateway: the routes of its OpenAPI document; the forwarding routes
are plain ASGI callables that cancel the exchange when the caller goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import attrs
import orjson
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from relax_core.errors import GatewayError, StreamStalledError, UpstreamError
from relax_core.gateway.handler import (
    GatewayAnswer,
    InferenceGatewayHandler,
    error_answer,
    gateway_error,
)
from relax_core.records import RoleSpec

log = logging.getLogger("relax.gateway")


#: How long a forwarded request runs before the gateway starts watching for its caller leaving.
#: Watching costs a task per request; answers faster than this (most, on a null engine) never
#: pay it, and a caller that leaves a long generation cancels it at most this much later.
WATCH_AFTER_S = 0.02


class _DisconnectWatch:
    """Cancels a request's task when its caller disconnects, once armed (see WATCH_AFTER_S)."""

    __slots__ = ("_fut", "_handle", "_receive", "_task", "disconnected", "done")

    def __init__(self, receive: Receive, task: asyncio.Task[Any] | None) -> None:
        self._receive = receive
        self._task = task
        self._fut: asyncio.Future[Any] | None = None
        self._handle: asyncio.TimerHandle | None = None
        self.done = False
        self.disconnected = False

    def arm(self, loop: asyncio.AbstractEventLoop) -> None:
        """Start watching in WATCH_AFTER_S seconds (the body has been read by then)."""
        self._handle = loop.call_later(WATCH_AFTER_S, self._start)

    def _start(self) -> None:
        self._handle = None
        if not self.done:
            self._fut = asyncio.ensure_future(self._receive())
            self._fut.add_done_callback(self._on_message)

    def _on_message(self, fut: asyncio.Future[Any]) -> None:
        if self.done or fut.cancelled() or fut.exception() is not None:
            return
        if fut.result().get("type") == "http.disconnect" and self._task is not None:
            self.disconnected = True
            self._task.cancel()

    def close(self) -> None:
        """Stop watching (idempotent)."""
        self.done = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._fut is not None:
            self._fut.cancel()
            self._fut = None


async def _read_body(receive: Receive, headers: Mapping[str, str], limit: int) -> bytes:
    def too_large(size: str) -> GatewayError:
        return GatewayError(
            413,
            f"the request body{size} is over this gateway's limit of {limit} bytes; send a "
            "smaller request or raise max_body_bytes",
        )

    declared = headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large(f" ({declared} bytes)")
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise asyncio.CancelledError  # the caller went away before sending its body
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise too_large("")
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _send_answer(send: Send, answer: GatewayAnswer) -> None:
    headers = answer.headers
    headers.append((b"content-length", str(len(answer.body)).encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body, "more_body": False})


class _StreamAborted(RuntimeError):
    """The upstream stream failed after the headers were relayed: the caller's connection is
    closed. ``status`` is what the request is counted as (502, or 504 for a stalled stream)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


@attrs.frozen(eq=False)
class ForwardRoute:
    """An ASGI endpoint forwarding one kind of request through the handler."""

    handler: InferenceGatewayHandler
    fn: Callable[[bytes, Mapping[str, str]], Awaitable[GatewayAnswer]]
    route: str

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        handler = self.handler
        metrics = handler.metrics
        started = time.perf_counter()
        metrics.started()
        status = 500
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        task = asyncio.current_task()
        watch = _DisconnectWatch(receive, task)
        try:
            handler.check_token(headers.get("authorization"))
            body = await _read_body(receive, headers, handler.max_body_bytes)
            watch.arm(asyncio.get_running_loop())
            answer = await self.fn(body, headers)
            status = answer.status
            if answer.stream is None:
                await _send_answer(send, answer)
            else:
                await _relay(send, answer, handler)
        except asyncio.CancelledError:
            if not watch.disconnected:
                raise
            status = 499  # the caller closed the connection (nginx's convention)
            if task is not None:
                task.uncancel()
        except _StreamAborted as exc:
            # Returning with the response incomplete closes the connection without the final
            # chunk; re-raising would too, with a traceback for an expected event.
            status = exc.status
            log.warning("%s", exc)
        except Exception as exc:
            err = gateway_error(exc)
            if err is None:
                log.exception("gateway %s: unexpected error on %s", handler.role, self.route)
                err = GatewayError(
                    500,
                    f"the gateway failed unexpectedly: {type(exc).__name__}: {exc}; this is "
                    "a bug in Relax, please report it with the gateway log",
                )
            status = err.status
            await _send_answer(send, error_answer(err))
        finally:
            watch.close()
            metrics.finished(self.route, status, time.perf_counter() - started)


async def _relay(send: Send, answer: GatewayAnswer, handler: InferenceGatewayHandler) -> None:
    """Relay an upstream event stream byte for byte; always close the upstream response.

    An upstream failing mid-stream ends it with one ``data: {"error": ...}`` event (SGLang's
    shape; on an event boundary only) and a truncated stream (no final chunk)."""
    resp = answer.stream
    assert resp is not None
    chunks: AsyncIterator[bytes] = resp.iter_chunks(handler.stream_coalesce)
    relayed = 0
    last = b"\n\n"
    try:
        await send(
            {"type": "http.response.start", "status": answer.status, "headers": answer.headers}
        )
        try:
            async for chunk in chunks:
                relayed += len(chunk)
                last = chunk
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except GatewayError:
            raise
        except Exception as exc:
            stalled = isinstance(exc.__cause__, StreamStalledError)
            status = 504 if stalled else 502
            handler.metrics.upstream_error("stream_stalled" if stalled else "stream_aborted")
            detail = exc.message if isinstance(exc, UpstreamError) else f"{exc}"
            message = (
                f"gateway {handler.role}: the engine's stream of request {resp.request_id} "
                f"failed after {relayed} bytes and is cut here: {detail}"
            )
            if last.endswith((b"\n\n", b"\r\n\r\n")):
                kind = "gateway_timeout" if stalled else "bad_gateway"
                error = {"message": message, "type": kind, "code": status}
                event = b"data: " + orjson.dumps({"error": error}) + b"\n\n"
                with contextlib.suppress(Exception):
                    await send({"type": "http.response.body", "body": event, "more_body": True})
            raise _StreamAborted(message, status) from exc
        await send({"type": "http.response.body", "body": b"", "more_body": False})
    finally:
        with contextlib.suppress(Exception):
            await chunks.aclose()  # type: ignore[attr-defined]
        await resp.aclose()


def _json(status: int, body: Any, headers: Mapping[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(body), status_code=status, media_type="application/json", headers=headers
    )


def _error(err: GatewayError) -> Response:
    answer = error_answer(err)
    return Response(
        answer.body,
        status_code=answer.status,
        headers={k.decode(): v.decode() for k, v in answer.headers if k != b"content-type"},
        media_type="application/json",
    )


def _schema(request: Request, default: int) -> int:
    raw = request.query_params.get("schema")
    if raw is None:
        return default
    if raw not in ("1", "2"):
        raise GatewayError(400, f"schema must be 1 or 2, got {raw!r}", field="schema")
    return int(raw)


def create_gateway_app(
    handler: InferenceGatewayHandler, *, spec: RoleSpec | None = None
) -> Starlette:
    """The Starlette app serving ``handler``'s role under ``/{role}/``.

    ``spec``: the role's record; its ``health_schema`` is ``/{role}/health``'s default and its
    ``openapi`` notes shape the document (without one: the common document, health schema 2).
    The adapter's preload starts when the app starts; the handler's client is closed when it
    shuts down.

    :raises ValueError: ``spec`` is the record of another role than the handler's."""
    role = handler.role
    if spec is not None and spec.name != role:
        raise ValueError(
            f"create_gateway_app: spec is the record of role {spec.name!r}, the handler serves "
            f"{role!r}; pass plugin_manager.role({role!r})"
        )
    health_default = spec.health_schema if spec is not None else 2
    from relax_core.gateway.openapi import openapi_document

    document = orjson.dumps(openapi_document(spec if spec is not None else role))

    def guarded(fn: Callable[[Request], Awaitable[Response]], auth: bool = True) -> Any:
        async def endpoint(request: Request) -> Response:
            try:
                if auth:
                    handler.check_token(request.headers.get("authorization"))
                return await fn(request)
            except GatewayError as err:
                return _error(err)

        endpoint.__name__ = fn.__name__
        return endpoint

    async def engines(request: Request) -> Response:
        return _json(200, await handler.engines(_schema(request, 2)))

    async def models(request: Request) -> Response:
        return _json(200, await handler.models())

    async def health(request: Request) -> Response:
        status, body = await handler.health(_schema(request, health_default))
        return _json(status, body, {"Retry-After": "1"} if status == 503 else None)

    async def openapi_json(request: Request) -> Response:
        return Response(document, media_type="application/json")

    async def metrics(request: Request) -> Response:
        return Response(handler.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        message = {
            404: f"no such route; this is the {role} gateway, see GET /{role}/openapi.json",
            405: f"method not allowed on {request.url.path}; see GET /{role}/openapi.json",
        }.get(status, str(getattr(exc, "detail", exc)))
        return _error(GatewayError(status, message))

    chat = ForwardRoute(handler, handler.chat, "chat")
    generate = ForwardRoute(handler, handler.generate, "generate")
    routes = [
        Route(f"/{role}/generate", generate, methods=["POST"]),
        Route(f"/{role}/chat/completions", chat, methods=["POST"]),
        Route(f"/{role}/v1/chat/completions", chat, methods=["POST"]),
        Route(f"/{role}/v1/models", guarded(models), methods=["GET"]),
        Route(f"/{role}/engines", guarded(engines), methods=["GET"]),
        Route(f"/{role}/health", guarded(health, auth=False), methods=["GET"]),
        Route(f"/{role}/openapi.json", guarded(openapi_json, auth=False), methods=["GET"]),
        Route("/metrics", guarded(metrics, auth=False), methods=["GET"]),
    ]

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        handler.startup()  # the adapter's tokenizers load in the background
        try:
            yield
        finally:
            await handler.shutdown()

    app = GatewayApp(
        routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan
    )
    app.state.handler = handler
    app.fast_routes = {
        route.path: route.endpoint for route in routes if isinstance(route.endpoint, ForwardRoute)
    }
    return app


class GatewayApp(Starlette):
    """A Starlette app whose forwarding routes skip the router and middleware stack.

    ``POST`` to an exact forwarding path goes straight to its :class:`ForwardRoute` (which
    answers its own errors as JSON); everything else takes Starlette's normal path."""

    fast_routes: dict[str, ForwardRoute] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.fast_routes.get(scope["path"])
            if route is not None:
                await route(scope, receive, send)
                return
        await super().__call__(scope, receive, send)
