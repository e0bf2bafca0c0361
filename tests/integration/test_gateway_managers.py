"""Role gateways in front of real hf engines under real InferenceManagers on a local Ray.

Each failure-semantics row that reaches the gateway is produced for real: the model put to
sleep by the manager (503 + Retry-After, nothing sent), the request deadline (504), the engine
process killed with SIGKILL mid-stream (truncated, not replayed, counted), and the registry the
gateway discovers through going away (503, gateway alive, not ready).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from relax_core import PluginManager
from relax_core.client import InferenceClient
from relax_core.gateway import InferenceGatewayHandler, adapter_for_role
from relax_core.gateway_app import GatewayServer, create_gateway_app
from relax_core.schema import RoutingSpec
from relax_core.service import RoleService

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _load(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ms = _load("manager_support")
gs = _load("gateway_support")


@pytest.fixture(scope="module")
def served(ray_local: Any) -> Iterator[tuple[RoleService, str, Any]]:
    """A teacher role service with one hf replica, and its gateway."""
    service = RoleService("teacher", RoutingSpec(default_model="math"))
    manager = ms.make_manager(model_id="math", role="teacher", publisher=service.publisher)
    service.add("math", manager, model_path=ms.tiny_model())
    with ms.managed(manager) as run:
        handler = InferenceGatewayHandler(
            "teacher",
            snapshot_provider=service.snapshot,
            adapter=adapter_for_role(PluginManager.create(), "teacher"),
            model_paths=service.model_paths,
            snapshot_ttl=0.0,
        )
        gateway = GatewayServer(create_gateway_app(handler)).start()
        try:
            yield service, gateway.url, run
        finally:
            gateway.stop()


def test_prefill_through_the_gateway_reaches_the_engine(
    served: tuple[RoleService, str, Any],
) -> None:
    _, url, _ = served
    status, _, body = gs.post(
        f"{url}/teacher/generate",
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


def test_deadline_is_504(served: tuple[RoleService, str, Any]) -> None:
    _, url, _ = served
    status, _, body = gs.post(
        f"{url}/teacher/generate",
        {"text": "hello", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}},
        {"X-Relax-Timeout": "0.2"},
    )
    assert status == 504, body
    assert "deadline" in json.loads(body)["error"]["message"]


def test_registry_unavailable_is_503_and_the_gateway_stays_alive(
    served: tuple[RoleService, str, Any],
) -> None:
    _, _url, _ = served
    # A second gateway that discovers through the first one's /teacher/engines.
    registry = GatewayServer(
        create_gateway_app(InferenceGatewayHandler("teacher", snapshot_provider=served[0].snapshot))
    ).start()
    handler = InferenceGatewayHandler(
        "teacher", client=InferenceClient(f"{registry.url}/teacher", role="teacher", ttl=0.0)
    )
    front = GatewayServer(create_gateway_app(handler)).start()
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


def test_sleeping_model_is_503_with_retry_after_until_onloaded(
    served: tuple[RoleService, str, Any],
) -> None:
    service, url, _ = served
    manager = service.managers["math"]
    assert manager.offload().ok
    try:
        status, headers, body = gs.post(f"{url}/teacher/generate", {"text": "hi"})
        assert status == 503 and int(headers["retry-after"]) >= 1, body
        assert service.snapshot().models["math"].state.value == "SLEEPING"
    finally:
        assert manager.onload().ok
    assert gs.post(f"{url}/teacher/generate", {"text": "hi"})[0] == 200


def test_engine_killed_mid_stream_truncates_and_is_not_replayed(
    served: tuple[RoleService, str, Any],
) -> None:
    _service, url, run = served
    pid = run.track()[0]

    async def go() -> tuple[bytes, bool]:
        got = b""
        async with aiohttp.ClientSession() as session:
            try:
                async with session.post(
                    f"{url}/teacher/generate",
                    json={
                        "text": "hi",
                        "stream": True,
                        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True},
                    },
                    # A bound: the admission proxy in front of the engine keeps the
                    # connection open after the engine dies (see the report), so the
                    # gateway deadline is what ends the relay here.
                    headers={"X-Relax-Timeout": "20"},
                ) as resp:
                    assert resp.status == 200
                    async for chunk in resp.content.iter_any():
                        if not got:
                            ms.signal_quietly(pid, signal.SIGKILL)
                        got += chunk
            except aiohttp.ClientPayloadError:
                return got, True
        return got, False

    started = time.monotonic()
    got, truncated = asyncio.run(go())
    print(f"stream ended {time.monotonic() - started:.1f}s after the kill")
    assert truncated and got.startswith(b"data: ") and b"[DONE]" not in got
    metrics = urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
    assert (
        'relax_gateway_upstream_errors_total{error="stream_aborted",role="teacher"} 1.0' in metrics
    )
    status, _, _ = gs.post(f"{url}/teacher/generate", {"text": "hi"})
    assert status in (502, 503)  # the dead head: unreachable, or already taken out of routing
