"""The private control channel: onload and offload to engine heads as one HTTP request each
(``POST /_relax/control/{method}`` with a per-start token; ``docs/manager.md``)."""

from __future__ import annotations

import asyncio
import atexit
import builtins
import concurrent.futures
import contextlib
import hmac
import json
import secrets
import threading
from collections.abc import Awaitable, Callable, Hashable, Mapping
from typing import Any, TypeVar

import attrs
from aiohttp import web

from relax_core import errors
from relax_core._http.http1 import Http1Client
from relax_core._quote import quote_body
from relax_core.engine.admission import PRIVATE_PREFIX, serve_catch_all
from relax_core.errors import ChannelError, RelaxError
from relax_core.manager.fanout import CallOutcome

#: Path prefix of every private control call (refused with 403 at the public port).
CONTROL_PREFIX = f"{PRIVATE_PREFIX}control/"
#: The header that carries the per-start token.
TOKEN_HEADER = "X-Relax-Control-Token"

# Idle keep-alive seconds, the client's well below the endpoint's (a minute: still open at the
# next step's switch).
_CLIENT_KEEPALIVE = 60.0
_SERVER_KEEPALIVE = 120.0

K = TypeVar("K", bound=Hashable)
Handler = Callable[..., Awaitable[Any]]


@attrs.frozen
class ControlAddress:
    """Where one head's private control endpoint listens, and its token (never logged)."""

    url: str
    token: str = attrs.field(repr=False)


@attrs.define(eq=False)
class ControlChannelServer:
    """The private control endpoint of one engine head (runs on the worker's event loop).

    :param handlers: method name -> coroutine function called with the JSON body's keys.
    :param engine_id: named in every refusal.
    :param host: the interface to bind (the one the manager reaches the node on)."""

    handlers: Mapping[str, Handler]
    engine_id: str = attrs.field(kw_only=True)
    host: str = attrs.field(default="127.0.0.1", kw_only=True)
    port: int = attrs.field(default=0, kw_only=True)
    _token: str = attrs.field(factory=lambda: secrets.token_urlsafe(32), init=False)
    _runner: web.AppRunner | None = attrs.field(default=None, init=False)

    @property
    def address(self) -> ControlAddress:
        """The URL and token to hand to the manager (through Ray, never through discovery)."""
        return ControlAddress(f"http://{self.host}:{self.port}", self._token)

    async def start(self) -> ControlAddress:
        """Bind the private port and serve; return the address."""
        if self._runner is not None:
            return self.address
        # Not cancelled: a caller that stops waiting does not abort a release halfway.
        self._runner, self.port = await serve_catch_all(
            self._handle, self.host, self.port, cancel=False, keepalive=_SERVER_KEEPALIVE
        )
        return self.address

    async def stop(self) -> None:
        """Stop serving. Idempotent."""
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    def _refuse(self, status: int, message: str) -> web.Response:
        return web.json_response(
            {"ok": False, "type": "ChannelError", "message": message, "engine_id": self.engine_id},
            status=status,
        )

    async def _handle(self, request: web.Request) -> web.Response:
        given = request.headers.get(TOKEN_HEADER, "")
        if not hmac.compare_digest(given.encode(), self._token.encode()):
            return self._refuse(
                401,
                f"the control endpoint of engine {self.engine_id!r} needs its manager's token in "
                f"{TOKEN_HEADER}; it is private to the InferenceManager",
            )
        path = request.path
        name = path[len(CONTROL_PREFIX) :] if path.startswith(CONTROL_PREFIX) else ""
        handler = self.handlers.get(name)
        if request.method != "POST" or handler is None:
            return self._refuse(
                404,
                f"{request.method} {path}: engine {self.engine_id!r} serves POST "
                f"{CONTROL_PREFIX}{{{', '.join(sorted(self.handlers))}}}",
            )
        try:
            kwargs = json.loads(await request.read() or b"{}")
        except ValueError as exc:
            return self._refuse(400, f"{path}: the body is not JSON: {exc}")
        if not isinstance(kwargs, dict):
            return self._refuse(400, f"{path}: the body must be a JSON object of arguments")
        try:
            value = await handler(**kwargs)
        except Exception as exc:
            body: dict[str, Any] = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
            status = getattr(exc, "status", None)
            if isinstance(status, int):
                body["status"] = status
            return web.json_response(body)
        return web.json_response({"ok": True, "value": value})


def _remote_error(body: Mapping[str, Any]) -> BaseException:
    """The worker's exception, rebuilt as the same class where that is a known one."""
    name, message = str(body.get("type", "")), str(body.get("message", ""))
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, errors.UpstreamError):
        return cls(int(body.get("status") or 502), message)
    if isinstance(cls, type) and issubclass(cls, RelaxError) and cls.__init__ is Exception.__init__:
        return cls(message)
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception) and cls.__module__ == "builtins":
        with contextlib.suppress(TypeError):
            return cls(message)
    return RelaxError(f"{name}: {message}" if name else message)


class _Loop:
    """One event loop thread and one HTTP client for every manager of this process."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: Http1Client | None = None
        self._exit_hook = False

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or self._thread is None or not self._thread.is_alive():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(
                    target=loop.run_forever, name="relax-control-channel", daemon=True
                )
                thread.start()
                # A client belongs to the loop it was made on (after a fork, a new loop).
                self._loop, self._thread, self._client = loop, thread, None
                if not self._exit_hook:
                    atexit.register(self.close)
                    self._exit_hook = True
            return self._loop

    def client(self) -> Http1Client:
        # Called on the loop thread only.
        if self._client is None:
            self._client = Http1Client(max_connections=1 << 16, keepalive_timeout=_CLIENT_KEEPALIVE)
        return self._client

    def close(self) -> None:
        """Close the client and stop the loop (at interpreter exit). Idempotent."""
        with self._lock:
            loop, thread, self._loop, self._thread = self._loop, self._thread, None, None
        if loop is None or thread is None or not thread.is_alive():
            return
        client, self._client = self._client, None
        if client is not None:
            # Exiting anyway: a client that does not close must not block.
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(client.aclose(), loop).result(5.0)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5.0)
        if not thread.is_alive():
            loop.close()


_SHARED = _Loop()


async def _call(
    address: ControlAddress, method: str, kwargs: Mapping[str, Any], timeout: float
) -> CallOutcome:
    url = f"{address.url}{CONTROL_PREFIX}{method}"
    headers = {TOKEN_HEADER: address.token, "Content-Type": "application/json"}
    try:
        resp = await _SHARED.client().request(
            "POST", url, headers, json.dumps(dict(kwargs)).encode(), timeout=timeout
        )
        try:
            raw = await resp.read()
        finally:
            resp.release()
        status = resp.status
    except TimeoutError:  # the deadline, or no connection within it
        return CallOutcome(timed_out=True)
    except OSError as exc:
        return CallOutcome(
            error=ChannelError(
                f"POST {url}: {type(exc).__name__}: {exc} (the head's private control endpoint "
                "did not answer; if the manager cannot reach the worker nodes' ports, build it "
                "with control_channel=False)"
            )
        )
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict) or "ok" not in body:
        return CallOutcome(error=ChannelError(f"POST {url} answered {status}: {quote_body(raw)}"))
    if status != 200:
        return CallOutcome(
            error=ChannelError(f"POST {url} answered {status}: {body.get('message')}")
        )
    if body["ok"]:
        return CallOutcome(value=body.get("value"))
    return CallOutcome(error=_remote_error(body))


def call_many(
    calls: Mapping[K, tuple[ControlAddress, str, Mapping[str, Any]]], timeout: float
) -> dict[K, CallOutcome]:
    """Send every call (key -> ``(address, method, kwargs)``) at once; one outcome per key
    by ``timeout`` (``timed_out`` for one still running). Never raises for a failed call."""
    if not calls:
        return {}
    keys = list(calls)

    async def _all() -> list[CallOutcome]:
        return await asyncio.gather(*(_call(*calls[k], timeout) for k in keys))

    future = asyncio.run_coroutine_threadsafe(_all(), _SHARED.loop())
    try:
        # Each call has its own deadline; the margin only covers the hop back to this thread.
        outcomes = future.result(timeout + 5.0)
    except concurrent.futures.TimeoutError:
        future.cancel()
        return dict.fromkeys(keys, CallOutcome(timed_out=True))
    return dict(zip(keys, outcomes, strict=True))
