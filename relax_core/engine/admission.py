"""The admission server: a CPU proxy that owns a strict engine head's public port
(``docs/manager.md``): the allowlist forwarded byte for byte, generation paths ``503`` while
closed and counted in flight, weight-update and control paths ``403``."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import attrs
from aiohttp import web

from relax_core._http.headers import NOT_SENT_HEADER, forward_headers
from relax_core._http.http1 import ConnectError, ConnectTimeout, Http1Client, Http1Response
from relax_core._http.server import serve_app
from relax_core.engine.spec import UPDATE_ENDPOINTS, InferenceEngineSpec

#: Seconds an idle connection to the engine is kept for reuse: well below the engine's 5 s.
ENGINE_KEEPALIVE = 2.0
#: Seconds the public port keeps an idle caller's connection: above every caller's own limit.
SERVER_KEEPALIVE = 120.0

#: Generation paths: gated by admission and counted as in flight.
GENERATE_PATHS = frozenset(
    {"/generate", "/v1/chat/completions", "/chat/completions", "/v1/completions"}
)
#: Cancellation paths: always forwarded (a drain must be able to abort).
CANCEL_PATHS = frozenset({"/abort_request", "/close_session"})
#: Metadata paths: always forwarded.
METADATA_PATHS = frozenset(
    {"/v1/models", "/server_info", "/get_server_info", "/model_info", "/get_model_info"}
)
#: ``/health`` is always forwarded; ``/health_generate`` answers 503 while admission is closed.
HEALTH_PATHS = frozenset({"/health", "/health_generate"})
#: What sglang-router and smg probe when they register or watch a worker.
PROBE_PATHS = frozenset({"/version", "/loads", "/get_load", "/metrics"})
ADMISSION_ALLOWLIST = GENERATE_PATHS | CANCEL_PATHS | METADATA_PATHS | HEALTH_PATHS | PROBE_PATHS

#: The private control endpoint's paths: the public port refuses them.
PRIVATE_PREFIX = "/_relax/"

_UPDATE_PATH_OF = {path: name for name, paths in UPDATE_ENDPOINTS.items() for path in paths}
_CONTROL_PATHS = frozenset(
    {
        "/release_memory_occupation",
        "/resume_memory_occupation",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/start_profile",
        "/stop_profile",
        "/shutdown",
    }
)


async def serve_catch_all(
    handler: Any, host: str, port: int, *, cancel: bool, keepalive: float, max_body: int = 1 << 20
) -> tuple[web.AppRunner, int]:
    """Serve ``handler`` for every method and path on ``host:port``; ``(runner, port)``.
    ``cancel``: a caller that disconnects cancels its handler at once."""
    app = web.Application(client_max_size=max_body)
    app.router.add_route("*", "/{tail:.*}", handler)
    return await serve_app(
        app, host, port, handler_cancellation=cancel, keepalive_timeout=keepalive
    )


@attrs.define(eq=False)
class AdmissionServer:
    """An admission proxy in front of one engine head: ``await start()`` on the serving loop,
    then :meth:`open` (admission starts closed); call it on that loop.

    :param upstream_url: the engine's raw ``http://host:port``.
    :param engine_id: named in every refusal.
    :param spec: the engine's capabilities; decides the wording of update-path refusals.
    :param retry_after: seconds sent in ``Retry-After`` while closed."""

    upstream_url: str
    engine_id: str = attrs.field(kw_only=True)
    spec: InferenceEngineSpec | None = attrs.field(default=None, kw_only=True)
    host: str = attrs.field(default="127.0.0.1", kw_only=True)
    port: int = attrs.field(default=0, kw_only=True)
    retry_after: float = attrs.field(default=1.0, kw_only=True)
    _connect_timeout: float = attrs.field(default=5.0, kw_only=True, alias="connect_timeout")
    #: Whether generation requests are admitted (:meth:`open`, :meth:`close`).
    is_open: bool = attrs.field(default=False, init=False)
    _reason: str = attrs.field(default="STARTING", init=False)
    #: Generation requests forwarded and not yet finished.
    inflight: int = attrs.field(default=0, init=False)
    _idle: asyncio.Event | None = attrs.field(default=None, init=False)
    _runner: web.AppRunner | None = attrs.field(default=None, init=False)
    _client: Http1Client | None = attrs.field(default=None, init=False)
    forwarded: int = attrs.field(default=0, init=False)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> str:
        """Bind the public port and serve; return the public base URL. Admission stays closed."""
        if self._runner is not None:
            return self.base_url
        self._idle = asyncio.Event()
        self._idle.set()
        self._client = Http1Client(
            max_connections=1 << 16,
            keepalive_timeout=ENGINE_KEEPALIVE,
            connect_timeout=self._connect_timeout,
        )
        # Cancelled at a disconnect: closing the upstream connection aborts it at the engine,
        # so drains never wait on it.
        self._runner, self.port = await serve_catch_all(
            self._handle,
            self.host,
            self.port,
            cancel=True,
            keepalive=SERVER_KEEPALIVE,
            max_body=1 << 30,
        )
        return self.base_url

    async def stop(self) -> None:
        """Stop serving and close the upstream client. Idempotent."""
        self.is_open = False
        self._reason = "STOPPED"
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()
        client, self._client = self._client, None
        if client is not None:
            await client.aclose()

    @property
    def base_url(self) -> str:
        """The public ``http://host:port`` (the one to publish)."""
        return f"http://{self.host}:{self.port}"

    # -- admission -------------------------------------------------------------------------

    def open(self) -> None:
        """Admit generation requests."""
        self.is_open = True
        self._reason = "READY"

    def close(self, reason: str = "DRAINING") -> None:
        """Refuse new generation requests (503 + Retry-After); in-flight ones continue."""
        self.is_open = False
        self._reason = reason

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no generation request is in flight; ``False`` if ``timeout`` passed first."""
        assert self._idle is not None, "start() the admission server first"
        try:
            async with asyncio.timeout(timeout):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True

    # -- serving ---------------------------------------------------------------------------

    def _refuse(
        self, status: int, message: str, *, not_sent: bool = False, **extra: Any
    ) -> web.Response:
        headers = {}
        if status == 503:
            headers["Retry-After"] = str(max(1, math.ceil(self.retry_after)))
        if not_sent:
            headers[NOT_SENT_HEADER] = "engine-unreachable"
        body = {"error": message, "engine_id": self.engine_id, "status": status, **extra}
        return web.json_response(body, status=status, headers=headers)

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        path = request.path
        if path in GENERATE_PATHS or path == "/health_generate":
            if not self.is_open:
                return self._refuse(
                    503,
                    f"engine {self.engine_id!r} is not admitting requests (state {self._reason}); "
                    "retry after Retry-After seconds or pick another replica",
                    state=self._reason,
                )
            return await self._forward_counted(request)
        if path in ADMISSION_ALLOWLIST:
            return await self._forward(request)
        if path in _UPDATE_PATH_OF:
            operation = _UPDATE_PATH_OF[path]
            if self.spec is not None and operation not in self.spec.allowed_operations:
                message = self.spec.refusal(operation, engine_id=self.engine_id)
            else:
                message = (
                    f"{path} is a weight-update path; engine {self.engine_id!r} takes weight "
                    "updates only from its InferenceManager, never through its public port"
                )
            return self._refuse(403, message, path=path, operation=operation)
        if path in _CONTROL_PATHS or path.startswith(PRIVATE_PREFIX):
            return self._refuse(
                403,
                f"{path} is an engine control path; it is driven by the InferenceManager of "
                f"engine {self.engine_id!r}, never through its public port",
                path=path,
            )
        return self._refuse(
            404,
            f"{path} is not on the admission allowlist of engine {self.engine_id!r}; allowed: "
            f"{sorted(ADMISSION_ALLOWLIST)}",
            path=path,
        )

    async def _forward_counted(self, request: web.Request) -> web.StreamResponse:
        assert self._idle is not None
        self.inflight += 1
        self._idle.clear()
        try:
            return await self._forward(request)
        finally:
            self.inflight -= 1
            if self.inflight == 0:
                self._idle.set()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        client = self._client
        if client is None:
            return self._refuse(503, f"admission server of {self.engine_id!r} is stopping")
        if request.method == "HEAD":
            # A HEAD answer's Content-Length describes a body that never comes.
            return self._refuse(405, f"HEAD is not forwarded to engine {self.engine_id!r}")
        body = await request.read() if request.can_read_body else b""
        url = f"{self.upstream_url.rstrip('/')}{request.rel_url}"
        try:
            upstream = await client.request(
                request.method, url, forward_headers(request.headers), body, timeout=None
            )
        except (OSError, TimeoutError) as exc:
            # One that never connected sent nothing: the caller may try another replica.
            return self._refuse(
                502,
                f"engine {self.engine_id!r} could not be reached at its private port: "
                f"{type(exc).__name__}: {exc}",
                not_sent=isinstance(exc, ConnectError | ConnectTimeout),
            )
        try:
            return await self._relay(request, upstream)
        finally:
            upstream.close()

    async def _relay(self, request: web.Request, upstream: Http1Response) -> web.StreamResponse:
        headers = forward_headers(upstream.headers, response=True)
        streaming = "Content-Length" not in upstream.headers or upstream.headers.get(
            "Content-Type", ""
        ).startswith("text/event-stream")
        response: web.StreamResponse | None = None
        try:
            if not streaming:
                payload = await upstream.read()
                self.forwarded += 1
                return web.Response(status=upstream.status, headers=headers, body=payload)
            response = web.StreamResponse(status=upstream.status, headers=headers)
            await response.prepare(request)
            async for chunk in upstream.content.iter_any():
                await response.write(chunk)
            await response.write_eof()
            self.forwarded += 1
            return response
        except ConnectionResetError:
            # The client went away mid-stream; closing the answer closes the upstream request.
            if response is None:
                raise
            return response
        except (OSError, TimeoutError) as exc:
            if response is not None:
                # Bytes already went out: cut the client's stream too, never replay it.
                if request.transport is not None:
                    request.transport.close()
                return response
            return self._refuse(
                502, f"engine {self.engine_id!r} broke off its answer: {type(exc).__name__}: {exc}"
            )
