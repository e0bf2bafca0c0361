"""Failure classes and circuit breakers through a real gateway, with real faults.

Upstreams are real engine-protocol server processes (``tests/support/upstream_server.py``);
a dead replica is a port nothing listens on (connection refused), later brought back by
starting a server on it; a stream is cut by the upstream dropping its connection mid-stream.
Whether a request was replayed is read from the upstreams' own request counts.
"""

from __future__ import annotations

import http.client
import json
import re
import urllib.request
from collections.abc import Iterator

import pytest

from relax_core import BreakerSettings
from relax_core.testing import free_port, wait_for
from tests.support import gateway as gs

#: A short cooldown so a test sees the probe close the breaker quickly.
FAST_BREAKER = BreakerSettings(failures=3, cooldown=0.2, max_cooldown=0.4, probe_timeout=2.0)


def metric(url: str, name: str, **labels: str) -> float:
    """One sample of the gateway's ``/metrics`` (0 when absent)."""
    _, _, body = gs.get(f"{url}/metrics")
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in body.decode().splitlines():
        m = re.match(rf"{name}\{{(.*)\}} (\S+)$", line)
        if m and ",".join(sorted(m.group(1).split(","))) == want:
            return float(m.group(2))
    return 0.0


def failures(url: str, kind: str) -> float:
    return metric(
        url, "relax_gateway_upstream_failures_total", **{"class": kind, "role": "teacher"}
    )


def breaker_events(url: str, to: str) -> float:
    return metric(url, "relax_gateway_breaker_transitions_total", role="teacher", to=to)


def generate(url: str, **headers: str) -> tuple[int, dict[str, str], bytes]:
    body = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}
    return gs.post(f"{url}/teacher/generate", body, headers)


@pytest.fixture
def live() -> Iterator[gs.Upstream]:
    with gs.upstream("live") as up:
        yield up


def test_connect_failures_go_to_another_replica_and_open_then_close_its_breaker(
    live: gs.Upstream,
) -> None:
    dead_port = free_port()
    dead_url = f"http://127.0.0.1:{dead_port}"
    registry = gs.Registry(gs.snapshot("teacher", {"math": {"urls": [live.url, dead_url]}}))
    with gs.gateway("teacher", registry, breaker=FAST_BREAKER) as url:
        sent = 0
        while breaker_events(url, "open") < 1:
            status, _, body = generate(url)
            sent += 1
            # A refused connection sent nothing: the request went to the live replica instead.
            assert status == 200 and json.loads(body)["text"].startswith("live:"), body
            assert sent < 20, "the breaker never opened"
        assert failures(url, "connect") == FAST_BREAKER.failures
        assert metric(url, "relax_gateway_breakers_open", role="teacher") == 1
        # Open: the dead replica is not even tried any more.
        for _ in range(6):
            assert generate(url)[0] == 200
        sent += 6
        assert failures(url, "connect") == FAST_BREAKER.failures
        assert live.stats()["requests"] == sent  # every request exactly once, none lost

        # The replica comes back on its address: a /health_generate probe closes the breaker
        # and it is routed to again.
        with gs.upstream("back", port=dead_port) as back:
            wait_for(lambda: breaker_events(url, "closed") == 1, timeout=20, what="breaker closed")
            assert metric(url, "relax_gateway_breakers_open", role="teacher") == 0
            answers = [json.loads(generate(url)[2])["text"].split(":")[0] for _ in range(4)]
            assert "back" in answers and back.stats()["requests"] >= 1
        assert failures(url, "before_first_byte") == failures(url, "mid_stream") == 0


def _read_stream(url: str, headers: dict[str, str]) -> tuple[int, bytes, bool]:
    """POST a streamed generate; ``(status, bytes received, whether the stream was cut)``."""
    body = {"text": "hi", "stream": True, "sampling_params": {"max_new_tokens": 6}}
    req = urllib.request.Request(
        f"{url}/teacher/generate",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=30) as resp:
        try:
            return resp.status, resp.read(), False
        except http.client.IncompleteRead as exc:
            return resp.status, bytes(exc.partial), True


def test_failures_after_sending_are_counted_by_class_and_never_replayed() -> None:
    with gs.upstream("a") as a, gs.upstream("b") as b:
        registry = gs.Registry(gs.snapshot("teacher", {"math": {"urls": [a.url, b.url]}}))
        with gs.gateway("teacher", registry, breaker=FAST_BREAKER) as url:
            # Mid-stream: the engine drops the connection after two events.
            status, received, cut = _read_stream(url, {"X-Test-Mode": "reset-after:2"})
            assert status == 200 and cut
            assert received.count(b"data: {") >= 2 and b'"code":502' in received
            assert failures(url, "mid_stream") == 1
            # Before the first byte: sent, then the deadline passed with no answer.
            status, _, body = generate(url, **{"X-Test-Mode": "slow:5", "X-Relax-Timeout": "0.5"})
            assert status == 504 and b"not replayed" in body
            assert failures(url, "before_first_byte") == 1
            # Each was received exactly once, by one replica: nothing was sent again.
            assert a.stats()["requests"] + b.stats()["requests"] == 2
            assert failures(url, "connect") == 0
            assert metric(url, "relax_gateway_breakers_open", role="teacher") == 0


def test_a_lone_replica_that_refuses_every_connection_is_still_tried() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    registry = gs.Registry(gs.snapshot("teacher", {"math": {"urls": [dead]}}))
    with gs.gateway("teacher", registry, breaker=FAST_BREAKER) as url:
        for _ in range(4):
            status, _, body = generate(url)
            assert status == 502 and b"nothing was sent" in body
        # The breaker opened, but a lone replica is not routed around: a connect attempt
        # sends nothing, and the caller learns the engine is unreachable (502), not "busy".
        assert breaker_events(url, "open") == 1
        assert failures(url, "connect") >= 4


def test_a_replica_whose_engine_is_gone_behind_its_admission_server_is_routed_around(
    live: gs.Upstream,
) -> None:
    from relax_core import AdmissionServer, InferenceEngineSpec
    from relax_core.builtins import STATIC
    from tests.support.admission import AdmissionThread

    # The replica's door is up, its engine is not (killed): the door answers 502 "nothing
    # sent", and the gateway sends the request to the other replica instead.
    dead_engine = f"http://127.0.0.1:{free_port()}"
    door = AdmissionServer(
        dead_engine,
        engine_id="math/replica-1",
        spec=InferenceEngineSpec(role="teacher", weight_source=STATIC),
    )
    with AdmissionThread(door) as guard:
        guard.open()
        urls = [live.url, door.base_url]
        registry = gs.Registry(gs.snapshot("teacher", {"math": {"urls": urls}}))
        with gs.gateway("teacher", registry, breaker=FAST_BREAKER) as url:
            answers = [generate(url) for _ in range(6)]
            assert [status for status, _, _ in answers] == [200] * 6
            assert live.stats()["requests"] == 6
            assert failures(url, "connect") >= 1 and door.forwarded == 0
