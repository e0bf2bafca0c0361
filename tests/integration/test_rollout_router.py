"""A rollout model behind the real sglang-router 0.3.2 and smg 1.13, under the InferenceManager.

Real Ray, real hf engines on CPU (each behind its admission server), the router process the
relax-sglang plugin runs. For each router, one manager of two replicas goes through, in order:
registration once READY, stickiness of ``X-SMG-Routing-Key`` (straight to the router, through the
InferenceClient and through the rollout gateway), a killed engine removed and no longer sent
traffic, a FAILED (stopped) replica removed before its engine is stopped, scale-out registering
the new head, scale-in removing a head before its engine stops. The tests of a module share
that manager (starting engines is the slow part) and each leaves it with every replica READY.

The membership the manager drives is wrapped in :class:`Recording`, which notes for every head
it removes whether that head's engine process was still running at that moment.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import urllib.request
from collections.abc import Iterator, Mapping
from typing import Any

import attrs
import pytest

from relax_core.client.client import InferenceClient
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoutingSpec
from relax_core.engine.spec import InferenceEngineSpec
from relax_core.gateway.serving import start_thread_gateway
from relax_core.manager import InferenceManager, ManagerTimeouts, ModelLaunch, ReplicaPlacement
from relax_core.plugins import PluginManager
from relax_core.records import RouterLaunchSpec, RouterProcess
from tests.support.manager import force_cleanup, http, pid_alive, tiny_model

pytestmark = [pytest.mark.ray, pytest.mark.slow]

#: What sglang-router 0.3.2 drops of the fields the roles send (allowed here so it starts).
DROPPED_BY_0_3_2 = (
    "return_routed_experts",
    "sampling_params.custom_params",
    "sampling_params.logit_bias",
    "sampling_params.spaces_between_special_tokens",
    "sampling_params.stop_regex",
    "sampling_params.stream_interval",
    "sampling_params.structural_tag",
)
#: The policy each router is sticky on X-SMG-Routing-Key with.
STICKY = {"sglang-router": "manual", "smg": "consistent_hashing"}
TIMEOUTS = ManagerTimeouts(
    start=120.0, offload=20.0, onload=30.0, drain=10.0, health=4.0, shutdown=3.0
)
GREEDY = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}
#: The manager's default: failed probes in a row before a live replica is FAILED.
UNHEALTHY_AFTER = 3


class Recording:
    """The router's membership, noting ``(engine id, engine still running)`` per removal."""

    def __init__(self, router: RouterProcess) -> None:
        self.router = router
        self.manager: InferenceManager | None = None
        self.removed: list[tuple[str, bool]] = []
        self.heads: dict[str, str] = {}

    def sync(self, heads: Mapping[str, str]) -> None:
        assert self.manager is not None
        pids = self.manager.engine_pids()  # the manager's lock is held by this very thread
        for engine_id in set(self.heads) - set(heads):
            running = any(pid_alive(p) for p in pids.get(engine_id, []))
            self.removed.append((engine_id, running))
        self.heads = dict(heads)
        self.router.sync(heads)


@attrs.define
class Routed:
    kind: str
    router: Any
    recording: Recording
    manager: InferenceManager
    publisher: RegistryPublisher
    stopped: list[int] = attrs.Factory(list)


@pytest.fixture(scope="module", params=sorted(STICKY))
def routed(
    request: pytest.FixtureRequest, ray_local: Any, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Routed]:
    kind = request.param
    pm = PluginManager.create()
    model = tiny_model()
    router = pm.router(kind).launch(
        RouterLaunchSpec(
            router_id="roles.rollout.models.policy",
            policy=STICKY[kind],
            allow_dropped_fields=DROPPED_BY_0_3_2 if kind == "sglang-router" else (),
            served_model_name="policy",
            model_path=model,
            log_path=str(tmp_path_factory.mktemp(kind) / "router.log"),
        )
    )
    recording = Recording(router)
    publisher = RegistryPublisher(
        "rollout",
        RoutingSpec(default_model="policy"),
        weight_sources=pm.registered("weight_sources"),
    )
    manager = InferenceManager(
        "policy",
        spec=InferenceEngineSpec(role="rollout", weight_source=pm.weight_source("ACTOR")),
        backend=pm.engine_backend("hf"),
        launch=ModelLaunch(model_path=model, served_model_name="policy", seed=0),
        placement=ReplicaPlacement.unplaced(2),
        publisher=publisher,
        route_mode="SGLANG_ROUTER",
        router_url=router.url,
        router=recording,
        timeouts=TIMEOUTS,
    )
    recording.manager = manager
    routed = Routed(kind, router, recording, manager, publisher)
    try:
        router.wait_ready(60)
        manager.start().raise_for_failures()
        yield routed
    finally:
        force_cleanup(manager, routed.stopped)
        router.terminate(2)


def _heads(routed: Routed) -> dict[str, str]:
    model = routed.publisher.snapshot().models["policy"]
    return {e.engine_id: e.base_url for e in model.engines if e.base_url}


def _routable(routed: Routed) -> set[str]:
    _, answer, _ = http("GET", routed.router.url + "/workers")
    return {
        w["url"]
        for w in answer["workers"]
        if w.get("is_healthy") and w.get("status", "ready") != "draining"
    }


def _served(url: str) -> int:
    """Generations a head has run (its engine's Prometheus counter)."""
    _, text, _ = http("GET", url + "/metrics")
    return int(float(re.search(r"sglang:num_requests_total\{[^}]*\} (\S+)", text).group(1)))


def _served_by(routed: Routed) -> dict[str, int]:
    return {engine_id: _served(url) for engine_id, url in _heads(routed).items()}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def _generate_through_router(routed: Routed, key: str | None = None) -> int:
    headers = {"X-SMG-Routing-Key": key} if key else {}
    req = urllib.request.Request(
        routed.router.url + "/generate",
        data=json.dumps({"text": "hello", "sampling_params": GREEDY}).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return int(resp.status)


def _all_ready(routed: Routed) -> None:
    states = routed.manager.states()
    assert set(states.values()) == {"READY"}, states
    assert set(routed.router.workers()) == set(states)
    assert _routable(routed) == set(_heads(routed).values())


def test_heads_are_registered_once_ready_and_the_router_url_is_published(routed: Routed) -> None:
    model = routed.publisher.snapshot().models["policy"]
    assert model.state.value == "READY" and model.router_url == routed.router.url
    assert model.route_mode.value == "SGLANG_ROUTER"
    assert set(_heads(routed)) == {"policy/replica-0", "policy/replica-1"}
    _all_ready(routed)
    before = _served_by(routed)
    assert [_generate_through_router(routed) for _ in range(4)] == [200] * 4
    assert sum(_delta(before, _served_by(routed)).values()) == 4


def test_the_routing_key_is_sticky_through_the_router_the_client_and_the_gateway(
    routed: Routed,
) -> None:
    before = _served_by(routed)
    for _ in range(5):
        assert _generate_through_router(routed, key="group-7") == 200
    direct = _delta(before, _served_by(routed))
    assert list(direct.values()) == [5], direct  # one head took all five

    async def through_client() -> None:
        async with InferenceClient(snapshot_provider=routed.publisher.snapshot) as client:
            for _ in range(5):
                await client.generate(
                    {"text": "hello", "sampling_params": GREEDY}, affinity_key="group-7"
                )

    before = _served_by(routed)
    asyncio.run(through_client())
    assert _delta(before, _served_by(routed)) == direct  # the same head, through the router

    pm = PluginManager.create()
    gateway = start_thread_gateway("rollout", routed.publisher.snapshot, plugin_manager=pm)
    try:
        before = _served_by(routed)
        for _ in range(5):
            status, _, _ = _gateway_generate(gateway.url, "group-7")
            assert status == 200
        assert _delta(before, _served_by(routed)) == direct
    finally:
        gateway.stop()


def _gateway_generate(url: str, key: str) -> tuple[int, Any, dict[str, str]]:
    req = urllib.request.Request(
        f"{url}/rollout/generate",
        data=json.dumps({"text": "hello", "sampling_params": GREEDY}).encode(),
        headers={"Content-Type": "application/json", "X-SMG-Routing-Key": key},
    )
    with urllib.request.urlopen(req, timeout=60) as resp:
        return int(resp.status), None, dict(resp.headers)


def test_a_killed_engine_leaves_the_router_and_gets_no_more_traffic(routed: Routed) -> None:
    pid = routed.manager.engine_pids()["policy/replica-1"][0]
    os.kill(pid, signal.SIGKILL)
    report = routed.manager.health_check(recover=False)
    assert not report.by_engine["policy/replica-1"].healthy
    assert routed.recording.removed[-1][0] == "policy/replica-1"
    assert set(routed.router.workers()) == {"policy/replica-0"}
    alive = _heads(routed)["policy/replica-0"]
    assert _routable(routed) == {alive}
    before = _served(alive)
    assert [_generate_through_router(routed) for _ in range(6)] == [200] * 6
    assert _served(alive) - before == 6
    # Rebuilt: a new engine behind a new URL, registered again.
    routed.manager.recover().raise_for_failures()
    _all_ready(routed)


def test_a_failed_replica_leaves_the_router_before_its_engine_is_stopped(routed: Routed) -> None:
    pid = routed.manager.engine_pids()["policy/replica-0"][0]
    os.kill(pid, signal.SIGSTOP)  # alive, but its health check times out
    routed.stopped.append(pid)
    removed = len(routed.recording.removed)
    # A live engine is allowed a few failed probes: until then it stays READY and registered.
    for _ in range(UNHEALTHY_AFTER - 1):
        report = routed.manager.health_check(recover=True)
        assert report.by_engine["policy/replica-0"].action == "suspect", report
        assert routed.recording.removed[removed:] == []
        assert "policy/replica-0" in routed.router.workers()
    report = routed.manager.health_check(recover=True)
    assert report.by_engine["policy/replica-0"].action == "rebuilt", report
    assert routed.recording.removed[removed:] == [("policy/replica-0", True)]
    assert not pid_alive(pid)  # stopped (SIGKILL reaches a stopped process) after its removal
    _all_ready(routed)


def test_scale_out_registers_the_new_head(routed: Routed) -> None:
    routed.manager.scale_out(count=1).raise_for_failures()
    assert "policy/replica-2" in routed.router.workers()
    _all_ready(routed)


def test_scale_in_removes_the_head_from_the_router_before_its_engine_stops(
    routed: Routed,
) -> None:
    pid = routed.manager.engine_pids()["policy/replica-2"][0]
    removed = len(routed.recording.removed)
    routed.manager.scale_in(count=1).raise_for_failures()
    assert routed.recording.removed[removed:] == [("policy/replica-2", True)]
    assert not pid_alive(pid)
    assert set(routed.router.workers()) == {"policy/replica-0", "policy/replica-1"}
    _all_ready(routed)
