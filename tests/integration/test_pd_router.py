"""A prefill/decode model under the role service: its workers register with the router in PD
mode by their kind, requests reach one prefill and one decode worker through it, and no PD
worker ever appears in schema 2 or schema 1.

Real Ray, manager, admission servers, the real sglang-router and smg in PD mode; the workers are
the PD test backend of ``tests/support/pd_backend.py`` (on CPU nothing can really move a KV
cache from a prefill to a decode server; that backend says why it stands in).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from relax_core.config import loads_config
from relax_core.engine.control import ControlClient
from relax_core.jobs import RoleService, build_role_service
from relax_core.manager import ReplicaPlacement
from relax_core.plugins import PluginManager, module_plugin
from relax_core.records import EngineBackend
from tests.support import pd_backend
from tests.support.manager import http

pytestmark = [pytest.mark.ray, pytest.mark.slow]

JOB = """\
[roles.rollout.models.policy]
backend = "pd-test"
device = "cpu"
model_path = "policy"
num_engines = 3
pd_prefill_engines = 1
router = "{router}"
router_policy = "round_robin"
{allow}
"""
#: What each router drops in PD mode (its field probe finds them; allowed so it starts at all):
#: sglang-router 0.3.2 what it always drops, smg 1.13 the sampling parameters its PD path knows
#: nothing of.
_SMG_PD = [
    "sampling_params.logit_bias",
    "sampling_params.spaces_between_special_tokens",
    "sampling_params.stop_regex",
    "sampling_params.stream_interval",
    "sampling_params.structural_tag",
]
ALLOW = {
    "sglang-router": [*_SMG_PD, "return_routed_experts", "sampling_params.custom_params"],
    "smg": _SMG_PD,
}


def _workers(url: str) -> list[dict[str, Any]]:
    """The router's routable workers (smg lists the field probe's own workers a few seconds
    longer, draining)."""
    _, answer, _ = http("GET", url + "/workers")
    return [w for w in answer["workers"] if w.get("status", "ready") != "draining"]


def _plugins() -> PluginManager:
    def backends(register: Any) -> None:
        register(
            EngineBackend(
                name="pd-test",
                launch=pd_backend.launch,
                control_client=ControlClient,
                devices={"cpu"},
            )
        )

    return PluginManager.create(
        plugins=[("pd-test", module_plugin("pd-test", relax_register_engine_backends=backends))]
    )


@pytest.fixture(scope="module", params=["sglang-router", "smg"])
def pd_service(request: pytest.FixtureRequest, ray_local: Any) -> Iterator[RoleService]:
    allow = f"router_allow_dropped_fields = {json.dumps(ALLOW[request.param])}"
    config = loads_config(JOB.format(router=request.param, allow=allow))
    service = build_role_service(
        config.role("rollout"),
        plugin_manager=_plugins(),
        placements={"policy": ReplicaPlacement.unplaced(3)},
    )
    try:
        service.start()
        yield service
    finally:
        assert service.shutdown() == []


def test_pd_workers_are_never_published_only_the_model_and_its_router(
    pd_service: RoleService,
) -> None:
    snapshot = pd_service.snapshot()
    model = snapshot.models["policy"]
    router = pd_service.routers["policy"]
    assert model.state.value == "READY" and model.router_url == router.url
    assert model.engines == ()
    assert snapshot.schema1() == {"engines": []}
    assert set(pd_service.managers["policy"].states().values()) == {"READY"}


def test_pd_workers_register_with_the_router_as_their_kind_with_the_prefill_bootstrap_port(
    pd_service: RoleService,
) -> None:
    router = pd_service.routers["policy"]
    workers = _workers(router.url)
    kinds = sorted(w["worker_type"] for w in workers)
    assert kinds == ["decode", "decode", "prefill"], workers
    assert all(w["is_healthy"] for w in workers)
    prefill = next(w for w in workers if w["worker_type"] == "prefill")
    _, info, _ = http("GET", prefill["url"] + "/server_info")
    assert prefill["bootstrap_port"] == info["disaggregation_bootstrap_port"] > 0


def test_a_request_through_the_router_reaches_one_prefill_and_one_decode_worker(
    pd_service: RoleService,
) -> None:
    router = pd_service.routers["policy"]
    status, answer, _ = http(
        "POST",
        router.url + "/generate",
        {"text": "hi", "rid": "pd-1", "sampling_params": {"max_new_tokens": 1}},
    )
    assert status == 200, answer
    got: dict[str, list[dict[str, Any]]] = {}
    for w in _workers(router.url):
        _, info, _ = http("GET", w["url"] + "/server_info")
        for entry in info["seen"]:
            if entry["rid"] == "pd-1":
                got.setdefault(w["worker_type"], []).append(entry)
    assert sorted((k, len(v)) for k, v in got.items()) == [("decode", 1), ("prefill", 1)], got
    # Both halves were told where the KV cache comes from: the same bootstrap room.
    (pre,), (dec,) = got["prefill"], got["decode"]
    assert pre["bootstrap_room"] == dec["bootstrap_room"] is not None
    assert pre["bootstrap_port"] == dec["bootstrap_port"]
