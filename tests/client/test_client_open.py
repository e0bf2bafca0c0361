"""InferenceClient.open, prepare(target=…) and the idle limits of streamed answers.

Real servers only: in-process uvicorn engines on loopback for routing and retries, and a real
engine-protocol server process (``tests/upstream_server.py``) that a test stops with SIGSTOP,
so a stalled stream is a stopped process behind a socket the kernel keeps open.
"""

from __future__ import annotations

import asyncio
import math
import signal
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from relax_core.client.client import InferenceClient
from relax_core.errors import RequestNotReplayedError, UpstreamUnreachableError
from relax_core.testing import free_port, serve_app
from tests.support import gateway as gs


class Replica:
    """A recording engine server: answers ``status`` (200 by default) with a JSON body."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.status = 200
        self.request_ids: list[str] = []
        self.app = Starlette(routes=[Route("/generate", self.handle, methods=["POST"])])

    async def handle(self, request: Request) -> Response:
        await request.body()
        self.request_ids.append(request.headers.get("x-request-id", ""))
        return JSONResponse({"text": self.name}, status_code=self.status)


@pytest.fixture
def replicas() -> Iterator[tuple[tuple[Replica, str], tuple[Replica, str]]]:
    a, b = Replica("a"), Replica("b")
    with serve_app(a.app) as url_a, serve_app(b.app) as url_b:
        yield (a, url_a), (b, url_b)


def provider_of(*snapshots: Any) -> Any:
    """A snapshot provider serving ``snapshots`` in turn (the last one repeats); counts calls."""

    def provide() -> Any:
        provide.calls += 1  # type: ignore[attr-defined]
        return snapshots[min(provide.calls, len(snapshots)) - 1]  # type: ignore[attr-defined]

    provide.calls = 0  # type: ignore[attr-defined]
    return provide


def test_open_returns_the_upstream_answer_unchecked_and_tracks_it_until_closed(
    replicas: Any,
) -> None:
    (a, url), _ = replicas
    a.status = 500

    async def scenario() -> None:
        snap = gs.snapshot("rollout", {"policy": {"urls": [url]}})
        async with InferenceClient(snapshot_provider=lambda: snap) as client:
            resp = await client.open("/generate", {"text": "x"}, request_id="r-1")
            assert client.inflight == {"policy/replica-0": 1}
            async with resp:
                assert resp.status == 500  # a gateway relays an upstream's status as it is
                assert await resp.read() == b'{"text":"a"}'
            assert client.inflight == {}

    asyncio.run(scenario())
    assert a.request_ids == ["r-1"]


def test_open_routes_again_once_on_a_fresh_snapshot_when_nothing_was_sent(
    replicas: Any,
) -> None:
    (a, url), _ = replicas
    dead = f"http://127.0.0.1:{free_port()}"
    provider = provider_of(
        gs.snapshot("rollout", {"policy": {"urls": [dead]}}),
        gs.snapshot("rollout", {"policy": {"urls": [url]}}),
    )

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            resp = await client.open("/generate", {"text": "x"}, request_id="r-2")
            async with resp:
                assert resp.status == 200 and resp.target is not None
                assert resp.target.url == url

    asyncio.run(scenario())
    assert provider.calls == 2
    assert a.request_ids == ["r-2"], "the retry keeps the request id"


def test_open_gives_up_after_one_retry_when_no_connection_opens() -> None:
    dead = gs.snapshot("rollout", {"policy": {"urls": [f"http://127.0.0.1:{free_port()}"]}})
    provider = provider_of(dead)

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            with pytest.raises(UpstreamUnreachableError) as info:
                await client.open("/generate", {"text": "x"})
            assert info.value.status == 502 and "nothing was sent" in info.value.message

    asyncio.run(scenario())
    assert provider.calls == 2


def test_a_given_target_is_used_without_a_second_routing_decision(replicas: Any) -> None:
    (a, url_a), (b, url_b) = replicas
    snap = gs.snapshot("rollout", {"policy": {"urls": [url_a, url_b]}})

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=lambda: snap) as client:
            first = await client.resolve()
            prepared = await client.prepare("/generate", {"text": "x"}, target=first)
            assert prepared.target is first and prepared.url == first.url + "/generate"
            # The prepare above made no decision: round-robin moves on to the other replica.
            assert (await client.resolve()).url != first.url
            for _ in range(10):  # resolve-then-send, as a role adapter that needs the model
                target = await client.resolve()
                async with await client.open("/generate", {"text": "x"}, target=target):
                    pass

    asyncio.run(scenario())
    assert (len(a.request_ids), len(b.request_ids)) == (5, 5)


def test_a_given_target_that_cannot_be_reached_is_retried_on_a_replica_of_its_model(
    replicas: Any,
) -> None:
    (a, url), _ = replicas
    dead = f"http://127.0.0.1:{free_port()}"
    stale = gs.snapshot("rollout", {"judge": {"urls": [dead]}, "other": {"urls": [dead]}})
    fresh = gs.snapshot("rollout", {"other": {"urls": [dead]}, "judge": {"urls": [url]}})
    provider = provider_of(stale, fresh)

    async def scenario() -> None:
        async with InferenceClient(snapshot_provider=provider, ttl=60) as client:
            target = await client.resolve(model="judge")
            async with await client.open("/generate", {"text": "x"}, target=target) as resp:
                assert resp.target is not None
                assert (resp.target.model_id, resp.target.url) == ("judge", url)

    asyncio.run(scenario())
    assert len(a.request_ids) == 1


# -- idle limits of streamed answers ---------------------------------------------------------


@pytest.fixture
def engine_process() -> Iterator[Any]:
    with gs.upstream("stall") as up:
        try:
            yield up
        finally:
            if up.proc.poll() is None:
                up.proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM


def test_a_stream_stalled_mid_answer_fails_with_504_at_the_idle_limit(engine_process: Any) -> None:
    snap = gs.snapshot("rollout", {"policy": {"urls": [engine_process.url]}})
    provider = provider_of(snap)

    async def scenario() -> None:
        async with InferenceClient(
            snapshot_provider=provider, ttl=60, timeout=120, stream_idle_timeout=0.5
        ) as client:
            received = b""
            with pytest.raises(RequestNotReplayedError) as info:
                async with client.stream(
                    "/generate",
                    {"text": "x", "stream": True},
                    headers={"X-Test-Mode": "hang-stream"},
                    request_id="s-1",
                ) as resp:
                    async for chunk in resp.iter_chunks():
                        if not received:
                            # The engine stops dead; the kernel keeps its socket open.
                            engine_process.proc.send_signal(signal.SIGSTOP)
                        received += chunk
            assert received.startswith(b"data: {")
            err = info.value
            assert err.status == 504 and err.request_id == "s-1"
            assert "sent nothing for 0.5s in the middle of its streamed answer" in err.message
            assert "stream_idle_timeout" in err.message
            assert client.inflight == {}
            await client.snapshot()  # the failure invalidated the snapshot: fetched again
            assert provider.calls == 2

    asyncio.run(scenario())


def test_the_first_event_may_take_longer_than_the_idle_limit_unless_limited_itself(
    engine_process: Any,
) -> None:
    snap = gs.snapshot("rollout", {"policy": {"urls": [engine_process.url]}})

    async def read(client: InferenceClient, **limits: float) -> bytes:
        async with client.stream(
            "/generate",
            {"text": "x", "stream": True, "sampling_params": {"max_new_tokens": 2}},
            headers={"X-Test-Mode": "first-event-after:1.0"},
            **limits,
        ) as resp:
            return b"".join([chunk async for chunk in resp.iter_chunks()])

    async def scenario() -> None:
        async with InferenceClient(
            snapshot_provider=lambda: snap, stream_idle_timeout=0.3
        ) as client:
            # Queueing and prefill before the first event are not idleness mid-stream.
            assert (await read(client)).endswith(b"data: [DONE]\n\n")
            with pytest.raises(RequestNotReplayedError) as info:
                await read(client, stream_first_chunk_timeout=0.3)
            assert info.value.status == 504
            assert "before its first chunk" in info.value.message
            assert "stream_first_chunk_timeout" in info.value.message
            # math.inf lifts the client's limit for one request.
            assert (await read(client, stream_idle_timeout=math.inf)).endswith(b"[DONE]\n\n")

    asyncio.run(scenario())


def test_idle_limits_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stream_idle_timeout=0"):
        InferenceClient(snapshot_provider=dict, stream_idle_timeout=0)
    with pytest.raises(ValueError, match="stream_first_chunk_timeout=-1"):
        InferenceClient(snapshot_provider=dict, stream_first_chunk_timeout=-1)
