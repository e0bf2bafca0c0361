"""The role gateway: one :class:`InferenceGatewayHandler` and one Starlette app per role.

The handler validates a request, lets the role's adapter shape it, and forwards it through the
same data path as the direct :class:`~relax_core.client.client.InferenceClient`
(:meth:`~relax_core.client.client.InferenceClient.open`): one resolver, one set of
strip/rewrite/header rules, one retry rule. Answers are relayed as bytes; server-sent events are
never re-parsed.

Error mapping (every error body is ``{"error": {"message", "type", "code"}}``):

- 400 bad JSON, bad payload, unknown model or route key (the message names the field);
- 401 missing or wrong bearer token (when the gateway has one); 413 body over the limit;
- 503 + ``Retry-After``: the model is not READY, nothing is routable, or the registry is
  unavailable (the gateway stays up; its ``/health`` says not ready);
- 502: the upstream could not be reached, failed mid-exchange, answered a 5xx or a body that
  is not JSON; 504: the request deadline passed, or a stream stayed silent past its idle limit.

A request that reached an engine is never replayed; a connection that could not be opened
(nothing sent) is retried once on a fresh snapshot (by the client's ``open``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import attrs
import orjson

from relax_core._http.upstream import UpstreamResponse, UpstreamUnreachableError
from relax_core.client.client import InferenceClient, SnapshotProvider
from relax_core.discovery.routing import RouteTarget
from relax_core.discovery.schema import ModelState, RoleSnapshot
from relax_core.errors import RequestNotReplayedError, RoutingError, UpstreamError
from relax_core.gateway.adapters import AdaptContext, Adapted, InvalidRequestError, RoleAdapter
from relax_core.gateway.metrics import GatewayMetrics

__all__ = [
    "DEADLINE_HEADER",
    "DEFAULT_MAX_BODY_BYTES",
    "GatewayAnswer",
    "GatewayError",
    "InferenceGatewayHandler",
    "adapter_for_role",
]

#: A caller may shorten (never lengthen) the gateway's deadline with this header (seconds).
DEADLINE_HEADER = "X-Relax-Timeout"
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
#: How long a relayed stream's bytes may be held back to be relayed together (see
#: :class:`InferenceGatewayHandler`'s ``stream_coalesce``).
DEFAULT_STREAM_COALESCE_S = 0.001

_JSON = b"application/json"
# Headers of an upstream answer the gateway sets itself (its server, or the request id).
_NOT_RELAYED = frozenset({b"date", b"server", b"x-request-id"})
_UPSTREAM_5XX_RELAYED = frozenset({503, 504})
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


class GatewayError(Exception):
    """An answer the gateway gives instead of forwarding: ``status`` and a JSON error body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after: float | None = None,
        field: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.retry_after = retry_after
        self.field = field
        self.request_id = request_id

    def answer(self) -> GatewayAnswer:
        """The JSON error answer."""
        error: dict[str, Any] = {
            "message": self.message,
            "type": _ERROR_TYPES.get(self.status, "error"),
            "code": self.status,
        }
        if self.field is not None:
            error["param"] = self.field
        headers = [(b"content-type", _JSON)]
        if self.retry_after is not None:
            headers.append((b"retry-after", str(max(1, round(self.retry_after))).encode()))
        if self.request_id is not None:
            headers.append((b"x-request-id", self.request_id.encode("latin-1", "replace")))
        if self.status == 401:
            headers.append((b"www-authenticate", b'Bearer realm="relax"'))
        return GatewayAnswer(self.status, headers, orjson.dumps({"error": error}))


@attrs.define
class GatewayAnswer:
    """What to send back: status, headers (ASGI byte pairs) and a body or an upstream stream.

    When ``stream`` is set the body comes from it, chunk by chunk, unchanged; the ASGI layer
    closes it whatever happens.
    """

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes = b""
    stream: UpstreamResponse | None = None


def adapter_for_role(plugin_manager: Any, role: str) -> RoleAdapter:
    """The gateway adapter the plugin of ``role`` registered (the pass-through one if none).

    :raises PluginError: no plugin registers ``role``.
    """
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


class InferenceGatewayHandler:
    """Request handling of one role's gateway (the Starlette app is a thin layer over it).

    Give exactly one of ``client`` (an :class:`InferenceClient` for the role, e.g. on a
    registry URL) and ``snapshot_provider`` (a callable returning the role's
    :class:`~relax_core.discovery.schema.RoleSnapshot`, e.g. a role service's ``snapshot``).
    ``adapter``: the role's :class:`RoleAdapter` (see :func:`adapter_for_role`).
    ``model_paths``: local checkpoint directory per model id (for tokenizers).
    ``timeout``: the deadline of one request in seconds. ``stream_idle_timeout``: the longest
    a relayed stream may stay silent once its first bytes arrived (default 60 s; ``None``: no
    limit); ``stream_first_chunk_timeout``: the same before the first bytes (default ``None``:
    only the deadline, since an engine sends its first event only after queueing and
    prefill). Past either, the caller gets an error event with code 504 and a truncated
    stream. ``stream_coalesce``: when a relayed stream's bytes arrive faster than one read per
    this many seconds (default 1 ms), they are read and relayed together once per period
    instead of one receive and one send per event (an event is then delayed by at most this
    much; a stream slower than that, as any real token stream is, is never delayed); ``0``
    relays every read at once. ``token``: a bearer token callers must send (``None``: no
    auth). ``max_body_bytes``: the request body limit.

    Belongs to one event loop (that of the server running it).
    """

    def __init__(
        self,
        role: str,
        *,
        client: InferenceClient | None = None,
        snapshot_provider: SnapshotProvider | None = None,
        adapter: RoleAdapter | None = None,
        model_paths: Mapping[str, str] | None = None,
        timeout: float = 300.0,
        token: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        snapshot_ttl: float = 0.5,
        stream_idle_timeout: float | None = 60.0,
        stream_first_chunk_timeout: float | None = None,
        stream_coalesce: float = DEFAULT_STREAM_COALESCE_S,
    ) -> None:
        if (client is None) == (snapshot_provider is None):
            raise ValueError(
                "InferenceGatewayHandler: give exactly one of client and snapshot_provider"
            )
        if not timeout > 0:
            raise ValueError(f"timeout={timeout!r}: give a positive number of seconds")
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes={max_body_bytes!r}: give a positive number of bytes")
        if token is not None and not token:
            raise ValueError("token: give a non-empty bearer token, or None for no auth")
        for name, value in (
            ("stream_idle_timeout", stream_idle_timeout),
            ("stream_first_chunk_timeout", stream_first_chunk_timeout),
        ):
            if value is not None and not 0 < value < float("inf"):
                raise ValueError(f"{name}={value!r}: give a positive number of seconds or None")
        if not 0.0 <= stream_coalesce <= 0.1:
            raise ValueError(
                f"stream_coalesce={stream_coalesce!r}: give seconds between 0 (relay every read "
                "at once) and 0.1"
            )
        self.role = role
        self.client = client or InferenceClient(
            snapshot_provider=snapshot_provider, role=role, ttl=snapshot_ttl, timeout=timeout
        )
        # Passed per request (math.inf: no limit), so a shared client's defaults do not apply.
        inf = float("inf")
        self.stream_idle_timeout = stream_idle_timeout
        self.stream_first_chunk_timeout = stream_first_chunk_timeout
        self.stream_coalesce = stream_coalesce
        self._idle = inf if stream_idle_timeout is None else stream_idle_timeout
        self._first = inf if stream_first_chunk_timeout is None else stream_first_chunk_timeout
        self.adapter = adapter or RoleAdapter()
        self.model_paths = dict(model_paths or {})
        self.timeout = timeout
        self.token = token
        self.max_body_bytes = max_body_bytes
        self.metrics = GatewayMetrics(role)
        # The context of a request before its model is known (frozen: shared by requests).
        self._plain_ctx, self._stream_ctx = (
            AdaptContext(
                role=role, model=None, model_path=None, served_model_name=None, stream=stream
            )
            for stream in (False, True)
        )

    # -- discovery views -------------------------------------------------------------------

    async def snapshot(self) -> RoleSnapshot:
        """The role's current snapshot (cached briefly). ``GatewayError(503)`` if unavailable."""
        try:
            return await self.client.snapshot()
        except RoutingError as exc:
            raise GatewayError(
                503, exc.message, retry_after=exc.retry_after or _DEFAULT_RETRY_AFTER
            ) from exc

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
        """``/health``: ``(status, body)``; 200 when some model is READY, else 503.

        Schema 2: role, readiness, registry reachability and every model's state. Schema 1 (the
        legacy genrm shape): ``status`` and counts of healthy engines.
        """
        try:
            snap = await self.client.snapshot()
        except RoutingError as exc:
            if schema == 1:
                return 503, {
                    "status": "unhealthy",
                    "healthy_engines": 0,
                    "total_engines": 0,
                    "message": exc.message,
                }
            return 503, {
                "role": self.role,
                "ready": False,
                "registry": "unavailable",
                "message": exc.message,
                "models": {},
            }
        ready = any(m.state is ModelState.READY for m in snap.models.values())
        if schema == 1:
            engines = [e for m in snap.models.values() for e in m.engines]
            healthy = sum(1 for e in engines if e.state.value == "READY")
            return (200 if ready else 503), {
                "status": "healthy" if ready else "unhealthy",
                "healthy_engines": healthy,
                "total_engines": len(engines),
            }
        models = {
            model_id: {
                "state": model.state.value,
                "route_mode": model.route_mode.value,
                "ready_engines": sum(1 for e in model.engines if e.state.value == "READY"),
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
        if not ready:
            body["message"] = "no model of this role is READY; wait, or check `relax status`"
        return (200 if ready else 503), body

    # -- forwarding ------------------------------------------------------------------------

    def check_token(self, authorization: str | None) -> None:
        """Raise ``GatewayError(401)`` unless ``authorization`` carries the gateway's token."""
        if self.token is None:
            return
        import hmac

        expected = f"Bearer {self.token}"
        if authorization is None or not hmac.compare_digest(
            authorization.encode(), expected.encode()
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
            return self.timeout
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
        return min(value, self.timeout)

    async def generate(self, body: bytes, headers: Mapping[str, str]) -> GatewayAnswer:
        """``POST /{role}/generate``: validate, adapt, forward to the engine's ``/generate``."""
        payload = self.adapter.check_generate(_decode(body))
        stream = payload.get("stream") is True
        model = payload.get("model")
        ctx = self._stream_ctx if stream else self._plain_ctx
        target: RouteTarget | None = None
        if self.adapter.needs_model(payload):
            # One routing decision per request: the target chosen here is the one sent to.
            target = await self.client.resolve(
                model=model,
                route_key=payload.get("route_key"),
                affinity_key=headers.get("x-smg-routing-key"),
            )
            ctx = attrs.evolve(
                ctx,
                model=target.model_id,
                model_path=self.model_paths.get(target.model_id),
                served_model_name=target.served_model_name,
            )
        adapted = self.adapter.adapt_generate(payload, ctx)
        forwarded: dict[str, Any] | bytes = body if adapted.payload is None else adapted.payload
        return await self._forward(
            "/generate",
            forwarded,
            headers,
            model=model,
            route_key=payload.get("route_key"),
            stream=stream,
            adapted=adapted,
            target=target,
        )

    async def chat(self, body: bytes, headers: Mapping[str, str]) -> GatewayAnswer:
        """``POST /{role}/chat/completions``: validate, forward to ``/v1/chat/completions``."""
        payload = self.adapter.check_chat(_decode(body))
        return await self._forward(
            "/v1/chat/completions",
            body,
            headers,
            model=payload.get("model"),
            route_key=payload.get("route_key"),
            stream=payload.get("stream") is True,
            adapted=None,
        )

    async def _forward(
        self,
        path: str,
        payload: dict[str, Any] | bytes,
        headers: Mapping[str, str],
        *,
        model: str | None,
        route_key: str | None,
        stream: bool,
        adapted: Adapted | None,
        target: RouteTarget | None = None,
    ) -> GatewayAnswer:
        timeout = self.deadline(headers)
        fwd = {k: v for k, v in headers.items() if k != "authorization"} if self.token else headers
        try:
            resp = await self.client.open(
                path,
                payload,
                model=model,
                route_key=route_key,
                headers=fwd,
                target=target,
                timeout=timeout,
                stream_idle_timeout=self._idle,
                stream_first_chunk_timeout=self._first,
            )
        except UpstreamError as exc:
            raise _error_for_upstream(exc, self.metrics) from exc
        try:
            return await self._answer(resp, stream=stream, adapted=adapted)
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
        try:
            body = await resp.read()
        except UpstreamError as exc:
            raise _error_for_upstream(exc, self.metrics) from exc
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

    async def _upstream_error_answer(self, resp: UpstreamResponse) -> GatewayAnswer:
        rid = resp.request_id
        try:
            body = await resp.read()
        except UpstreamError as exc:
            raise _error_for_upstream(exc, self.metrics) from exc
        snippet = body[:300].decode("utf-8", "replace")
        status = resp.status
        if status < 500:
            try:
                orjson.loads(body)
            except orjson.JSONDecodeError:
                raise GatewayError(
                    status,
                    f"the engine rejected the request ({status}): {snippet}",
                    request_id=rid,
                ) from None
            return GatewayAnswer(
                status,
                [(b"content-type", _JSON), (b"x-request-id", rid.encode("latin-1", "replace"))],
                body,
            )
        self.metrics.upstream_error("status")
        if status in _UPSTREAM_5XX_RELAYED:
            from relax_core._http.upstream import parse_retry_after

            retry = parse_retry_after(resp.headers.get("Retry-After"))
            what = (
                "the engine is not accepting requests now (draining or asleep); try again later"
                if status == 503
                else "the engine's own deadline passed"
            )
            raise GatewayError(
                status,
                f"{what}: {snippet}",
                request_id=rid,
                retry_after=(retry or _DEFAULT_RETRY_AFTER) if status == 503 else None,
            )
        raise GatewayError(
            502,
            f"the engine at {resp.prepared.url} failed with {status}: {snippet}; check its log",
            request_id=rid,
        )


def _decode(body: bytes) -> Any:
    if not body:
        raise InvalidRequestError("the request body is empty; send a JSON object")
    try:
        return orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequestError(f"the request body is not valid JSON: {exc}") from None


def gateway_error(exc: BaseException) -> GatewayError | None:
    """The :class:`GatewayError` for an exception the handler raises, or ``None`` if unknown."""
    if isinstance(exc, GatewayError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return GatewayError(400, exc.message, field=exc.field)
    if isinstance(exc, RoutingError):
        retry = exc.retry_after if exc.status == 503 else None
        if exc.status == 503 and retry is None:
            retry = _DEFAULT_RETRY_AFTER
        return GatewayError(exc.status, exc.message, retry_after=retry)
    if isinstance(exc, RequestNotReplayedError | UpstreamError):
        return GatewayError(exc.status, exc.message, request_id=exc.request_id)
    return None


Endpoint = Callable[[bytes, Mapping[str, str]], Awaitable[GatewayAnswer]]
