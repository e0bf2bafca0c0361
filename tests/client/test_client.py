"""InferenceClient against real uvicorn servers on loopback: discovery, routing, no replay.

Every upstream here is a real HTTP server (uvicorn via ``serve_app``, or, for a connection that
closes after the request arrived, a real TCP server that closes its socket); each counts what it
received, so "never replayed" and "nothing sent" are checked on the server side.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from relax_core._http.headers import forward_headers
from relax_core.client.client import InferenceClient
from relax_core.client.pool import close_clients, get_client
from relax_core.discovery.schema import RoleSnapshot
from relax_core.errors import (
    InvalidRequestError,
    RequestNotReplayedError,
    RoutingError,
    UpstreamStatusError,
)
from relax_core.testing import free_port, serve_app

MODEL = "math"
SERVED = "Qwen/Qwen3-0.6B"


def snapshot(
    urls: list[str],
    *,
    state: str = "READY",
    role: str = "teacher",
    aliases: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A schema-2 snapshot dict of one DIRECT model with one replica per URL."""
    return {
        "schema_version": 2,
        "role": role,
        "registry_epoch": "test",
        "topology_revision": 1,
        "routing": {
            "default_model": MODEL,
            "route_key_map": {"math-data": MODEL},
            "aliases": aliases or {},
            "policy": "round_robin",
            "policy_revision": 0,
        },
        "models": {
            MODEL: {
                "state": state,
                "route_mode": "DIRECT",
                "router_url": None,
                "weight_source": "STATIC",
                "weight_version": None,
                "served_model_name": SERVED,
                "engines": [
                    {
                        "engine_id": f"{MODEL}/replica-{i}",
                        "base_url": url,
                        "state": "READY" if state == "READY" else "SLEEPING",
                        "direct_eligible": state == "READY",
                        "generation": 1,
                    }
                    for i, url in enumerate(urls)
                ],
            }
        },
    }


class Engine:
    """A recording engine: answers JSON, or follows ``mode`` (slow, status, truncate, sse)."""

    def __init__(self) -> None:
        self.requests: list[dict[str, Any]] = []
        self.mode = "ok"
        self.release = threading.Event()
        self.lock = threading.Lock()
        routes = [
            Route(p, self.handle, methods=["POST"])
            for p in ("/generate", "/v1/chat/completions", "/abort_request")
        ]
        self.app = Starlette(routes=routes)

    @property
    def count(self) -> int:
        with self.lock:
            return len(self.requests)

    async def handle(self, request: Request) -> Response:
        raw = await request.body()
        with self.lock:
            self.requests.append(
                {"path": request.url.path, "headers": dict(request.headers), "raw": raw}
            )
        mode = self.mode
        if mode == "slow":
            deadline = time.monotonic() + 10
            while not self.release.is_set() and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
        if mode.startswith("status:"):
            code = int(mode[7:])
            headers = {"Retry-After": "7"} if code == 503 else {}
            return JSONResponse({"error": f"engine says {code}"}, status_code=code, headers=headers)
        if mode == "truncate":
            return StreamingResponse(
                _truncated(), media_type="application/json", headers={"Content-Length": "500"}
            )
        if mode == "sse":
            return StreamingResponse(_events(), media_type="text/event-stream")
        return JSONResponse({"text": "ok", "meta_info": {"id": "x"}})


async def _truncated() -> Iterator[bytes]:  # type: ignore[misc]
    yield b'{"text": "partial'
    raise RuntimeError("engine died mid-answer (test fault)")


async def _events() -> Iterator[bytes]:  # type: ignore[misc]
    for i in range(3):
        yield f'data: {{"text": "t{i}"}}\n\n'.encode()
        await asyncio.sleep(0.01)
    yield b"data: [DONE]\n\n"


@pytest.fixture
def engine() -> Iterator[tuple[Engine, str]]:
    eng = Engine()
    with serve_app(eng.app) as url:
        try:
            yield eng, url
        finally:
            eng.release.set()


class Provider:
    """A snapshot provider that counts calls and serves ``snapshots`` in turn (last repeats)."""

    def __init__(self, *snapshots: dict[str, Any]) -> None:
        self.snapshots = list(snapshots)
        self.calls = 0

    def __call__(self) -> dict[str, Any]:
        self.calls += 1
        return self.snapshots[min(self.calls, len(self.snapshots)) - 1]


def run(coro_fn: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(coro_fn())  # type: ignore[arg-type]


class ClosingServer:
    """A real TCP server that reads one full HTTP request, counts it and closes the socket."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.received = 0
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(5)
                data = b""
                while b"\r\n\r\n" not in data:
                    data += conn.recv(65536)
                head, _, body = data.partition(b"\r\n\r\n")
                length = int(
                    next(
                        line.split(b":")[1]
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    )
                )
                while len(body) < length:
                    body += conn.recv(65536)
                self.received += 1

    def close(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)
        self.sock.close()


@pytest.fixture
def closing_server() -> Iterator[ClosingServer]:
    server = ClosingServer()
    try:
        yield server
    finally:
        server.close()


# -- discovery -------------------------------------------------------------------------------


def test_discovery_reads_engines_schema2_and_caches_it_for_ttl(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    fetches: list[str] = []

    async def engines(request: Request) -> Response:
        fetches.append(request.url.query)
        return JSONResponse(snapshot([url]))

    registry = Starlette(routes=[Route("/teacher/engines", engines)])
    with serve_app(registry) as base:

        async def scenario() -> None:
            async with InferenceClient(f"{base}/teacher", role="teacher", ttl=60) as client:
                for _ in range(3):
                    assert await client.generate({"text": "hi"}) == {
                        "text": "ok",
                        "meta_info": {"id": "x"},
                    }

        run(scenario)
    assert fetches == ["schema=2"]
    assert eng.count == 3


def test_snapshot_is_fetched_again_once_ttl_expires(engine: tuple[Engine, str]) -> None:
    _, url = engine
    provider = Provider(snapshot([url]))

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=0) as client:
            await client.generate({"text": "a"})
            await client.generate({"text": "b"})

    run(scenario)
    assert provider.calls == 2


def test_async_provider_may_return_a_role_snapshot(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    snap = RoleSnapshot.from_json(snapshot([url]))

    async def provide() -> RoleSnapshot:
        await asyncio.sleep(0)
        return snap

    async def scenario() -> RoleSnapshot:
        async with InferenceClient(snapshot_provider=provide) as client:
            await client.generate({"text": "a"})
            return await client.snapshot()

    assert run(scenario) is snap
    assert eng.count == 1


def test_concurrent_requests_share_one_discovery_fetch(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    calls = 0

    async def provide() -> dict[str, Any]:
        nonlocal calls
        calls += 1
        await asyncio.sleep(0.05)  # a slow registry: every request arrives while it answers
        return snapshot([url])

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provide, ttl=60) as client:
            await asyncio.gather(*(client.generate({"text": str(i)}) for i in range(20)))

    run(scenario)
    assert calls == 1
    assert eng.count == 20


def test_unreachable_registry_is_503_registry_unavailable() -> None:
    base = f"http://127.0.0.1:{free_port()}"

    async def scenario() -> None:
        async with InferenceClient(base) as client:
            await client.generate({"text": "a"})

    with pytest.raises(RoutingError) as info:
        run(scenario)
    assert info.value.status == 503
    assert "registry unavailable" in info.value.message
    assert f"{base}/engines?schema=2" in info.value.message
    assert info.value.retry_after is not None


def test_invalid_snapshot_is_503_naming_the_bad_field(engine: tuple[Engine, str]) -> None:
    _, url = engine
    bad = snapshot([url])
    bad["models"][MODEL]["engines"][0]["base_url"] = "not-a-url"

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: bad) as client:
            await client.generate({"text": "a"})

    with pytest.raises(RoutingError) as info:
        run(scenario)
    assert info.value.status == 503
    assert "models.math.engines[0].base_url" in info.value.message


def test_weight_sources_of_plugins_are_accepted_only_when_known(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    snap = snapshot([url], role="rollout")
    snap["models"][MODEL]["weight_source"] = "CUSTOM_STORE"

    async def scenario(**kwargs: Any) -> None:
        async with InferenceClient(snapshot_provider=lambda: snap, **kwargs) as client:
            await client.generate({"text": "a"})

    with pytest.raises(RoutingError) as info:
        asyncio.run(scenario())
    assert info.value.status == 503
    assert "models.math.weight_source" in info.value.message
    asyncio.run(scenario(weight_sources={"STATIC", "ACTOR", "CUSTOM_STORE"}))
    assert eng.count == 1


def test_snapshot_of_another_role_is_rejected(engine: tuple[Engine, str]) -> None:
    eng, url = engine

    async def scenario() -> None:
        provider = Provider(snapshot([url], role="genrm"))
        async with InferenceClient(snapshot_provider=provider, role="teacher") as client:
            await client.generate({"text": "a"})

    with pytest.raises(RoutingError, match="serves role 'genrm'"):
        run(scenario)
    assert eng.count == 0


# -- resolution ------------------------------------------------------------------------------


def test_resolution_503_refreshes_once_and_retries_before_sending(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    provider = Provider(snapshot([url], state="SLEEPING"), snapshot([url]))

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            await client.generate({"text": "a"})

    run(scenario)
    assert provider.calls == 2
    assert eng.count == 1


def test_model_still_not_ready_after_refresh_is_503_with_retry_after_and_nothing_sent(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    provider = Provider(snapshot([url], state="SLEEPING"))

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            await client.generate({"text": "a"})

    with pytest.raises(RoutingError) as info:
        run(scenario)
    assert info.value.status == 503
    assert info.value.retry_after is not None
    assert provider.calls == 2
    assert eng.count == 0


def test_unknown_model_is_400_without_refresh_or_request(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    provider = Provider(snapshot([url]))

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            await client.generate({"text": "a", "model": "no-such-model"})

    with pytest.raises(RoutingError) as info:
        run(scenario)
    assert info.value.status == 400
    assert provider.calls == 1
    assert eng.count == 0


def test_non_object_payload_is_400(engine: tuple[Engine, str]) -> None:
    eng, url = engine

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            await client.generate(b"[1, 2]")

    with pytest.raises(RoutingError) as info:
        run(scenario)
    assert info.value.status == 400
    assert isinstance(info.value, InvalidRequestError)
    assert eng.count == 0


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b"{not json", "the request body is not valid JSON: "),
        (b"", "the request body is empty; send a JSON object"),
        ({"text": "a", "model": 7}, "request field 'model' must be a string, got int"),
    ],
)
def test_bad_body_is_the_400_invalid_request_error_a_gateway_answers_with(
    engine: tuple[Engine, str], body: Any, needle: str
) -> None:
    eng, url = engine

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            await client.generate(body)

    with pytest.raises(InvalidRequestError) as info:
        run(scenario)
    assert info.value.status == 400 and info.value.message.startswith(needle)
    assert info.value.field == ("model" if isinstance(body, dict) else None)
    assert eng.count == 0


def test_unopenable_connection_refreshes_and_retries_on_the_new_snapshot(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    dead = f"http://127.0.0.1:{free_port()}"
    provider = Provider(snapshot([dead]), snapshot([url]))

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            await client.generate({"text": "a"})

    run(scenario)
    assert provider.calls == 2
    assert eng.count == 1


# -- never replayed --------------------------------------------------------------------------


def test_post_failing_after_it_was_sent_is_not_replayed_and_carries_request_id(
    closing_server: ClosingServer,
) -> None:
    provider = Provider(snapshot([closing_server.url]))

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            with pytest.raises(RequestNotReplayedError) as info:
                await client.generate({"text": "a"}, request_id="req-42")
            assert info.value.status == 502
            assert info.value.request_id == "req-42"
            assert "req-42" in info.value.message
            # The failure invalidated discovery: the next request fetches a new snapshot.
            calls = provider.calls
            with pytest.raises(RequestNotReplayedError):
                await client.generate({"text": "b"})
            assert provider.calls == calls + 1

    run(scenario)
    assert closing_server.received == 2  # one per call: never sent twice


def test_answer_truncated_mid_body_is_not_replayed(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    eng.mode = "truncate"

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            await client.generate({"text": "a"})

    with pytest.raises(RequestNotReplayedError) as info:
        run(scenario)
    assert info.value.status == 502
    assert info.value.request_id
    assert eng.count == 1


def test_deadline_raises_504_not_replayed_and_invalidates_discovery(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    eng.mode = "slow"
    provider = Provider(snapshot([url]))

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60, timeout=0.3) as client:
            with pytest.raises(RequestNotReplayedError) as info:
                await client.generate({"text": "a"}, request_id="slow-1")
            assert info.value.status == 504
            assert info.value.request_id == "slow-1"
            assert provider.calls == 1
            eng.mode = "ok"
            await client.generate({"text": "b"})
            assert provider.calls == 2

    run(scenario)
    assert eng.requests[0]["headers"]["x-request-id"] == "slow-1"
    assert eng.count == 2


def test_cancellation_invalidates_discovery_and_is_not_replayed(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    eng.mode = "slow"
    provider = Provider(snapshot([url]))

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            task = asyncio.create_task(client.generate({"text": "a"}))
            deadline = time.monotonic() + 10
            while eng.count == 0:
                assert time.monotonic() < deadline, "the engine never received the request"
                await asyncio.sleep(0.01)
            assert client.inflight == {f"{MODEL}/replica-0": 1}
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert client.inflight == {}
            eng.mode = "ok"
            await client.generate({"text": "b"})
            assert provider.calls == 2

    run(scenario)
    assert eng.count == 2


# -- payloads and headers --------------------------------------------------------------------


def test_generate_payload_loses_model_and_route_key(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    payload = {"model": MODEL, "route_key": "math-data", "input_ids": [1, 2], "rid": "r"}

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            await client.generate(payload)

    run(scenario)
    assert json.loads(eng.requests[0]["raw"]) == {"input_ids": [1, 2], "rid": "r"}
    assert eng.requests[0]["path"] == "/generate"


def test_numpy_arrays_in_a_payload_are_sent_as_json_lists(engine: tuple[Engine, str]) -> None:
    np = pytest.importorskip("numpy")
    eng, url = engine

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            await client.generate({"input_ids": np.arange(4, dtype=np.int64)})

    run(scenario)
    assert json.loads(eng.requests[0]["raw"]) == {"input_ids": [0, 1, 2, 3]}


def test_route_key_selects_the_model(engine: tuple[Engine, str]) -> None:
    eng, url = engine

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            await client.generate({"text": "a"}, route_key="math-data")
            with pytest.raises(RoutingError) as info:
                await client.generate({"text": "a"}, route_key="unknown-data")
            assert info.value.status == 400

    run(scenario)
    assert eng.count == 1


def test_chat_payload_gets_served_model_name(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    snap = snapshot([url], aliases={"teacher-checkpoint": MODEL})

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snap) as client:
            await client.chat(
                {
                    "model": "teacher-checkpoint",
                    "route_key": "math-data",
                    "messages": [{"role": "user", "content": "2+2?"}],
                }
            )
            await client.chat({"messages": []})

    run(scenario)
    first, second = (json.loads(r["raw"]) for r in eng.requests)
    assert first == {"model": SERVED, "messages": [{"role": "user", "content": "2+2?"}]}
    assert second == {"messages": [], "model": SERVED}
    assert eng.requests[0]["path"] == "/v1/chat/completions"


def test_payload_bytes_are_sent_as_they_are_when_nothing_changes(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    raw = b'{ "input_ids" : [1,2],   "stream": false }'

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            await client.generate(raw)
            await client.post("/abort_request", {"rid": "r", "model": MODEL})

    run(scenario)
    assert eng.requests[0]["raw"] == raw
    # Paths other than generate/chat carry their payload unchanged.
    assert json.loads(eng.requests[1]["raw"]) == {"rid": "r", "model": MODEL}


def test_request_id_kept_affinity_header_set_and_hop_by_hop_dropped(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    incoming = {
        "X-Request-ID": "caller-id-7",
        "X-SMG-Routing-Key": "group-3",
        "Connection": "keep-alive, X-Hop",
        "X-Hop": "per-connection",
        "Keep-Alive": "timeout=5",
        "TE": "trailers",
        "Transfer-Encoding": "chunked",
        "Proxy-Authorization": "Basic abc",
        "Upgrade": "h2c",
        "Host": "gateway.example",
        "Content-Length": "999",
        "Authorization": "Bearer end-to-end",
        "X-Custom": "kept",
    }

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            prepared = await client.prepare("/generate", b'{"text": "a"}', headers=incoming)
            async with await client.send(prepared) as resp:
                assert resp.status == 200
                assert resp.request_id == "caller-id-7"
                await resp.read()
            await client.generate({"text": "b"}, affinity_key="group-9")

    run(scenario)
    seen = eng.requests[0]["headers"]
    assert seen["x-request-id"] == "caller-id-7"
    assert seen["x-smg-routing-key"] == "group-3"
    assert seen["authorization"] == "Bearer end-to-end"
    assert seen["x-custom"] == "kept"
    assert seen["content-type"] == "application/json"
    for hop in ("x-hop", "keep-alive", "te", "transfer-encoding", "proxy-authorization", "upgrade"):
        assert hop not in seen, hop
    assert seen["host"] != "gateway.example"
    assert seen["content-length"] == str(len(b'{"text": "a"}'))
    second = eng.requests[1]["headers"]
    assert second["x-smg-routing-key"] == "group-9"
    assert second["x-request-id"]  # generated when the caller gave none
    assert second["x-request-id"] != "caller-id-7"


def test_forward_headers_drops_connection_listed_names_case_insensitively() -> None:
    out = forward_headers(
        [("connection", "Close, X-A"), ("x-a", "1"), ("X-B", "2"), ("keep-alive", "x")]
    )
    assert out == {"X-B": "2"}
    response = forward_headers({"Content-Length": "3", "Content-Type": "a/b"}, response=True)
    assert response == {"Content-Type": "a/b"}


# -- upstream answers ------------------------------------------------------------------------


def test_upstream_error_status_surfaces_status_body_and_is_not_retried(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    eng.mode = "status:422"

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            await client.generate({"text": "a"}, request_id="r-422")

    with pytest.raises(UpstreamStatusError) as info:
        run(scenario)
    assert info.value.status == 422
    assert info.value.json() == {"error": "engine says 422"}
    assert info.value.request_id == "r-422"
    assert info.value.url == f"{url}/generate"
    assert eng.count == 1


def test_upstream_503_carries_retry_after_and_invalidates_discovery(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    eng.mode = "status:503"
    provider = Provider(snapshot([url]))

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            with pytest.raises(UpstreamStatusError) as info:
                await client.generate({"text": "a"})
            assert info.value.status == 503
            assert info.value.retry_after == 7.0
            eng.mode = "ok"
            await client.generate({"text": "b"})

    run(scenario)
    assert provider.calls == 2
    assert eng.count == 2


def test_stream_yields_sse_events_as_they_arrive(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    eng.mode = "sse"

    async def scenario() -> tuple[list[bytes], list[Any]]:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            async with client.stream("/generate", {"text": "a", "stream": True}) as resp:
                raw = [event async for event in resp.iter_sse()]
            async with client.stream("/generate", {"text": "a", "stream": True}) as resp:
                parsed = [obj async for obj in resp.iter_events()]
            assert client.inflight == {}
            return raw, parsed

    raw, parsed = run(scenario)
    assert raw == [b'data: {"text": "t0"}', b'data: {"text": "t1"}', b'data: {"text": "t2"}',
                   b"data: [DONE]"]  # fmt: skip
    assert parsed == [{"text": "t0"}, {"text": "t1"}, {"text": "t2"}]


def test_stream_failing_mid_body_is_not_replayed_and_invalidates_discovery(
    engine: tuple[Engine, str],
) -> None:
    eng, url = engine
    eng.mode = "truncate"
    provider = Provider(snapshot([url]))

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            received = b""
            with pytest.raises(RequestNotReplayedError) as info:
                async with client.stream("/generate", {"text": "a"}, request_id="s-1") as resp:
                    async for chunk in resp.iter_chunks():
                        received += chunk
            assert received.startswith(b'{"text": "partial')
            assert info.value.request_id == "s-1"
            assert client.inflight == {}
            eng.mode = "ok"
            await client.generate({"text": "b"})
            assert provider.calls == 2

    run(scenario)
    assert eng.count == 2


def test_router_mode_model_is_sent_to_its_router_with_the_affinity_header(
    engine: tuple[Engine, str],
) -> None:
    eng, router_url = engine
    snap = snapshot([])
    snap["role"] = "rollout"
    snap["models"][MODEL].update(
        route_mode="SGLANG_ROUTER",
        router_url=router_url,
        weight_source="ACTOR",
        weight_version="step-3",
    )

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snap) as client:
            target = await client.resolve(model=MODEL)
            assert (target.url, target.engine_id, target.weight_version) == (
                router_url,
                None,
                "step-3",
            )
            await client.generate({"model": MODEL, "text": "a"}, affinity_key="group-1")
            assert client.inflight == {}

    run(scenario)
    assert json.loads(eng.requests[0]["raw"]) == {"text": "a"}
    assert eng.requests[0]["headers"]["x-smg-routing-key"] == "group-1"


def test_inflight_counts_requests_per_engine_while_they_run(engine: tuple[Engine, str]) -> None:
    eng, url = engine
    eng.mode = "slow"

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snapshot([url])) as client:
            tasks = [asyncio.create_task(client.generate({"text": str(i)})) for i in range(3)]
            deadline = time.monotonic() + 10
            while eng.count < 3:
                assert time.monotonic() < deadline, "the engine never received 3 requests"
                await asyncio.sleep(0.01)
            assert client.inflight == {f"{MODEL}/replica-0": 3}
            eng.release.set()
            await asyncio.gather(*tasks)
            assert client.inflight == {}

    run(scenario)


# -- one shared client per event loop --------------------------------------------------------


def test_get_client_shares_one_client_per_loop_and_closes_it_with_the_loop(
    engine: tuple[Engine, str],
) -> None:
    _, url = engine
    provider = Provider(snapshot([url]))

    async def scenario() -> InferenceClient:
        client = get_client(snapshot_provider=provider, ttl=60)
        assert get_client(snapshot_provider=provider, ttl=60) is client
        await client.generate({"text": "a"})
        await get_client(snapshot_provider=provider, ttl=60).generate({"text": "b"})
        return client

    first = run(scenario)
    second = run(scenario)
    assert first is not second
    assert first.closed and second.closed  # closed by asyncio.run's shutdown
    assert provider.calls == 2  # one fetch per loop's client, shared by its requests


def test_close_clients_closes_the_loops_shared_clients(engine: tuple[Engine, str]) -> None:
    _, url = engine

    provider = Provider(snapshot([url]))

    async def scenario() -> None:
        client = get_client(snapshot_provider=provider)
        await client.generate({"text": "a"})
        await close_clients()
        assert client.closed
        fresh = get_client(snapshot_provider=provider)
        assert fresh is not client
        await fresh.generate({"text": "b"})

    run(scenario)


def test_get_client_outside_a_loop_says_what_to_do() -> None:
    with pytest.raises(RuntimeError, match="running event loop"):
        get_client("http://127.0.0.1:1")


def test_constructor_rejects_ambiguous_sources() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        InferenceClient()
    with pytest.raises(ValueError, match="exactly one"):
        InferenceClient("http://a:1", snapshot_provider=lambda: {})
    with pytest.raises(ValueError, match="http"):
        InferenceClient("ftp://a:1")
