"""A model served by external engines: heads given by URL, never started or stopped here.

The heads are real worker processes this test starts itself, as someone else would (the PD
test backend's worker of ``tests/support/pd_backend.py`` in its regular mode: it answers
``/health_generate`` and ``/generate``). The role service, its router (the real smg) and its
publisher are real; no Ray is needed, there is nothing to place.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import pytest

from relax_core.config import loads_config
from relax_core.engine.process import SubprocessEngineProcess
from relax_core.errors import CapabilityError
from relax_core.jobs import RoleService, build_role_service, check_job
from relax_core.manager import ReplicaPlacement
from relax_core.manager.external import ExternalEngines
from relax_core.plugins import PluginManager
from relax_core.testing import free_port
from tests.support.manager import http

pytestmark = pytest.mark.slow


def _head(port: int) -> SubprocessEngineProcess:
    proc = SubprocessEngineProcess.start(
        [sys.executable, "-m", "tests.support.pd_backend", str(port), "null", "0"],
        base_url=f"http://127.0.0.1:{port}",
        engine_id=f"external-{port}",
    )
    proc.wait_ready(30)
    return proc


@pytest.fixture
def heads() -> Iterator[list[SubprocessEngineProcess]]:
    started = [_head(free_port()), _head(free_port())]
    yield started
    for proc in started:
        proc.kill()


def _service(heads: list[SubprocessEngineProcess], extra: str = "") -> RoleService:
    urls = ", ".join(f'"{h.base_url}"' for h in heads)
    config = loads_config(f"[roles.rollout.models.policy]\nexternal_urls = [{urls}]\n{extra}")
    assert check_job(config, PluginManager.create()) == []
    return build_role_service(
        config.role("rollout"),
        plugin_manager=PluginManager.create(),
        placements={"policy": ReplicaPlacement.unplaced(len(heads))},
    )


def _generate(url: str) -> int:
    return http(
        "POST", url + "/generate", {"text": "hi", "sampling_params": {"max_new_tokens": 1}}
    )[0]


def test_external_heads_are_published_registered_failed_and_back_by_health_generate_alone(
    heads: list[SubprocessEngineProcess],
) -> None:
    service = _service(heads)
    try:
        service.start()
        external = service.managers["policy"]
        assert isinstance(external, ExternalEngines)
        model = service.snapshot().models["policy"]
        router = service.routers["policy"]
        assert model.state.value == "READY" and model.router_url == router.url
        assert [(e.engine_id, e.state.value, e.base_url) for e in model.engines] == [
            ("policy/external-0", "READY", heads[0].base_url),
            ("policy/external-1", "READY", heads[1].base_url),
        ]
        assert set(router.workers()) == {"policy/external-0", "policy/external-1"}
        assert external.engine_pids() == {"policy/external-0": [], "policy/external-1": []}

        # A head that stops answering: FAILED, unpublished, out of the router.
        port = int(str(heads[1].base_url).rsplit(":", 1)[1])
        heads[1].kill()
        report = external.health_check()
        assert not report.by_engine["policy/external-1"].healthy
        engine = service.snapshot().models["policy"].engines[1]
        assert engine.state.value == "FAILED" and engine.base_url is None
        assert set(router.workers()) == {"policy/external-0"}
        assert [_generate(router.url) for _ in range(4)] == [200] * 4

        # It answers again (its owner restarted it): READY, a new generation, routed again.
        heads[1] = _head(port)
        assert external.health_check().healthy
        engine = service.snapshot().models["policy"].engines[1]
        assert engine.state.value == "READY" and engine.generation == 2
        assert set(router.workers()) == {"policy/external-0", "policy/external-1"}
    finally:
        assert service.shutdown() == []
    # Shutting the service down stopped publishing them; the engines themselves still run.
    assert all(h.poll() is None for h in heads)
    assert service.routers["policy"].pids() == []


@pytest.mark.parametrize(
    ("operation", "args"),
    [
        ("onload", ()),
        ("offload", ()),
        ("update_weights_from_disk", ("/ckpt",)),
        ("update_weights_from_tensor", ([],)),
        ("scale_out", ()),
        ("recover", ()),
    ],
)
def test_lifecycle_and_weight_updates_of_external_engines_are_refused_saying_so(
    heads: list[SubprocessEngineProcess], operation: str, args: Any
) -> None:
    service = _service(heads, 'route_mode = "DIRECT"\n')
    try:
        service.start()
        with pytest.raises(CapabilityError, match=rf"external engines .*: {operation} is refused"):
            getattr(service.managers["policy"], operation)(*args)
        # DIRECT: the heads themselves are published for routing.
        assert all(e.direct_eligible for e in service.snapshot().models["policy"].engines)
    finally:
        assert service.shutdown() == []
