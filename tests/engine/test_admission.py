"""The admission server in front of an engine head: allowlist, 503 while closed, drain, 403s.

The upstream here is a real uvicorn server on loopback that speaks the few SGLang paths these
tests need, with a generate call the test can hold open; the manager tests put the admission
server in front of real hf engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import urllib3
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from relax_core.builtins import ACTOR, STATIC
from relax_core.engine.admission import (
    ADMISSION_ALLOWLIST,
    CANCEL_PATHS,
    GENERATE_PATHS,
    METADATA_PATHS,
    PRIVATE_PREFIX,
    PROBE_PATHS,
    AdmissionServer,
)
from relax_core.engine.spec import UPDATE_ENDPOINTS, InferenceEngineSpec
from relax_core.testing import free_port, serve_app, wait_for
from tests.support.admission import AdmissionThread
from tests.support.stale_keepalive import StaleKeepAliveServer


class Upstream:
    """What the fake upstream saw, and a gate that holds ``/generate`` open."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, bytes, dict[str, str]]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.streaming = threading.Event()

    def app(self) -> Starlette:
        async def generate(request: Request) -> Response:
            body = await request.body()
            self.calls.append(("POST", request.url.path, body, dict(request.headers)))
            self.entered.set()
            # The uvicorn thread's loop may block here: it serves only this test.
            while not self.gate.wait(0.01):
                pass
            payload = json.loads(body or b"{}")
            if payload.get("stream"):

                async def events() -> AsyncIterator[bytes]:
                    for i in range(3):
                        yield f'data: {{"text": "t{i}"}}\n\n'.encode()
                        if payload.get("slow"):
                            self.streaming.set()
                            await asyncio.sleep(30)
                        if payload.get("die"):
                            # uvicorn drops the connection without the final chunk, as the
                            # connection of a killed engine ends.
                            raise RuntimeError("engine died mid-stream")
                    yield b"data: [DONE]\n\n"

                return StreamingResponse(events(), media_type="text/event-stream")
            return JSONResponse(
                {"text": "hello", "meta_info": {"id": payload.get("rid")}},
                headers={"X-Upstream": "yes", "Keep-Alive": "timeout=5"},
            )

        async def anything(request: Request) -> Response:
            body = await request.body()
            self.calls.append((request.method, request.url.path, body, dict(request.headers)))
            if request.url.path == "/metrics":
                return PlainTextResponse("sglang_num_running_reqs 0\n")
            return JSONResponse({"path": request.url.path, "ok": True})

        paths = sorted((ADMISSION_ALLOWLIST - GENERATE_PATHS) | {"/release_memory_occupation"})
        routes = [Route(p, generate, methods=["POST"]) for p in sorted(GENERATE_PATHS)]
        routes += [Route(p, anything, methods=["GET", "POST"]) for p in paths]
        return Starlette(routes=routes)

    def paths(self) -> list[str]:
        return [path for _, path, _, _ in self.calls]


@pytest.fixture
def upstream() -> Iterator[tuple[Upstream, str]]:
    up = Upstream()
    with serve_app(up.app()) as url:
        yield up, url
        up.gate.set()


def _guard(url: str, spec: InferenceEngineSpec | None = None) -> AdmissionThread:
    return AdmissionThread(AdmissionServer(url, engine_id="judge/replica-0", spec=spec))


def test_closed_admission_answers_503_with_retry_after_and_sends_nothing_upstream(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    up, url = upstream
    with _guard(url) as guard:
        for path in sorted(GENERATE_PATHS):
            r = http.request("POST", guard.server.base_url + path, json={"text": "hi"})
            assert r.status == 503
            assert int(r.headers["Retry-After"]) >= 1
            assert "judge/replica-0" in r.json()["error"]
        assert up.paths() == []


def test_open_admission_forwards_generate_bytes_status_and_end_to_end_headers(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    up, url = upstream
    with _guard(url) as guard:
        guard.open()
        r = http.request(
            "POST",
            guard.server.base_url + "/generate",
            body=b'{"text": "hi", "rid": "r-1"}',
            headers={"Content-Type": "application/json", "X-Request-Id": "r-1"},
        )
    assert r.status == 200
    assert r.json() == {"text": "hello", "meta_info": {"id": "r-1"}}
    assert r.headers["X-Upstream"] == "yes"
    assert "Keep-Alive" not in r.headers
    method, path, body, headers = up.calls[0]
    assert (method, path, body) == ("POST", "/generate", b'{"text": "hi", "rid": "r-1"}')
    assert headers["x-request-id"] == "r-1"


def test_forwarded_headers_follow_the_data_paths_one_hop_by_hop_rule(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    up, url = upstream
    with _guard(url) as guard:
        guard.open()
        r = http.request(
            "POST",
            guard.server.base_url + "/generate",
            body=b'{"text": "hi"}',
            headers={
                "Content-Type": "application/json",
                "Connection": "keep-alive, X-Hop",
                "X-Hop": "this hop only",
                "TE": "trailers",
                "Accept-Encoding": "gzip",
                "Authorization": "Bearer caller",
            },
        )
    assert r.status == 200
    headers = up.calls[0][3]
    # Hop-by-hop headers, those Connection names, and Accept-Encoding (the engine answers
    # uncompressed bytes that are relayed as they are) do not reach the engine.
    assert not {"x-hop", "te", "accept-encoding"} & set(headers)
    assert headers["authorization"] == "Bearer caller"


def test_sse_stream_is_forwarded_byte_for_byte(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    _, url = upstream
    with _guard(url) as guard:
        guard.open()
        r = http.request(
            "POST", guard.server.base_url + "/generate", json={"text": "hi", "stream": True}
        )
    assert r.status == 200
    assert r.headers["Content-Type"].startswith("text/event-stream")
    expected = "".join(f'data: {{"text": "t{i}"}}\n\n' for i in range(3)) + "data: [DONE]\n\n"
    assert r.data.decode() == expected


def test_health_generate_is_503_while_closed_and_forwarded_when_open(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    up, url = upstream
    with _guard(url) as guard:
        closed = http.request("GET", guard.server.base_url + "/health_generate")
        guard.open()
        opened = http.request("GET", guard.server.base_url + "/health_generate")
    assert closed.status == 503 and "Retry-After" in closed.headers
    assert opened.status == 200
    assert up.paths() == ["/health_generate"]


def test_health_metadata_cancel_and_router_probes_pass_while_closed(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    up, url = upstream
    paths = sorted(METADATA_PATHS | CANCEL_PATHS | PROBE_PATHS | {"/health"})
    with _guard(url) as guard:
        statuses = {p: http.request("GET", guard.server.base_url + p).status for p in paths}
    assert statuses == dict.fromkeys(paths, 200)
    assert sorted(up.paths()) == paths


def test_static_engine_refuses_every_update_path_with_403_json(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    up, url = upstream
    spec = InferenceEngineSpec(role="genrm", weight_source=STATIC)
    with _guard(url, spec) as guard:
        guard.open()
        for operation, paths in UPDATE_ENDPOINTS.items():
            for path in paths:
                r = http.request("POST", guard.server.base_url + path, json={})
                assert r.status == 403, path
                body = r.json()
                assert body["operation"] == operation
                assert "STATIC" in body["error"] and "judge/replica-0" in body["error"]
    assert up.paths() == []


def test_actor_engine_takes_updates_only_from_its_manager_not_the_public_port(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    up, url = upstream
    spec = InferenceEngineSpec(role="rollout", weight_source=ACTOR)
    with _guard(url, spec) as guard:
        r = http.request("POST", guard.server.base_url + "/update_weights_from_disk", json={})
    assert r.status == 403
    assert "InferenceManager" in r.json()["error"]
    assert up.paths() == []


def test_control_paths_are_403_and_unknown_paths_404(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    up, url = upstream
    with _guard(url) as guard:
        guard.open()
        release = http.request("POST", guard.server.base_url + "/release_memory_occupation")
        unknown = http.request("GET", guard.server.base_url + "/secret")
    assert release.status == 403 and "control path" in release.json()["error"]
    assert unknown.status == 404 and "allowlist" in unknown.json()["error"]
    assert up.paths() == []


def test_private_control_paths_are_403_at_the_public_port_even_with_a_token(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    up, url = upstream
    with _guard(url) as guard:
        guard.open()
        responses = [
            http.request(
                method,
                guard.server.base_url + PRIVATE_PREFIX + path,
                json={"tags": None},
                headers={"X-Relax-Control-Token": "any"},
            )
            for method, path in (("POST", "control/offload"), ("GET", "control/admission_state"))
        ]
    for r in responses:
        assert r.status == 403 and "never through its public port" in r.json()["error"]
    assert up.paths() == []


def test_drain_waits_for_in_flight_generation_and_refuses_new_ones(
    upstream: tuple[Upstream, str], http: urllib3.PoolManager
) -> None:
    up, url = upstream
    up.gate.clear()
    with _guard(url) as guard, ThreadPoolExecutor(1) as pool:
        guard.open()
        held = pool.submit(
            http.request, "POST", guard.server.base_url + "/generate", json={"text": "slow"}
        )
        assert up.entered.wait(10)
        assert guard.server.inflight == 1
        guard.close()
        refused = http.request("POST", guard.server.base_url + "/generate", json={"text": "x"})
        assert refused.status == 503
        assert guard.wait_idle(0.2) is False
        up.gate.set()
        assert guard.wait_idle(10) is True
        assert held.result(10).status == 200
    assert guard.server.inflight == 0


def test_unreachable_engine_answers_502_naming_the_engine(http: urllib3.PoolManager) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    with _guard(dead) as guard:
        guard.open()
        r = http.request("POST", guard.server.base_url + "/generate", json={"text": "x"})
        wait_for(lambda: guard.server.inflight == 0, timeout=5, what="in-flight to clear")
    assert r.status == 502
    assert "judge/replica-0" in r.json()["error"]
    # Nothing reached the engine, and the answer says so: a caller may try another replica.
    assert r.headers["X-Relax-Not-Sent"] == "engine-unreachable"


def test_an_engine_closing_a_reused_idle_connection_as_a_request_arrives_costs_no_502(
    http: urllib3.PoolManager,
) -> None:
    # The keep-alive race behind "engine ... could not be reached at its private port:
    # ServerDisconnectedError": the engine closes an idle pooled connection exactly when the
    # admission server reuses it. The engine never read that request, so it is sent again once,
    # on a fresh connection, and the caller gets the engine's answer.
    with StaleKeepAliveServer() as engine, _guard(engine.url) as guard:
        guard.open()
        for i in range(3):
            r = http.request("POST", guard.server.base_url + "/generate", json={"text": str(i)})
            assert (r.status, r.json()) == (200, {"ok": True}), r.data
    # Each request after the first met a close on its reused connection, then ran once.
    assert (engine.requests_answered, engine.requests_dropped) == (3, 2)
    assert engine.connections == 3


def test_stopped_admission_thread_frees_its_port(upstream: tuple[Upstream, str]) -> None:
    _, url = upstream
    guard = _guard(url)
    guard.start()
    port = guard.server.port
    guard.stop()
    guard.stop()  # idempotent
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))


@contextlib.contextmanager
def _raw_generate(guard: AdmissionThread, body: bytes) -> Iterator[socket.socket]:
    """A raw connection to ``guard``'s port that has sent ``POST /generate`` of ``body``; the
    test reads the answer (or leaves) itself."""
    with socket.create_connection(("127.0.0.1", guard.server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        yield sock


def test_client_leaving_mid_stream_ends_the_request_and_frees_the_drain(
    upstream: tuple[Upstream, str],
) -> None:
    _, url = upstream
    with _guard(url) as guard:
        guard.open()
        body = b'{"text": "hi", "stream": true, "slow": true}'
        with _raw_generate(guard, body) as sock:
            received = b""
            while b"data:" not in received:
                chunk = sock.recv(4096)
                assert chunk, received
                received += chunk
            assert guard.server.inflight == 1
        # The client is gone: the proxied request ends at once (the upstream is closed, which
        # aborts it there), so a drain does not wait the 30 s the engine would still take.
        assert guard.wait_idle(10) is True


def test_engine_dying_mid_stream_truncates_the_clients_stream(
    upstream: tuple[Upstream, str],
) -> None:
    _, url = upstream
    with _guard(url) as guard:
        guard.open()
        body = b'{"text": "hi", "stream": true, "die": true}'
        with _raw_generate(guard, body) as sock:
            received = b""
            while chunk := sock.recv(4096):
                received += chunk
        assert received.startswith(b"HTTP/1.1 200") and b'data: {"text": "t0"}' in received
        # No terminating zero-length chunk: the client can tell the stream was cut.
        assert not received.endswith(b"0\r\n\r\n")
        assert guard.wait_idle(10) is True
