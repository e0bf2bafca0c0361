"""The role gateway's request handling (:class:`InferenceGatewayHandler`, one per role): check,
adapt, forward through the direct client's data path, relay the answer's bytes (the error
mapping is docs/gateway.md's "Errors")."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import os
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

import attrs
import orjson

from relax_core._http.request import decode_json_body, weight_version
from relax_core._http.upstream import UpstreamResponse, parse_retry_after
from relax_core._quote import quote_body
from relax_core.client.breaker import BreakerSettings
from relax_core.client.cache import SnapshotProvider
from relax_core.client.client import InferenceClient
from relax_core.discovery.routing import RouteTarget
from relax_core.discovery.schema import ModelState, RoleSnapshot
from relax_core.errors import (
    GatewayError,
    InvalidRequestError,
    ModelNotReadyError,
    RoutingError,
    UpstreamError,
    UpstreamUnreachableError,
)
from relax_core.gateway.adapters import AdaptContext, Adapted, RoleAdapter
from relax_core.gateway.metrics import GatewayMetrics
from relax_core.plugins import PluginManager

#: A caller may shorten (never lengthen) the gateway's deadline with this header (seconds).
DEADLINE_HEADER = "X-Relax-Timeout"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: How long a relayed stream's bytes may be held back to be relayed together (see
#: :class:`InferenceGatewayHandler`'s ``stream_coalesce``).
DEFAULT_STREAM_COALESCE_S = 0.001

log = logging.getLogger("relax.gateway")

_JSON = b"application/json"
# Headers of an upstream answer the gateway sets itself (its server, or the request id).
_NOT_RELAYED = frozenset({b"date", b"server", b"x-request-id"})
_DEFAULT_RETRY_AFTER = 1.0
_ERROR_TYPES = {
    400: "invalid_request",
    401: "unauthorized",
    404: "not_found",
    405: "method_not_allowed",
    413: "request_too_large",
    502: "bad_gateway",
    503: "unavailable",
    504: "gateway_timeout",
}


@attrs.define
class GatewayAnswer:
    """What to send back: status, headers (ASGI byte pairs) and a body, or an upstream
    ``stream`` relayed chunk by chunk (the ASGI layer closes it whatever happens)."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    stream: UpstreamResponse | None = None


def error_answer(err: GatewayError) -> GatewayAnswer:
    """The JSON answer for ``err``: ``{"error": {"message", "type", "code"[, "param"]}}``.

    ``Retry-After``, ``X-Request-ID`` and (for a 401) ``WWW-Authenticate`` go in the headers."""
    error: dict[str, Any] = {
        "message": err.message,
        "type": _ERROR_TYPES.get(err.status, "error"),
        "code": err.status,
    }
    if err.field is not None:
        error["param"] = err.field
    headers = [(b"content-type", _JSON)]
    if err.retry_after is not None:
        headers.append((b"retry-after", str(max(1, round(err.retry_after))).encode()))
    if err.request_id is not None:
        headers.append((b"x-request-id", err.request_id.encode("latin-1", "replace")))
    if err.status == 401:
        headers.append((b"www-authenticate", b'Bearer realm="relax"'))
    return GatewayAnswer(err.status, headers, orjson.dumps({"error": error}))


def adapter_for_role(plugin_manager: PluginManager, role: str) -> RoleAdapter:
    """The gateway adapter the plugin of ``role`` registered (the pass-through one if none).

    :raises PluginError: no plugin registers ``role``."""
    spec = plugin_manager.role(role)
    if spec.gateway_adapter is None:
        return RoleAdapter()
    adapter = spec.gateway_adapter()
    if not isinstance(adapter, RoleAdapter):
        raise TypeError(
            f"role {role!r}: gateway_adapter returned {type(adapter).__name__}; it must return a "
            "relax_core.gateway.adapters.RoleAdapter"
        )
    return adapter


def build_gateway_handler(
    role: str,
    discovery: str | SnapshotProvider,
    *,
    plugin_manager: PluginManager,
    options: GatewayOptions | None = None,
    waker: Waker | None = None,
) -> InferenceGatewayHandler:
    """The handler of ``role``'s gateway: the one way every gateway is built.

    ``discovery``: a registry URL serving ``/engines?schema=2`` (a role gateway's
    ``http://host:port/{role}``, or a registry server) or a callable returning the snapshot.
    ``plugin_manager``: where the role's adapter, the routing policies and the weight sources
    come from. ``waker``: what wakes the role's sleeping models on demand (:class:`Waker`).

    :raises PluginError: no plugin registers ``role``.
    :raises ValueError: ``discovery`` is a URL that is not ``http(s)://``."""
    options = GatewayOptions() if options is None else options
    adapter = adapter_for_role(plugin_manager, role)
    url, provider = (discovery, None) if isinstance(discovery, str) else (None, discovery)
    client = InferenceClient(
        url,
        snapshot_provider=provider,
        role=role,
        ttl=options.snapshot_ttl,
        timeout=options.timeout,
        plugin_manager=plugin_manager,
        breaker=options.breaker,
        sleeping_note=options.sleeping_note,
    )
    return InferenceGatewayHandler(role, client, adapter, options, waker)


class Waker(Protocol):
    """What a role gateway calls to have its role's sleeping models woken (``relax serve``'s
    :class:`~relax_core.jobs.wake.WakeController`)."""

    def wakes(self, role: str) -> bool:
        """Whether ``role``'s models are woken on demand."""

    def enter(self, role: str, *, first: bool = True) -> bool:
        """Admit a request for ``role`` if it is awake (counted in flight until :meth:`end`);
        ``False``: :meth:`wake` it, then call again with ``first=False``."""

    async def wake(self, role: str, *, timeout: float | None = None) -> None:
        """Return once ``role`` is awake; raise a ``RoutingError`` (503) when it cannot be."""

    def end(self, role: str) -> None:
        """An admitted request has its whole answer (a stream: once it is closed)."""

    def describe(self, role: str) -> dict[str, Any]:
        """``role``'s residency, for ``/health``."""

    def collector(self, role: str) -> Any:
        """A Prometheus collector of ``role``'s wake counters, for ``/metrics``."""


def _error_for_upstream(exc: UpstreamError, metrics: GatewayMetrics) -> GatewayError:
    if isinstance(exc, UpstreamUnreachableError):
        metrics.upstream_error("connect_timeout" if exc.status == 504 else "unreachable")
        what = "the engine could not be reached; nothing was sent. Try again"
    elif exc.status == 504:
        metrics.upstream_error("deadline")
        what = (
            "the request deadline passed; it was sent and is not replayed. Raise the gateway "
            f"timeout or the {DEADLINE_HEADER} header, or send a shorter request"
        )
    else:
        metrics.upstream_error("transport")
        what = "the exchange with the engine failed after the request was sent; it is not replayed"
    return GatewayError(exc.status, f"{what}: {exc.message}", request_id=exc.request_id)


def _str_map(value: Mapping[str, str]) -> dict[str, str]:
    return dict(value)


def _positive(_: object, attribute: attrs.Attribute[Any], value: float | None) -> None:
    # None passes: the options whose type allows it read it as "no limit".
    if value is not None and not 0 < value < float("inf"):
        unit = "bytes" if attribute.name.endswith("_bytes") else "seconds"
        none = " or None" if "None" in str(attribute.type) else ""
        raise ValueError(f"{attribute.name}={value!r}: give a positive number of {unit}{none}")


def _check_token(_: object, attribute: attrs.Attribute[str | None], value: str | None) -> None:
    if value is not None and not value:
        raise ValueError("token: give a non-empty bearer token, or None for no auth")


def _check_coalesce(_: object, attribute: attrs.Attribute[float], value: float) -> None:
    if not 0.0 <= value <= 0.1:
        raise ValueError(
            f"stream_coalesce={value!r}: give seconds between 0 (relay every read at once) and 0.1"
        )


@attrs.frozen
class GatewayOptions:
    """How a role gateway handles requests, the same record whichever way it is served (each
    option: docs/gateway.md). ``model_paths``: local checkpoint directory per model id (for
    tokenizers). ``sleeping_note``: set when nothing will wake this role's SLEEPING models: a
    request to one gets 503 with this note and no Retry-After.

    :raises ValueError: a value out of range, naming the option (``max_body_bytes=0: …``)."""

    model_paths: dict[str, str] = attrs.field(factory=dict, converter=_str_map)
    timeout: float = attrs.field(default=300.0, validator=_positive)
    token: str | None = attrs.field(default=None, validator=_check_token, repr=False)
    max_body_bytes: int = attrs.field(default=DEFAULT_MAX_BODY_BYTES, validator=_positive)
    snapshot_ttl: float = attrs.field(default=0.5, validator=attrs.validators.ge(0.0))
    stream_idle_timeout: float | None = attrs.field(default=60.0, validator=_positive)
    stream_first_chunk_timeout: float | None = attrs.field(default=None, validator=_positive)
    stream_coalesce: float = attrs.field(
        default=DEFAULT_STREAM_COALESCE_S, validator=_check_coalesce
    )
    breaker: BreakerSettings | None = attrs.field(factory=BreakerSettings)
    sleeping_note: str | None = None


class InferenceGatewayHandler:
    """Request handling of one role's gateway (the Starlette app is a thin layer over it).

    Build it with :func:`build_gateway_handler`. It closes ``client`` on :meth:`shutdown`.
    Belongs to one event loop (that of the server running it); a ``blocking`` adapter's renders
    run in a small thread pool of the handler, never on the event loop."""

    def __init__(
        self,
        role: str,
        client: InferenceClient,
        adapter: RoleAdapter,
        options: GatewayOptions,
        waker: Waker | None,
    ) -> None:
        self.role = role
        self.waker = waker if waker is not None and waker.wakes(role) else None
        self.client = client
        self.adapter = adapter
        self.options = options
        # Read for every request by the app (attributes rather than options.* lookups).
        self.max_body_bytes = options.max_body_bytes
        self.stream_coalesce = options.stream_coalesce
        # Passed per request (math.inf: no limit), so a shared client's defaults do not apply.
        # (None, their "no limit", is the only false value their validator lets through.)
        self._idle = options.stream_idle_timeout or float("inf")
        self._first = options.stream_first_chunk_timeout or float("inf")
        self.metrics = GatewayMetrics(role)
        self.metrics.watch_client(client)
        if self.waker is not None:
            self.metrics.registry.register(self.waker.collector(role))
        self._pool: ThreadPoolExecutor | None = None
        self._preload: asyncio.Future[None] | None = None
        #: why the adapter's preload failed (``None``: it did not, or has not finished)
        self.preload_error: str | None = None
        # The context of a request before its model is known (frozen: shared by requests).
        ctx = AdaptContext(
            role=role, model=None, model_path=None, served_model_name=None, stream=False
        )
        self._plain_ctx, self._stream_ctx = ctx, attrs.evolve(ctx, stream=True)

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(
                max_workers=min(4, os.cpu_count() or 1), thread_name_prefix=f"{self.role}-adapt"
            )
        return self._pool

    def startup(self) -> None:
        """Start the adapter's preload in the background (call on the serving event loop).
        Idempotent; nothing to do for an adapter that loads nothing."""
        if self._preload is not None or type(self.adapter).preload is RoleAdapter.preload:
            return
        loop = asyncio.get_running_loop()
        self._preload = loop.run_in_executor(self._executor(), self._run_preload)

    def _run_preload(self) -> None:
        try:
            self.adapter.preload(self.options.model_paths)
        except Exception as exc:  # reported by /health and the log; raw requests still work
            self.preload_error = f"{type(exc).__name__}: {exc}"
            log.error("gateway %s: the role adapter's preload failed: %s", self.role, exc)

    async def shutdown(self) -> None:
        """Close the client and the adapter's thread pool (idempotent)."""
        await self.client.aclose()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    async def snapshot(self) -> RoleSnapshot:
        """The role's current snapshot (cached briefly). ``GatewayError(503)`` if unavailable."""
        try:
            return await self.client.snapshot()
        except RoutingError as exc:
            raise GatewayError(503, exc.message, retry_after=exc.retry_after) from exc

    async def engines(self, schema: int) -> dict[str, Any]:
        """``/engines``: the schema-2 snapshot, or the filtered schema-1 view."""
        snap = await self.snapshot()
        return snap.to_json() if schema == 2 else snap.schema1()

    async def models(self) -> dict[str, Any]:
        """``/v1/models``: the role's logical model ids, OpenAI style."""
        snap = await self.snapshot()
        data = [
            {
                "id": model_id,
                "object": "model",
                "owned_by": f"relax-{self.role}",
                "root": model.served_model_name,
                "state": model.state.value,
            }
            for model_id, model in snap.models.items()
        ]
        return {"object": "list", "data": data}

    async def health(self, schema: int) -> tuple[int, dict[str, Any]]:
        """``/health``: ``(status, body)``; 200 when some model is READY, else 503 (schema 1:
        the legacy genrm shape, ``status`` and counts of healthy engines)."""
        try:
            snap = await self.client.snapshot()
        except RoutingError as exc:
            if schema == 1:
                down = {"status": "unhealthy", "healthy_engines": 0, "total_engines": 0}
                return 503, {**down, "message": exc.message}
            return 503, {
                "role": self.role,
                "ready": False,
                "registry": "unavailable",
                "message": exc.message,
                "models": {},
            }
        ready = any(m.state is ModelState.READY for m in snap.models.values())
        residency = None if self.waker is None else self.waker.describe(self.role)
        if residency is not None and residency["state"] != "BLOCKED":
            ready = True  # asleep or moving, a request wakes it
        loading = self._preload is not None and not self._preload.done()
        ready = ready and not loading
        if schema == 1:
            engines = [e for m in snap.models.values() for e in m.engines]
            healthy = sum(1 for e in engines if e.state is ModelState.READY)
            legacy: dict[str, Any] = {
                "status": "healthy" if ready else "unhealthy",
                "healthy_engines": healthy,
                "total_engines": len(engines),
            }
            if ready and healthy == 0 and residency is not None:
                # Healthy with no engine awake: say why, or the body reads as a contradiction.
                legacy["residency"] = residency["state"]
                legacy["message"] = (
                    f"the role's engines are {residency['state'].lower()}; a request wakes them "
                    "(healthy_engines counts the engines awake now)"
                )
            return (200 if ready else 503), legacy
        models = {
            model_id: {
                "state": model.state.value,
                "route_mode": model.route_mode.value,
                "ready_engines": sum(1 for e in model.engines if e.state is ModelState.READY),
                "engines": len(model.engines),
            }
            for model_id, model in snap.models.items()
        }
        body = {
            "role": self.role,
            "ready": ready,
            "registry": "ok",
            "registry_epoch": snap.registry_epoch,
            "topology_revision": snap.topology_revision,
            "models": models,
        }
        if residency is not None:
            body["residency"] = residency
        if self._preload is not None:
            error = self.preload_error
            body["adapter"] = (
                "loading" if loading else "ok" if error is None else f"failed: {error}"
            )
        if loading:
            body["message"] = "the role adapter is still loading its tokenizers; wait"
        elif not ready:
            body["message"] = "no model of this role is READY; wait, or check `relax status`"
        return (200 if ready else 503), body

    def check_token(self, authorization: str | None) -> None:
        """Raise ``GatewayError(401)`` unless ``authorization`` carries the gateway's token."""
        token = self.options.token
        if token is not None and not hmac.compare_digest(
            (authorization or "").encode(), f"Bearer {token}".encode()
        ):
            raise GatewayError(
                401,
                "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the "
                "token this gateway was started with",
            )

    def deadline(self, headers: Mapping[str, str]) -> float:
        """The request's deadline: the gateway's, shortened by :data:`DEADLINE_HEADER`."""
        raw = headers.get(DEADLINE_HEADER.lower())
        if raw is None:
            return self.options.timeout
        try:
            value = float(raw)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise GatewayError(
                400,
                f"{DEADLINE_HEADER} must be a positive number of seconds, got {raw!r}",
                field=DEADLINE_HEADER,
            )
        return min(value, self.options.timeout)

    async def generate(self, body: bytes, headers: Mapping[str, str]) -> GatewayAnswer:
        """``POST /{role}/generate``: validate, adapt, forward to the engine's ``/generate``."""
        payload = self.adapter.check_generate(decode_json_body(body))
        return await self._admitted(headers, lambda: self._generate(payload, body, headers))

    async def chat(self, body: bytes, headers: Mapping[str, str]) -> GatewayAnswer:
        """``POST /{role}/chat/completions``: validate, forward to ``/v1/chat/completions``."""
        payload = self.adapter.check_chat(decode_json_body(body))
        chat = functools.partial(self._forward, "/v1/chat/completions", payload, body, headers)
        return await self._admitted(headers, chat)

    async def _admitted(
        self, headers: Mapping[str, str], answer: Callable[[], Awaitable[GatewayAnswer]]
    ) -> GatewayAnswer:
        """``answer()``; with a waker, once the role is admitted (woken first, within the
        deadline), counted in flight until its last byte so it is not put to sleep under it."""
        waker = self.waker
        if waker is None:
            return await answer()
        loop = asyncio.get_running_loop()
        until = loop.time() + self.deadline(headers)
        first = True
        while not waker.enter(self.role, first=first):
            first = False
            left = until - loop.time()
            if left <= 0:
                raise ModelNotReadyError(
                    f'role "{self.role}" was woken but evicted again before this request could '
                    "be sent (other requests wanted its GPUs); no request was sent. Retry",
                    role=self.role,
                    model="*",
                    state="SLEEPING",
                    retry_after=1.0,
                )
            await waker.wake(self.role, timeout=left)
        try:
            done = await answer()
        except BaseException:
            waker.end(self.role)
            raise
        if done.stream is None:
            waker.end(self.role)
        else:
            done.stream.add_close_callback(lambda: waker.end(self.role))
        return done

    async def _generate(
        self, payload: dict[str, Any], body: bytes, headers: Mapping[str, str]
    ) -> GatewayAnswer:
        ctx = self._stream_ctx if payload.get("stream") is True else self._plain_ctx
        target: RouteTarget | None = None
        adapted: Adapted | None = None
        if self.adapter.needs_model(payload):
            # One routing decision per request: the target chosen here is the one sent to.
            min_version = weight_version(payload, headers.get("x-relax-min-weight-version"))
            affinity = headers.get("x-smg-routing-key")
            target = await self.client.resolve(
                model=payload.get("model"),
                route_key=payload.get("route_key"),
                affinity_key=affinity,
                min_weight_version=min_version,
            )
            ctx = attrs.evolve(
                ctx,
                model=target.model_id,
                model_path=self.options.model_paths.get(target.model_id),
                served_model_name=target.served_model_name,
            )
            if self.adapter.blocking:
                adapted = await self._adapt_off_loop(payload, ctx)
                # The render took a while: the replica chosen before may be gone (the
                # reference's GenRM flow rechecks readiness after rendering).
                target = await self.client.recheck(
                    target, affinity_key=affinity, min_weight_version=min_version
                )
        if adapted is None:
            adapted = self.adapter.adapt_generate(payload, ctx)
        forwarded = body if adapted.payload is None else adapted.payload
        return await self._forward("/generate", payload, forwarded, headers, adapted, target)

    async def _adapt_off_loop(self, payload: dict[str, Any], ctx: AdaptContext) -> Adapted:
        """``adapter.adapt_generate`` in the handler's thread pool (after the preload)."""
        if self._preload is not None and not self._preload.done():
            await asyncio.shield(self._preload)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._executor(), self.adapter.adapt_generate, payload, ctx
        )

    async def _forward(
        self,
        path: str,
        request: dict[str, Any],
        payload: dict[str, Any] | bytes,
        headers: Mapping[str, str],
        adapted: Adapted | None = None,
        target: RouteTarget | None = None,
    ) -> GatewayAnswer:
        """Send ``payload`` (the caller's body, or the adapter's) for the checked ``request`` to
        ``path`` of ``target`` (``None``: resolved from ``request``) and answer."""
        timeout = self.deadline(headers)
        fwd = headers
        if self.options.token is not None:
            fwd = {k: v for k, v in headers.items() if k != "authorization"}
        try:
            resp = await self.client.open(
                path,
                payload,
                model=request.get("model"),
                route_key=request.get("route_key"),
                headers=fwd,
                target=target,
                timeout=timeout,
                stream_idle_timeout=self._idle,
                stream_first_chunk_timeout=self._first,
            )
        except UpstreamError as exc:
            raise _error_for_upstream(exc, self.metrics) from exc
        try:
            return await self._answer(resp, stream=request.get("stream") is True, adapted=adapted)
        except BaseException:
            await resp.aclose()
            raise

    async def _answer(
        self, resp: UpstreamResponse, *, stream: bool, adapted: Adapted | None
    ) -> GatewayAnswer:
        rid = resp.request_id
        if resp.status >= 400:
            return await self._upstream_error_answer(resp)
        headers = resp.asgi_headers(_NOT_RELAYED)
        headers.append((b"x-request-id", rid.encode("latin-1", "replace")))
        content_type = resp.headers.get("Content-Type", "")
        if stream and content_type.startswith("text/event-stream"):
            return GatewayAnswer(resp.status, headers, stream=resp)
        body = await self._read(resp)
        try:
            decoded = orjson.loads(body)
        except orjson.JSONDecodeError:
            self.metrics.upstream_error("bad_json")
            raise GatewayError(
                502,
                f"the engine at {resp.prepared.url} answered {resp.status} with a body that is "
                f"not JSON ({body[:80]!r}); check the engine's log",
                request_id=rid,
            ) from None
        if adapted is not None and adapted.response is not None:
            try:
                body = orjson.dumps(adapted.response(decoded))
            except (ValueError, TypeError, KeyError) as exc:
                self.metrics.upstream_error("bad_json")
                raise GatewayError(
                    502,
                    f"the engine's answer could not be adapted for role {self.role}: {exc}",
                    request_id=rid,
                ) from exc
            headers = [(k, v) for k, v in headers if k != b"content-type"]
            headers.append((b"content-type", _JSON))
        return GatewayAnswer(resp.status, headers, body)

    async def _read(self, resp: UpstreamResponse) -> bytes:
        try:
            return await resp.read()
        except UpstreamError as exc:
            raise _error_for_upstream(exc, self.metrics) from exc

    async def _upstream_error_answer(self, resp: UpstreamResponse) -> GatewayAnswer:
        rid = resp.request_id
        body = await self._read(resp)
        snippet = quote_body(body)
        status = resp.status
        if status < 500:
            try:
                orjson.loads(body)
            except orjson.JSONDecodeError:
                raise GatewayError(
                    status, f"the engine rejected the request ({status}): {snippet}", request_id=rid
                ) from None
            return GatewayAnswer(
                status,
                [(b"content-type", _JSON), (b"x-request-id", rid.encode("latin-1", "replace"))],
                body,
            )
        self.metrics.upstream_error("status")
        if status == 503:
            retry = parse_retry_after(resp.headers.get("Retry-After")) or _DEFAULT_RETRY_AFTER
            what = "the engine is not accepting requests now (draining or asleep); try again later"
            raise GatewayError(503, f"{what}: {snippet}", request_id=rid, retry_after=retry)
        if status == 504:
            raise GatewayError(504, f"the engine's own deadline passed: {snippet}", request_id=rid)
        raise GatewayError(
            502,
            f"the engine at {resp.prepared.url} failed with {status}: {snippet}; check its log",
            request_id=rid,
        )


def gateway_error(exc: BaseException) -> GatewayError | None:
    """The :class:`GatewayError` for an exception the handler raises, or ``None`` if unknown."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return GatewayError(400, exc.message, field=exc.field)
    if isinstance(exc, RoutingError):
        # A routing 503 without retry_after is one that trying again will not fix (a model
        # nothing wakes, a routing policy no plugin registers): no Retry-After promises it.
        retry = exc.retry_after if exc.status == 503 else None
        return GatewayError(exc.status, exc.message, retry_after=retry)
    if isinstance(exc, UpstreamError):
        return GatewayError(exc.status, exc.message, request_id=exc.request_id)
    return None
