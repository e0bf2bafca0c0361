"""Role gateways in front of real hf engines under real InferenceManagers on a local Ray.

Each failure-semantics row that reaches the gateway is produced for real: the model put to
sleep by the manager (503 + Retry-After, nothing sent), the request deadline (504), the engine
process killed with SIGKILL mid-stream (cut, not replayed on the other replica, counted, and
the replica FAILED by the role service's health monitor so it is no longer routed to), and the
registry the gateway discovers through going away (503, gateway alive, not ready). A real hf
token stream reaches the caller byte for byte as the engine sent it, and a caller leaving a
stream stops its generation on the engine.

One role service with two micro hf replicas and one gateway serve the whole module (engines
start once); the test that kills an engine runs last.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import aiohttp
import attrs
import pytest

from relax_core import PluginManager
from relax_core.discovery.schema import RoutingSpec
from relax_core.gateway.handler import GatewayOptions
from relax_core.gateway.serving import GatewayServer, gateway_app
from relax_core.jobs import RoleService
from relax_core.testing import wait_for
from tests.support import gateway as gs
from tests.support import manager as ms

pytestmark = [pytest.mark.ray, pytest.mark.slow]


@attrs.frozen
class Served:
    service: RoleService
    url: str
    run: Any


@pytest.fixture(scope="module")
def served(ray_local: Any) -> Iterator[Served]:
    """A teacher role service with two hf replicas of one model, and its gateway."""
    service = RoleService("teacher", RoutingSpec(default_model="math"))
    manager = ms.make_manager(
        model_id="math", role="teacher", publisher=service.publisher, replicas=2
    )
    service.add("math", manager, model_path=ms.tiny_model())
    with ms.managed(manager) as run:
        app = gateway_app(
            "teacher",
            service.snapshot,
            plugin_manager=PluginManager.create(),
            options=GatewayOptions(model_paths=service.model_paths, snapshot_ttl=0.0),
        )
        gateway = GatewayServer(app).start()
        try:
            yield Served(service, gateway.url, run)
        finally:
            gateway.stop()
            service.stop_monitor()


def _heads(service: RoleService) -> dict[str, str]:
    """Engine id → the replica head's public (admission) URL."""
    return {
        e.engine_id: e.base_url
        for e in service.snapshot().models["math"].engines
        if e.base_url is not None
    }


def _requests_total(head_url: str) -> int:
    """The engine's own count of generation requests it received (its /metrics)."""
    text = urllib.request.urlopen(f"{head_url}/metrics", timeout=10).read().decode()
    match = re.search(r"^sglang:num_requests_total\{[^}]*\} (\d+)", text, re.M)
    assert match, text
    return int(match.group(1))


def _upstream_errors(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(
            r'^relax_gateway_upstream_errors_total\{error="([^"]+)",role="teacher"\} (\S+)',
            text,
            re.M,
        )
    }


def test_prefill_through_the_gateway_reaches_the_engine(served: Served) -> None:
    status, _, body = gs.post(
        f"{served.url}/teacher/generate",
        {
            "input_ids": [3, 4, 5, 6],
            "return_logprob": True,
            "logprob_start_len": 1,
            "top_logprobs_num": 2,
            "sampling_params": {"max_new_tokens": 0},
        },
    )
    assert status == 200, body
    meta = json.loads(body)["meta_info"]
    assert len(meta["input_token_logprobs"]) == 3


class _UpstreamTap:
    """The raw bytes each of the gateway's upstream connections receives, as it receives them.

    It wraps the gateway's own socket reads (the gateway runs in this process): the bytes are
    what the real engine sent for the request, recorded on their way in; nothing is replaced.
    """

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from relax_core._http import http1

        self.received: dict[int, bytearray] = {}
        original = http1._Connection.data_received

        def data_received(conn: Any, data: bytes) -> None:
            self.received.setdefault(id(conn), bytearray()).extend(data)
            original(conn, data)

        monkeypatch.setattr(http1._Connection, "data_received", data_received)

    def event_stream_bodies(self) -> list[bytes]:
        """The (de-chunked) bodies of the ``text/event-stream`` answers received."""
        import httptools

        bodies: list[bytes] = []

        class Answers:
            def __init__(self) -> None:
                self.sse, self.body = False, bytearray()

            def on_header(self, name: bytes, value: bytes) -> None:
                if name.lower() == b"content-type" and value.startswith(b"text/event-stream"):
                    self.sse = True

            def on_body(self, body: bytes) -> None:
                self.body += body

            def on_message_complete(self) -> None:
                if self.sse:
                    bodies.append(bytes(self.body))
                self.sse, self.body = False, bytearray()

        for raw in self.received.values():
            httptools.HttpResponseParser(Answers()).feed_data(bytes(raw))
        return bodies


def test_a_stream_is_relayed_byte_for_byte_as_the_engine_sent_it(
    served: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    tap = _UpstreamTap(monkeypatch)
    req = urllib.request.Request(
        f"{served.url}/teacher/generate",
        data=json.dumps(
            {
                "text": "hi",
                "stream": True,
                "sampling_params": {"max_new_tokens": 64, "ignore_eos": True},
            }
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        relayed = resp.read()
    monkeypatch.undo()
    (sent,) = tap.event_stream_bodies()
    assert relayed == sent
    # A real token stream: one event per token (each with its own timing), then [DONE].
    events = relayed.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""] and len(events) == 64 + 2, relayed[-300:]


def _engine_gauges(head_url: str) -> tuple[int, int]:
    """The engine's (running requests, tokens generated so far), from its /metrics."""
    text = urllib.request.urlopen(f"{head_url}/metrics", timeout=10).read().decode()
    running = re.search(r"^sglang:num_running_reqs\{[^}]*\} (\d+)", text, re.M)
    tokens = re.search(r"^sglang:generation_tokens_total\{[^}]*\} (\d+)", text, re.M)
    assert running and tokens, text
    return int(running.group(1)), int(tokens.group(1))


def test_a_caller_leaving_a_stream_stops_the_generation_on_the_engine(served: Served) -> None:
    heads = _heads(served.service)
    tokens_before = sum(_engine_gauges(u)[1] for u in heads.values())
    gs.leave_a_stream(
        f"{served.url}/teacher/generate",
        {
            "text": "hi",
            "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
        },
    )
    # The gateway closes its upstream; the engine aborts the request long before its 4,000
    # tokens (a few hundred tokens a second on this model and CPU).
    wait_for(
        lambda: all(_engine_gauges(u)[0] == 0 for u in heads.values()),
        timeout=30,
        what="the engines to have no running request",
    )
    generated = sum(_engine_gauges(u)[1] for u in heads.values()) - tokens_before
    assert 0 < generated < 4000
    metrics = urllib.request.urlopen(f"{served.url}/metrics", timeout=10).read().decode()
    assert re.search(r'route="generate",status="499"\} [1-9]', metrics), metrics


def test_deadline_is_504(served: Served) -> None:
    status, _, body = gs.post(
        f"{served.url}/teacher/generate",
        {"text": "hello", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}},
        {"X-Relax-Timeout": "0.2"},
    )
    assert status == 504, body
    assert "deadline" in json.loads(body)["error"]["message"]


def test_registry_unavailable_is_503_and_the_gateway_stays_alive(served: Served) -> None:
    # A second gateway that discovers through the first one's /teacher/engines.
    pm = PluginManager.create()
    registry = GatewayServer(
        gateway_app("teacher", served.service.snapshot, plugin_manager=pm)
    ).start()
    front = GatewayServer(
        gateway_app(
            "teacher",
            f"{registry.url}/teacher",
            plugin_manager=pm,
            options=GatewayOptions(snapshot_ttl=0.0),
        )
    ).start()
    try:
        assert gs.post(f"{front.url}/teacher/generate", {"text": "hi"})[0] == 200
        registry.stop()
        status, headers, body = gs.post(f"{front.url}/teacher/generate", {"text": "hi"})
        assert status == 503 and "registry unavailable" in body.decode()
        assert "retry-after" in headers
        health = gs.get(f"{front.url}/teacher/health")
        assert health[0] == 503 and json.loads(health[2])["ready"] is False
    finally:
        front.stop()
        registry.stop()


def test_sleeping_model_is_503_with_retry_after_and_sends_nothing_until_onloaded(
    served: Served,
) -> None:
    service, url = served.service, served.url
    manager = service.managers["math"]
    heads = _heads(service)
    assert manager.offload().ok
    try:
        before = {e: _requests_total(u) for e, u in heads.items()}
        status, headers, body = gs.post(f"{url}/teacher/generate", {"text": "hi"})
        assert status == 503 and int(headers["retry-after"]) >= 1, body
        assert service.snapshot().models["math"].state.value == "SLEEPING"
        assert {e: _requests_total(u) for e, u in heads.items()} == before
    finally:
        assert manager.onload().ok
    assert gs.post(f"{url}/teacher/generate", {"text": "hi"})[0] == 200


async def _stream_and_kill(url: str, heads: dict[str, str], pids: dict[str, int]) -> Any:
    """Open a long stream; at its first bytes, SIGKILL the engine serving it; read to the end.

    Returns ``(bytes received, truncated?, killed engine id, request counts before)``.
    """
    got = b""
    killed = None
    before = {e: _requests_total(u) for e, u in heads.items()}
    # A client-side bound too: a regression that keeps the stream open fails, never hangs.
    timeout = aiohttp.ClientTimeout(total=90)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        try:
            async with session.post(
                f"{url}/teacher/generate",
                json={
                    "text": "hi",
                    "stream": True,
                    "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
                },
                headers={"X-Relax-Timeout": "60"},
            ) as resp:
                assert resp.status == 200
                async for chunk in resp.content.iter_any():
                    if killed is None:
                        now = await asyncio.to_thread(
                            lambda: {e: _requests_total(u) for e, u in heads.items()}
                        )
                        serving = [e for e in heads if now[e] == before[e] + 1]
                        assert len(serving) == 1, (before, now)
                        killed = serving[0]
                        ms.signal_quietly(pids[killed], signal.SIGKILL)
                    got += chunk
        except aiohttp.ClientPayloadError:
            return got, True, killed, before
    return got, False, killed, before


def test_engine_killed_mid_stream_is_cut_not_replayed_and_its_replica_leaves_routing(
    served: Served,
) -> None:
    service, url = served.service, served.url
    heads = _heads(service)
    assert len(heads) == 2
    pids = {e: p[0] for e, p in service.engine_pids().items()}
    served.run.track()
    errors_before = _upstream_errors(url)

    got, truncated, killed, before = asyncio.run(_stream_and_kill(url, heads, pids))

    # The stream is cut: no final chunk, no [DONE]; an error event (if any) says bad gateway.
    assert truncated, got[-300:]
    assert got.startswith(b"data: ") and b"[DONE]" not in got
    events = [e for e in got.split(b"\n\n") if e.startswith(b"data: ")]
    last = json.loads(events[-1][len(b"data: ") :])
    if "error" in last:
        assert last["error"]["code"] == 502, last
    # Counted as an aborted stream (the engine died), not a stall or a deadline.
    errors_after = _upstream_errors(url)
    delta = {k: v - errors_before.get(k, 0.0) for k, v in errors_after.items()}
    assert {k: v for k, v in delta.items() if v} == {"stream_aborted": 1.0}
    # Not replayed: the surviving replica received nothing.
    (survivor,) = [e for e in heads if e != killed]
    assert _requests_total(heads[survivor]) == before[survivor]

    # The role service's health monitor finds the dead engine: its replica is FAILED and no
    # longer routable, and every request goes to the survivor.
    reports: list[Any] = []
    seen = threading.Event()

    def on_report(model_id: str, outcome: Any) -> None:
        reports.append((model_id, outcome))
        seen.set()

    service.start_monitor(0.2, recover=False, on_report=on_report)
    try:

        def failed() -> bool:
            engines = {e.engine_id: e for e in service.snapshot().models["math"].engines}
            return engines[killed].state.value == "FAILED" and not engines[killed].direct_eligible

        wait_for(failed, timeout=30, what=f"{killed} FAILED in the snapshot")
        assert seen.wait(10)
    finally:
        service.stop_monitor()
    model_id, report = reports[0]
    assert model_id == "math"
    unhealthy = [r.engine_id for r in report.replicas if not r.healthy]
    assert unhealthy == [killed]
    assert service.snapshot().models["math"].state.value == "READY"  # the survivor serves
    survivor_before = _requests_total(heads[survivor])  # the monitor's probes count too
    for _ in range(3):
        assert gs.post(f"{url}/teacher/generate", {"text": "hi"})[0] == 200
    assert _requests_total(heads[survivor]) == survivor_before + 3
