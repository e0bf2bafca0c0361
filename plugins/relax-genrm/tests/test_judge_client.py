"""The judge client's connections to a genrm gateway: reused while idle below its keep-alive
limit, never past it (a real uvicorn server on loopback; a connection is told apart by the
client's source port)."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterator
from typing import Any

import pytest
from relax_genrm import JudgeClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from relax_core.testing import serve_app

#: The role gateway's uvicorn keep-alive (docs/reliability.md, "Keep-alive, pair by pair").
GATEWAY_KEEPALIVE = 30.0

MESSAGES = [{"role": "user", "content": "is 2 + 2 = 4?"}]


@pytest.fixture
def gateway() -> Iterator[tuple[str, list[int]]]:
    """A stand-in genrm gateway that answers every judgement "yes" and records, per request,
    the client port of its connection."""
    ports: list[int] = []

    async def generate(request: Request) -> JSONResponse:
        assert request.client is not None
        ports.append(request.client.port)
        return JSONResponse({"response": "yes"})

    app = Starlette(routes=[Route("/genrm/generate", generate, methods=["POST"])])
    with serve_app(app, timeout_keep_alive=GATEWAY_KEEPALIVE) as url:
        yield url, ports


def _judge_twice(url: str, idle: float, **options: Any) -> None:
    async def scenario() -> None:
        async with JudgeClient(url, **options) as client:
            assert await client.judge(MESSAGES) == "yes"
            await asyncio.sleep(idle)  # the idle time is what is tested
            assert await client.judge(MESSAGES) == "yes"

    asyncio.run(scenario())


def test_the_judge_client_reuses_a_connection_idle_below_its_keepalive_limit(
    gateway: tuple[str, list[int]],
) -> None:
    url, ports = gateway
    _judge_twice(url, 0.0)
    assert len(ports) == 2 and ports[0] == ports[1], ports


def test_the_judge_client_never_reuses_a_connection_idle_past_its_keepalive_limit(
    gateway: tuple[str, list[int]],
) -> None:
    url, ports = gateway
    _judge_twice(url, 0.5, keepalive=0.1)
    assert len(ports) == 2 and ports[0] != ports[1], ports


def test_the_judge_clients_keepalive_is_below_the_gateways() -> None:
    # A judgement is a POST: aiohttp never sends it again when the gateway closed the idle
    # connection it was written to, so the order alone keeps that race away.
    default = inspect.signature(JudgeClient).parameters["keepalive"].default
    assert default < GATEWAY_KEEPALIVE


def test_the_judge_client_keeps_every_judgement_its_caller_sends_in_flight() -> None:
    # A reward stage bounds what is in flight (its ``concurrency``, up to the judge engines'
    # batch); the client must not queue part of it behind a connection cap of its own
    # (aiohttp's default, 100). The gateway answers only once WANTED requests are open at
    # once, so a cap below that would leave them waiting until the deadline.
    wanted = 160
    open_now = 0
    all_open = asyncio.Event()

    async def generate(request: Request) -> JSONResponse:
        nonlocal open_now
        open_now += 1
        if open_now >= wanted:
            all_open.set()
        await asyncio.wait_for(all_open.wait(), timeout=10.0)
        return JSONResponse({"response": "yes"})

    app = Starlette(routes=[Route("/genrm/generate", generate, methods=["POST"])])

    async def scenario(url: str) -> list[str]:
        async with JudgeClient(url, timeout=60.0) as client:
            return await asyncio.gather(*(client.judge(MESSAGES) for _ in range(wanted)))

    with serve_app(app, timeout_keep_alive=GATEWAY_KEEPALIVE) as url:
        assert asyncio.run(scenario(url)) == ["yes"] * wanted
