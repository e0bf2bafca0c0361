"""Manager liveness: a model whose manager is gone is published UNKNOWN (nothing routable).

The rules on plain callables first, then for real: a manager in a Ray actor publishing into
the role's registry actor, killed; the registry publishes its model UNKNOWN and a resolver
answers 503 for it.
"""

from __future__ import annotations

from typing import Any

import pytest

from relax_core.discovery.liveness import ManagerLiveness
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.routing import RouteResolver
from relax_core.discovery.schema import ModelState, RoutingSpec
from relax_core.errors import RoutingError
from relax_core.plugins import PluginManager
from relax_core.testing import wait_for


def publisher() -> RegistryPublisher:
    pub = RegistryPublisher("genrm", RoutingSpec(default_model="judge"))
    for model in ("judge", "other"):
        pub.set_model(
            model, state="READY", route_mode="DIRECT", weight_source="STATIC",
            served_model_name=model,
        )  # fmt: skip
        pub.set_engine(model, f"{model}/replica-0", base_url=f"http://{model}:1", state="READY")
    return pub


def test_a_dead_manager_makes_only_its_model_unknown_at_once() -> None:
    pub = publisher()
    liveness = ManagerLiveness(pub)
    liveness.watch("judge", lambda: False)
    liveness.watch("other", lambda: True)
    assert liveness.check() == {"judge": "gone", "other": "alive"}
    snap = pub.snapshot()
    assert snap.models["judge"].state is ModelState.UNKNOWN
    assert not snap.models["judge"].engines[0].direct_eligible
    assert snap.models["other"].state is ModelState.READY
    assert liveness.watching() == ["other"]
    with pytest.raises(RoutingError) as info:
        RouteResolver(PluginManager.create(entry_points=False)).resolve(snap, model="judge")
    assert info.value.status == 503 and "UNKNOWN" in info.value.message


def test_a_manager_that_stops_answering_is_unknown_after_misses_and_republishes_when_back() -> None:
    pub = publisher()
    answering = {"now": False}
    republished = []

    def ping() -> bool:
        if not answering["now"]:
            raise TimeoutError("no answer within 10 s")
        return True

    def republish() -> None:
        republished.append(1)
        pub.set_model_state("judge", "READY")

    liveness = ManagerLiveness(pub, misses=2)
    liveness.watch("judge", ping, republish=republish)
    assert liveness.check() == {"judge": "missed"}
    assert pub.snapshot().models["judge"].state is ModelState.READY  # one miss is not enough
    liveness.check()
    assert pub.snapshot().models["judge"].state is ModelState.UNKNOWN
    answering["now"] = True
    assert liveness.check() == {"judge": "alive"} and republished == [1]
    assert pub.snapshot().models["judge"].state is ModelState.READY
    liveness.check()
    assert republished == [1]  # republished once, not every round


@pytest.mark.ray
def test_a_killed_manager_actor_makes_its_model_unknown_in_the_registry(ray_local: Any) -> None:
    from relax_bench.manager import SIM_BACKEND

    from relax_core.builtins import STATIC
    from relax_core.discovery.actor import start_registry_actor
    from relax_core.engine.spec import InferenceEngineSpec
    from relax_core.manager import ModelLaunch, ReplicaPlacement
    from relax_core.manager.actor import start_manager_actor
    from tests.support.manager import pid_alive

    registry = start_registry_actor(
        "genrm", RoutingSpec(default_model="judge"), liveness_interval=0.2
    )
    actor = start_manager_actor(
        "judge",
        spec=InferenceEngineSpec(role="genrm", weight_source=STATIC),
        backend=SIM_BACKEND,
        launch=ModelLaunch(model_path="sim", served_model_name="judge"),
        placement=ReplicaPlacement.unplaced(1),
        publisher=registry,
    )
    pids: list[int] = []
    try:
        ray_local.get(actor.start.remote(), timeout=120).raise_for_failures()
        pids = [p for ps in ray_local.get(actor.engine_pids.remote()).values() for p in ps if p]
        assert registry.snapshot().models["judge"].state is ModelState.READY
        ray_local.kill(actor, no_restart=True)
        wait_for(
            lambda: registry.snapshot().models["judge"].state is ModelState.UNKNOWN,
            timeout=30,
            what="the dead manager's model published UNKNOWN",
        )
        (head,) = registry.snapshot().models["judge"].engines
        assert head.state is ModelState.UNKNOWN and not head.direct_eligible
    finally:
        ray_local.kill(actor, no_restart=True)
        registry.stop()
        # The manager's worker actors die with it, and their reapers take the engines.
        wait_for(lambda: not any(pid_alive(p) for p in pids), timeout=30, what="engines gone")
