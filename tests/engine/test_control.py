"""ControlClient error mapping and fallbacks.

The upstream is a real uvicorn server on loopback that answers the way an engine can (a 404 for
a renamed route, ``success: false`` with a 200, a slow answer, a busy flush); the hf plugin's
tests drive the same client against real hf engines.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from relax_core.engine.control import ControlClient
from relax_core.engine.tags import TAG_ORDER
from relax_core.errors import LifecycleError, UpstreamError
from relax_core.testing import free_port, serve_app


class Engine:
    def __init__(self) -> None:
        self.busy_flushes = 2
        self.bodies: dict[str, Any] = {}

    def app(self) -> Starlette:
        async def get_model_info(request: Request) -> Response:
            return JSONResponse({"model_path": "m", "weight_version": "v3"})

        async def health(request: Request) -> Response:
            return JSONResponse({"message": "scheduler is stuck"}, status_code=503)

        async def flush(request: Request) -> Response:
            if self.busy_flushes:
                self.busy_flushes -= 1
                return JSONResponse(
                    {"success": False, "message": "2 requests pending"}, status_code=400
                )
            return JSONResponse({"success": True, "message": "flushed"})

        async def release(request: Request) -> Response:
            self.bodies["release"] = await request.json()
            return JSONResponse({"success": False, "message": "requests are running"})

        async def resume(request: Request) -> Response:
            self.bodies["resume"] = await request.json()
            return JSONResponse({"success": True, "message": "ok"})

        async def slow(request: Request) -> Response:
            await asyncio.sleep(1.5)
            return Response()

        async def abort(request: Request) -> Response:
            self.bodies["abort"] = await request.json()
            return JSONResponse({"success": True})

        async def from_disk(request: Request) -> Response:
            self.bodies["disk"] = await request.json()
            return JSONResponse({"success": True, "message": "loaded"})

        return Starlette(
            routes=[
                Route("/get_model_info", get_model_info),
                Route("/health", health),
                Route("/health_generate", slow),
                Route("/flush_cache", flush, methods=["POST"]),
                Route("/release_memory_occupation", release, methods=["POST"]),
                Route("/resume_memory_occupation", resume, methods=["POST"]),
                Route("/abort_request", abort, methods=["POST"]),
                Route("/update_weights_from_disk", from_disk, methods=["POST"]),
            ]
        )


@pytest.fixture
def engine() -> Iterator[tuple[Engine, str]]:
    eng = Engine()
    with serve_app(eng.app()) as url:
        yield eng, url


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_model_info_falls_back_to_the_old_route(engine: tuple[Engine, str]) -> None:
    async def go() -> Any:
        async with ControlClient(engine[1]) as c:
            return await c.model_info(), await c.weight_version()

    info, version = run(go())
    assert info["model_path"] == "m" and version == "v3"


def test_a_failed_probe_raises_upstream_error_with_the_servers_message(
    engine: tuple[Engine, str],
) -> None:
    async def go() -> None:
        async with ControlClient(engine[1]) as c:
            assert await c.is_healthy() is False
            await c.health()

    with pytest.raises(UpstreamError) as info:
        run(go())
    assert info.value.status == 502
    assert f"{engine[1]}/health answered 503: scheduler is stuck" in str(info.value)


def test_success_false_raises_lifecycle_error_naming_the_url(engine: tuple[Engine, str]) -> None:
    async def go() -> None:
        async with ControlClient(engine[1]) as c:
            await c.release_memory(["weights"])

    with pytest.raises(
        LifecycleError, match=r"release_memory_occupation failed at http://.*: requests are running"
    ):
        run(go())
    assert engine[0].bodies["release"] == {"tags": ["weights"]}


def test_none_tags_mean_all_and_unknown_tags_fail_before_any_request(
    engine: tuple[Engine, str],
) -> None:
    async def go() -> None:
        async with ControlClient(engine[1]) as c:
            await c.resume_memory(None)
            with pytest.raises(ValueError, match="unknown memory tags"):
                await c.resume_memory(["weights", "vram"])

    run(go())
    assert engine[0].bodies["resume"] == {"tags": None}
    assert TAG_ORDER == ("weights", "kv_cache", "cuda_graph")


def test_flush_cache_retries_a_busy_engine_until_wait_runs_out(engine: tuple[Engine, str]) -> None:
    async def go() -> Any:
        async with ControlClient(engine[1]) as c:
            with pytest.raises(
                LifecycleError, match=r"flush_cache refused .*400.*2 requests pending"
            ):
                await c.flush_cache()
            return await c.flush_cache(wait=10)

    assert run(go())["message"] == "flushed"
    assert engine[0].busy_flushes == 0


def test_abort_without_rid_aborts_everything(engine: tuple[Engine, str]) -> None:
    async def go() -> None:
        async with ControlClient(engine[1]) as c:
            await c.abort()

    run(go())
    assert engine[0].bodies["abort"] == {"rid": "", "abort_all": True}


def test_weight_update_sends_sglangs_fields_with_defaults_and_refuses_unknown_options(
    engine: tuple[Engine, str],
) -> None:
    async def go() -> None:
        async with ControlClient(engine[1]) as c:
            assert (await c.update_weights_from_disk("/ckpt", weight_version="v9"))["success"]
            with pytest.raises(TypeError, match=r"unknown weight-update options \['flush_cach'\]"):
                await c.update_weights_from_disk("/ckpt", flush_cach=False)  # type: ignore[call-arg]

    run(go())
    assert engine[0].bodies["disk"] == {
        "model_path": "/ckpt",
        "load_format": None,
        "flush_cache": True,
        "abort_all_requests": False,
        "weight_version": "v9",
    }


def test_a_deadline_raises_504_and_an_unreachable_engine_502(engine: tuple[Engine, str]) -> None:
    async def go() -> None:
        async with ControlClient(engine[1], timeout=0.3) as c:
            with pytest.raises(UpstreamError) as slow:
                await c.health_generate()
            assert slow.value.status == 504 and "no answer within 0.3s" in str(slow.value)
        dead = f"http://127.0.0.1:{free_port()}"
        async with ControlClient(dead) as c:
            with pytest.raises(UpstreamError) as down:
                await c.server_info()
            assert down.value.status == 502 and dead in str(down.value)

    run(go())


def test_an_engine_closing_a_reused_idle_connection_as_a_post_arrives_fails_no_lifecycle_call() -> (
    None
):
    # The keep-alive race on the control channel: the engine closes the idle connection as the
    # next POST arrives, reading none of it; the POST goes again, once, on a new connection.
    from tests.support.stale_keepalive import StaleKeepAliveServer

    async def scenario(url: str) -> None:
        async with ControlClient(url, timeout=10) as client:
            for _ in range(3):
                assert await client.flush_cache() == {"ok": True}

    with StaleKeepAliveServer() as server:
        run(scenario(server.url))
        assert (server.requests_answered, server.requests_dropped) == (3, 2)
