"""The discovery-aware inference client: schema-2 snapshot → route → one HTTP exchange
(the contract: docs/client.md)."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Coroutine, Mapping
from typing import Any, TypedDict, TypeVar, Unpack

import aiohttp
import orjson

from relax_core._http.failures import FailureClass, failure_class
from relax_core._http.headers import (
    NOT_SENT_HEADER,
    REQUEST_ID_HEADER,
    ROUTING_KEY_HEADER,
    caller_headers,
)
from relax_core._http.request import MIN_WEIGHT_VERSION_FIELD, decode_json_body, weight_version
from relax_core._http.transport import Transport
from relax_core._http.upstream import PreparedRequest, UpstreamResponse, decode_answer, status_error
from relax_core.client.breaker import BreakerSettings, ReplicaBreakers
from relax_core.client.cache import SnapshotCache, SnapshotProvider
from relax_core.discovery.routing import RouteResolver, RouteTarget, weight_version_at_least
from relax_core.discovery.schema import RoleSnapshot, WeightSources
from relax_core.errors import (
    InvalidRequestError,
    RequestNotReplayedError,
    RoutingError,
    UpstreamUnreachableError,
)
from relax_core.plugins import PluginManager
from relax_core.records import RouteMode

#: Paths whose payload is SGLang's native one: the logical ``model``/``route_key`` are dropped.
GENERATE_PATHS = frozenset({"/generate"})
#: OpenAI-style paths: ``model`` becomes the backend's served model name.
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/chat/completions", "/v1/completions"})
_UPSTREAM_UNAVAILABLE = frozenset({502, 503, 504})
#: Body fields the client uses and never forwards to an engine's native or OpenAI paths.
_ROUTING_FIELDS = ("model", "route_key", "min_weight_version")
T = TypeVar("T")


class TransportOptions(TypedDict, total=False):
    """The connection settings of :class:`InferenceClient`: those of
    :class:`~relax_core._http.transport.Transport` (see it for the defaults)."""

    timeout: float | None
    connect_timeout: float
    max_connections: int
    stream_idle_timeout: float | None
    stream_first_chunk_timeout: float | None
    session: aiohttp.ClientSession | None


class RouteOptions(TypedDict, total=False):
    """The routing keyword arguments of :meth:`InferenceClient.prepare`, taken by every sender."""

    model: str | None
    route_key: str | None
    affinity_key: str | None
    request_id: str | None
    headers: Mapping[str, str] | None
    target: RouteTarget | None
    min_weight_version: str | None
    avoid: Collection[str] | None


class PostOptions(RouteOptions, total=False):
    """:class:`RouteOptions` and the request's deadline (``post``, ``generate``, ``chat``)."""

    timeout: float | None


class OpenOptions(PostOptions, total=False):
    """:class:`PostOptions` and the stream idle limits (``open``, ``stream``; see ``send``)."""

    stream_idle_timeout: float | None
    stream_first_chunk_timeout: float | None


class InferenceClient:
    """Routes requests for one role to its engines, using the role's schema-2 snapshot.

    Give exactly one of ``base_url`` (serving ``/engines?schema=2``) and ``snapshot_provider``;
    ``ttl``: seconds a snapshot is reused; ``transport``: :class:`TransportOptions`;
    ``plugin_manager``: where routing policies and weight sources come from; ``breaker``: the
    DIRECT heads' circuit breakers (``None``: none). Belongs to the event loop it is first used
    on; close it with :meth:`aclose` or ``async with`` (or share one: ``get_client``)."""

    def __init__(
        self,
        base_url: str | None = None,
        *,
        snapshot_provider: SnapshotProvider | None = None,
        role: str | None = None,
        ttl: float = 1.0,
        discovery_timeout: float = 10.0,
        plugin_manager: PluginManager | None = None,
        weight_sources: WeightSources | None = None,
        breaker: BreakerSettings | None = BreakerSettings(),
        sleeping_note: str | None = None,
        **transport: Unpack[TransportOptions],
    ) -> None:
        if (base_url is None) == (snapshot_provider is None):
            raise ValueError("InferenceClient: give exactly one of base_url and snapshot_provider")
        if base_url is not None and not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url={base_url!r}: give an http:// or https:// URL")
        if not ttl >= 0:
            raise ValueError(f"ttl={ttl!r}: give a number of seconds >= 0")
        if not discovery_timeout > 0:
            raise ValueError(f"discovery_timeout={discovery_timeout!r}: give a positive number")
        self.base_url = base_url.rstrip("/") if base_url is not None else None
        self.role = role
        self._transport = Transport(**transport)
        self._cache = SnapshotCache(
            self.base_url,
            snapshot_provider,
            role=role,
            ttl=ttl,
            discovery_timeout=discovery_timeout,
            transport=self._transport,
            weight_sources=weight_sources if weight_sources is not None else plugin_manager,
        )
        self._resolver = RouteResolver(plugin_manager, sleeping_note=sleeping_note)
        self._breakers: ReplicaBreakers | None = None
        if breaker is not None:
            self._breakers = ReplicaBreakers(breaker, self._probe, published=self._published)
        #: Upstream failures of this client's requests, by class (``FailureClass`` values).
        self.failure_counts: dict[str, int] = dict.fromkeys(FailureClass, 0)
        self._inflight: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._id_prefix = os.urandom(6).hex() + "-"
        self._closed = False

    @property
    def inflight(self) -> Mapping[str, int]:
        """Requests of this client now in flight, per engine id (DIRECT targets only)."""
        return self._inflight

    @property
    def breakers(self) -> ReplicaBreakers | None:
        """The circuit breakers of this client's DIRECT heads (``None`` when disabled)."""
        return self._breakers

    async def _probe(self, url: str, timeout: float) -> int:
        status, _ = await self._transport.get_json(url, timeout=timeout)
        return status

    def _published(self, url: str) -> bool:
        snap = self._cache.latest
        return snap is None or any(
            e.base_url == url for m in snap.models.values() for e in m.engines
        )

    def _failed(self, error: BaseException, target: RouteTarget | None) -> None:
        kind = failure_class(error)
        if kind is None:
            return
        self.failure_counts[kind] += 1
        if (
            kind is FailureClass.CONNECT
            and self._breakers is not None
            and target is not None
            and target.route_mode is RouteMode.DIRECT
        ):
            self._breakers.connect_failed(target.url)

    def _not_sent(self, prepared: PreparedRequest) -> UpstreamUnreachableError:
        target = prepared.target
        engine = f" ({target.engine_id})" if target is not None and target.engine_id else ""
        error = UpstreamUnreachableError(
            502,
            f"the replica at {_base(prepared)}{engine} could not reach its engine; nothing was "
            "sent",
            request_id=prepared.request_id,
        )
        self._failed(error, target)
        return error

    def _response_failed(self, error: BaseException) -> None:
        self._cache.invalidate()
        if isinstance(error, RequestNotReplayedError):
            self._failed(error, None)

    def snapshot(self, force: bool = False) -> Awaitable[RoleSnapshot]:
        """The role's snapshot: the cached one while fresh, else (or with ``force``) a new one.
        Raises ``RoutingError(503)`` when the registry cannot be reached or answers badly."""
        return self._cache.snapshot(force)

    def invalidate(self) -> None:
        """Forget the cached snapshot: the next request fetches a fresh one."""
        self._cache.invalidate()

    async def recheck(
        self,
        target: RouteTarget,
        *,
        affinity_key: str | None = None,
        min_weight_version: str | None = None,
    ) -> RouteTarget:
        """``target`` if the current snapshot still routes to it (its model, and a DIRECT head at
        the same URL and generation, READY and serving ``min_weight_version``), else a new
        decision for its model.

        :raises RoutingError: 503 when the model can no longer be served (see :meth:`resolve`)."""
        model = (await self._cache.snapshot()).models.get(target.model_id)
        if model is not None and model.state.value == "READY":
            if target.route_mode is RouteMode.SGLANG_ROUTER:
                if model.router_url == target.url and min_weight_version is None:
                    return target
            elif min_weight_version is None or weight_version_at_least(
                target.weight_version, min_weight_version
            ):
                for e in model.engines:
                    if (
                        (e.engine_id, e.base_url, e.generation)
                        == (target.engine_id, target.url, target.generation)
                        and e.direct_eligible
                        and e.state.value == "READY"
                    ):
                        return target
        return await self.resolve(
            model=target.model_id, affinity_key=affinity_key, min_weight_version=min_weight_version
        )

    async def resolve(
        self,
        *,
        model: str | None = None,
        route_key: str | None = None,
        affinity_key: str | None = None,
        min_weight_version: str | None = None,
        avoid: Collection[str] | None = None,
    ) -> RouteTarget:
        """Where a request would go now (round-robin advances). ``avoid``: base URLs left out
        unless no other head is eligible (as are open breakers'). A 503 gets one snapshot refresh
        and one retry. Raises ``RoutingError`` (400: unknown model or route key; 503)."""
        cache = self._cache
        snap = cache.fresh() or await cache.snapshot()
        seen = cache.fetches
        breakers = self._breakers
        if breakers is not None and breakers.open_urls:
            avoid = breakers.open_urls | frozenset(avoid or ())
        resolve = functools.partial(
            self._resolver.resolve,
            model=model,
            route_key=route_key,
            affinity_key=affinity_key,
            inflight=self._inflight,
            min_weight_version=min_weight_version,
            avoid=avoid,
        )
        try:
            return resolve(snap)
        except RoutingError as exc:
            if exc.status != 503:
                raise
        return resolve(await cache.refetch(seen))

    async def prepare(
        self,
        path: str,
        payload: Mapping[str, Any] | bytes,
        *,
        model: str | None = None,
        route_key: str | None = None,
        affinity_key: str | None = None,
        request_id: str | None = None,
        headers: Mapping[str, str] | None = None,
        target: RouteTarget | None = None,
        min_weight_version: str | None = None,
        avoid: Collection[str] | None = None,
    ) -> PreparedRequest:
        """Resolve and build the request to send: URL, headers and body bytes. Nothing is sent.

        ``payload``: a JSON object, as a mapping or its encoded bytes (sent as they are when no
        field must change); ``model``/``route_key`` default to its fields. ``headers``: a
        gateway caller's headers (hop-by-hop dropped; ``X-Request-ID`` and ``X-SMG-Routing-Key``
        stand in for ``request_id``/``affinity_key``). ``target``: a :meth:`resolve` decision,
        used as it is. ``min_weight_version`` defaults to the payload's field, then the
        ``X-Relax-Min-Weight-Version`` header. Raises ``InvalidRequestError`` (400: not a JSON
        object, or a routing field not a string) and ``RoutingError`` (see :meth:`resolve`)."""
        body, raw = _json_object(payload)
        caller_min = None
        if headers:
            out, caller_rid, caller_key, caller_min = caller_headers(headers)
            request_id = caller_rid if request_id is None else request_id
            affinity_key = caller_key if affinity_key is None else affinity_key
        else:
            out = {}
        out["Content-Type"] = "application/json"
        if request_id is None:
            request_id = self._id_prefix + str(next(self._ids))
        out[REQUEST_ID_HEADER] = request_id
        if affinity_key is not None:
            out[ROUTING_KEY_HEADER] = affinity_key
        if min_weight_version is None:
            min_weight_version = weight_version(body, caller_min)
        if target is None:
            target = await self.resolve(
                model=_string_field(body, "model") if model is None else model,
                route_key=_string_field(body, "route_key") if route_key is None else route_key,
                affinity_key=affinity_key,
                min_weight_version=min_weight_version,
                avoid=avoid,
            )
        raw = _body_for(path, body, raw, target.served_model_name)
        # tuple.__new__ skips the named tuple's Python-level __new__ (hot path).
        return tuple.__new__(
            PreparedRequest, (target.url.rstrip("/") + path, raw, out, request_id, target, "POST")
        )

    def _track(self, prepared: PreparedRequest) -> str | None:
        engine_id = None if prepared.target is None else prepared.target.engine_id
        if engine_id is not None:
            self._inflight[engine_id] = self._inflight.get(engine_id, 0) + 1
        return engine_id

    def _untrack(self, engine_id: str | None) -> None:
        if engine_id is not None:
            left = self._inflight.get(engine_id, 1) - 1
            if left > 0:
                self._inflight[engine_id] = left
            else:
                self._inflight.pop(engine_id, None)

    async def send(
        self,
        prepared: PreparedRequest,
        *,
        timeout: float | None = None,
        stream_idle_timeout: float | None = None,
        stream_first_chunk_timeout: float | None = None,
    ) -> UpstreamResponse:
        """Send a prepared request once; the response (unread, unchecked: close it) once its
        headers arrived. Raises ``UpstreamUnreachableError`` (nothing sent) or
        ``RequestNotReplayedError`` (sent, failed). Idle limits: ``None`` the client's,
        ``math.inf`` none."""
        transport = self._transport
        idle = _limit(stream_idle_timeout, transport.stream_idle_timeout)
        first = _limit(stream_first_chunk_timeout, transport.stream_first_chunk_timeout)
        engine_id = self._track(prepared)
        try:
            resp = await transport.open(prepared, timeout)
        except BaseException as exc:
            self._untrack(engine_id)
            self._cache.invalidate()
            self._failed(exc, prepared.target)
            raise
        if not self._answered(prepared, engine_id, resp.status, resp.headers):
            resp.close()
            self._untrack(engine_id)
            raise self._not_sent(prepared)
        return UpstreamResponse(
            resp,
            prepared,
            on_close=lambda: self._untrack(engine_id),
            on_failure=self._response_failed,
            idle_timeout=idle,
            first_chunk_timeout=first,
        )

    async def _exchange(
        self, prepared: PreparedRequest, timeout: float | None
    ) -> tuple[int, Mapping[str, str], bytes, PreparedRequest]:
        engine_id = self._track(prepared)
        try:
            status, headers, body = await self._transport.exchange(prepared, timeout)
        except BaseException as exc:  # a failure or cancellation: the request is never replayed
            self._cache.invalidate()
            self._failed(exc, prepared.target)
            raise
        finally:
            self._untrack(engine_id)
        if not self._answered(prepared, engine_id, status, headers):
            raise self._not_sent(prepared)
        return status, headers, body, prepared

    def _answered(
        self, prepared: PreparedRequest, engine_id: str | None, status: int, headers: Any
    ) -> bool:
        """``False`` for an admission server's "nothing sent" 502, else the head was reached."""
        if status in _UPSTREAM_UNAVAILABLE:
            self._cache.invalidate()
            if status == 502 and headers.get(NOT_SENT_HEADER):
                return False
        if engine_id is not None and self._breakers is not None:
            self._breakers.reached(_base(prepared))
        return True

    async def _routed(
        self,
        attempt: Callable[[PreparedRequest], Awaitable[T]],
        path: str,
        payload: Mapping[str, Any] | bytes,
        routing: RouteOptions,
    ) -> T:
        """Prepare and ``attempt`` with the one safe retry (see :meth:`open`); a caller-chosen
        ``target`` keeps its model on the retry."""
        prepared = await self.prepare(path, payload, **routing)
        try:
            return await attempt(prepared)
        except UpstreamUnreachableError:
            again: RouteOptions = {**routing, "request_id": prepared.request_id, "target": None}
            failed = prepared.target
            if failed is not None and failed.route_mode is RouteMode.DIRECT:
                again["avoid"] = frozenset(routing.get("avoid") or ()) | {failed.url}
            target = routing.get("target")
            if target is not None:
                again["model"], again["route_key"] = target.model_id, None
            prepared = await self.prepare(path, payload, **again)
            return await attempt(prepared)

    def open(
        self, path: str, payload: Mapping[str, Any] | bytes, **options: Unpack[OpenOptions]
    ) -> Coroutine[Any, Any, UpstreamResponse]:
        """:meth:`prepare` then :meth:`send`, with the one safe retry (nothing sent: routed again
        on a fresh snapshot, avoiding the failed head, same request id); the raw response (close
        it). Raises ``RoutingError`` before sending, ``UpstreamUnreachableError`` when the retry
        could not connect either, ``RequestNotReplayedError`` after sending."""
        attempt = functools.partial(
            self.send,
            timeout=options.pop("timeout", None),
            stream_idle_timeout=options.pop("stream_idle_timeout", None),
            stream_first_chunk_timeout=options.pop("stream_first_chunk_timeout", None),
        )
        return self._routed(attempt, path, payload, options)

    async def post(
        self, path: str, payload: Mapping[str, Any] | bytes, **options: Unpack[PostOptions]
    ) -> Any:
        """POST ``payload`` to ``path`` on the resolved target; the decoded JSON answer. Raises
        as :meth:`open`, plus ``UpstreamStatusError`` for a 4xx/5xx answer and
        ``UpstreamError(502)`` for a 2xx body that is not JSON."""
        attempt = functools.partial(self._exchange, timeout=options.pop("timeout", None))
        status, headers, body, prepared = await self._routed(attempt, path, payload, options)
        if status >= 400:
            raise status_error(status, body, headers, prepared)
        return decode_answer(body, prepared, f"answered {status} with a body")

    def generate(
        self, payload: Mapping[str, Any] | bytes, **options: Unpack[PostOptions]
    ) -> Coroutine[Any, Any, Any]:
        """POST an SGLang ``/generate`` payload (``model``, ``route_key`` dropped); see ``post``."""
        return self.post("/generate", payload, **options)

    def chat(
        self, payload: Mapping[str, Any] | bytes, **options: Unpack[PostOptions]
    ) -> Coroutine[Any, Any, Any]:
        """POST an OpenAI chat payload to ``/v1/chat/completions`` (``model`` → served name)."""
        return self.post("/v1/chat/completions", payload, **options)

    @contextlib.asynccontextmanager
    async def stream(
        self, path: str, payload: Mapping[str, Any] | bytes, **options: Unpack[OpenOptions]
    ) -> AsyncIterator[UpstreamResponse]:
        """POST and yield the response unread, for streaming; ``options`` as :meth:`open`. An
        error status raises ``UpstreamStatusError`` before the block runs; the deadline covers
        the whole stream; a failure mid-stream (a stall: 504) raises ``RequestNotReplayedError``."""
        async with await self.open(path, payload, **options) as resp:
            if resp.status >= 400:
                resp.raise_for_status(await resp.read())
            yield resp

    async def aclose(self) -> None:
        """Close the session the client created and stop its breakers' probes (idempotent)."""
        self._closed = True
        if self._breakers is not None:
            await self._breakers.aclose()
        await self._transport.aclose()

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    async def __aenter__(self) -> InferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        cache = self._cache
        return f"InferenceClient({cache.source}, role={self.role!r}, ttl={cache.ttl})"


def _limit(value: float | None, default: float | None) -> float | None:
    """A per-call idle limit: ``None`` takes ``default``, ``math.inf`` means none."""
    if value is None:
        return default
    if not value > 0:
        raise ValueError(f"idle timeout {value!r}: give a positive number of seconds or math.inf")
    return None if value == math.inf else value


def _json_object(payload: object) -> tuple[dict[str, Any], bytes | None]:
    """``(body, raw)``: the payload as a dict, and its bytes when it came encoded."""
    if type(payload) is dict:
        return payload, None
    if isinstance(payload, bytes | bytearray | memoryview):
        raw = bytes(payload)
        payload = decode_json_body(raw)
        if type(payload) is dict:
            return payload, raw
    elif isinstance(payload, Mapping):
        return dict(payload), None
    raise InvalidRequestError(
        f"the request body must be a JSON object, got {type(payload).__name__}"
    )


def _base(prepared: PreparedRequest) -> str:
    """The base URL of the head a DIRECT request went to (what its breaker is keyed by)."""
    target = prepared.target
    return target.url if target is not None else prepared.url


def _string_field(body: Mapping[str, Any], name: str) -> str | None:
    value = body.get(name)
    if value is not None and type(value) is not str:
        raise InvalidRequestError(
            f"request field {name!r} must be a string, got {type(value).__name__}", field=name
        )
    return value


def _body_for(path: str, body: dict[str, Any], raw: bytes | None, served: str) -> bytes:
    """The bytes sent to ``path``: ``raw`` when no field changes, else ``body`` without the
    ``_ROUTING_FIELDS`` (an OpenAI path's ``model`` becomes ``served``)."""
    if path in GENERATE_PATHS:
        if "model" in body or "route_key" in body or MIN_WEIGHT_VERSION_FIELD in body:
            body = {k: v for k, v in body.items() if k not in _ROUTING_FIELDS}
            raw = None
    elif path in OPENAI_PATHS and (
        body.get("model") != served or "route_key" in body or MIN_WEIGHT_VERSION_FIELD in body
    ):
        body = {k: v for k, v in body.items() if k != "route_key" and k != MIN_WEIGHT_VERSION_FIELD}
        body["model"] = served
        raw = None
    if raw is not None:
        return raw
    try:
        return orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY)
    except TypeError as exc:
        raise InvalidRequestError(f"the request body cannot be encoded as JSON: {exc}") from None
