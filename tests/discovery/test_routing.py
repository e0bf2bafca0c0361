"""RouteResolver: every branch of the reference routing flowchart, policies and error messages."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import attrs
import pytest

from relax_core.discovery.policies import rendezvous_order
from relax_core.discovery.routing import DEFAULT_RETRY_AFTER, RouteResolver, RouteTarget
from relax_core.discovery.schema import ModelState, RoleSnapshot, RouteMode
from relax_core.errors import RoutingError
from relax_core.plugins import PluginManager, module_plugin
from relax_core.records import RoutingPolicy


def engine(
    i: int, state: str = "READY", eligible: bool | None = None, gen: int = 1
) -> dict[str, Any]:
    url = None if state == "FAILED" else f"http://10.0.0.{i + 1}:30000"
    return {
        "engine_id": f"math/replica-{i}",
        "base_url": url,
        "state": state,
        "direct_eligible": (state == "READY") if eligible is None else eligible,
        "generation": gen,
    }


def snapshot(
    *,
    policy: str = "round_robin",
    default: str | None = "math",
    math_state: str = "READY",
    engines: list[dict[str, Any]] | None = None,
    epoch: str = "epoch-1",
) -> RoleSnapshot:
    return RoleSnapshot.from_json(
        {
            "schema_version": 2,
            "role": "teacher",
            "registry_epoch": epoch,
            "topology_revision": 7,
            "routing": {
                "default_model": default,
                "route_key_map": {"math-data": "math", "code-data": "code"},
                "aliases": {"teacher-checkpoint": "math"},
                "policy": policy,
                "policy_revision": 0,
            },
            "models": {
                "math": {
                    "state": math_state,
                    "route_mode": "DIRECT",
                    "router_url": None,
                    "weight_source": "STATIC",
                    "weight_version": None,
                    "served_model_name": "Qwen/Qwen3-0.6B",
                    "engines": [engine(i) for i in range(4)] if engines is None else engines,
                },
                "code": {
                    "state": "READY",
                    "route_mode": "SGLANG_ROUTER",
                    "router_url": "http://router:8080",
                    "weight_source": "STATIC",
                    "weight_version": None,
                    "served_model_name": "code-teacher",
                    "engines": [],
                },
            },
        }
    )


@pytest.fixture
def resolver(core_plugin_manager: PluginManager) -> RouteResolver:
    return RouteResolver(core_plugin_manager)


def status_of(call: Callable[[], object]) -> RoutingError:
    with pytest.raises(RoutingError) as info:
        call()
    return info.value


# -- model selection -------------------------------------------------------------------------


def test_explicit_model_id_selects_that_model(resolver: RouteResolver) -> None:
    target = resolver.resolve(snapshot(), model="code")
    assert target.model_id == "code"


def test_explicit_alias_selects_the_aliased_model(resolver: RouteResolver) -> None:
    target = resolver.resolve(snapshot(), model="teacher-checkpoint")
    assert target.model_id == "math"
    assert target.served_model_name == "Qwen/Qwen3-0.6B"


def test_unknown_model_is_400_listing_models_and_aliases(resolver: RouteResolver) -> None:
    err = status_of(lambda: resolver.resolve(snapshot(), model="chem"))
    assert err.status == 400
    assert err.retry_after is None
    assert 'unknown model "chem"' in err.message
    assert 'known models: "code", "math"' in err.message
    assert 'aliases: "teacher-checkpoint"' in err.message


def test_explicit_model_wins_over_route_key(resolver: RouteResolver) -> None:
    target = resolver.resolve(snapshot(), model="math", route_key="code-data")
    assert target.model_id == "math"


def test_route_key_selects_the_mapped_model(resolver: RouteResolver) -> None:
    assert resolver.resolve(snapshot(), route_key="code-data").model_id == "code"
    assert resolver.resolve(snapshot(), route_key="math-data").model_id == "math"


def test_unknown_route_key_is_400_listing_known_keys(resolver: RouteResolver) -> None:
    err = status_of(lambda: resolver.resolve(snapshot(), route_key="chem-data"))
    assert err.status == 400
    assert 'unknown route key "chem-data"' in err.message
    assert '"code-data", "math-data"' in err.message


def test_no_model_and_no_route_key_uses_the_default_model(resolver: RouteResolver) -> None:
    assert resolver.resolve(snapshot()).model_id == "math"


def test_no_default_model_is_400_saying_what_to_pass(resolver: RouteResolver) -> None:
    err = status_of(lambda: resolver.resolve(snapshot(default=None)))
    assert err.status == 400
    assert "has no default_model" in err.message
    assert 'pass model= one of "code", "math"' in err.message


# -- readiness -------------------------------------------------------------------------------


@pytest.mark.parametrize("state", [s for s in ModelState if s is not ModelState.READY])
def test_model_not_ready_is_503_with_retry_after(
    resolver: RouteResolver, state: ModelState
) -> None:
    snap = snapshot(math_state=state.value, engines=[engine(0, "SLEEPING")])
    err = status_of(lambda: resolver.resolve(snap, model="math"))
    assert err.status == 503
    assert err.retry_after == DEFAULT_RETRY_AFTER[state]
    assert f'model "math" of role "teacher" is {state.value}' in err.message
    assert f"retry after {DEFAULT_RETRY_AFTER[state]:g} s" in err.message


def test_model_not_ready_is_refused_even_if_a_head_still_looks_ready(
    resolver: RouteResolver,
) -> None:
    # The model state wins: a draining model gets no new requests, whatever its heads say.
    snap = snapshot(math_state="DRAINING", engines=[engine(0)])
    assert status_of(lambda: resolver.resolve(snap)).status == 503


def test_retry_after_can_be_configured(core_plugin_manager: PluginManager) -> None:
    resolver = RouteResolver(core_plugin_manager, retry_after={ModelState.SLEEPING: 42.0})
    err = status_of(lambda: resolver.resolve(snapshot(math_state="SLEEPING", engines=[])))
    assert err.retry_after == 42.0


def test_a_model_nothing_wakes_is_503_with_the_note_and_no_retry_after(
    core_plugin_manager: PluginManager,
) -> None:
    resolver = RouteResolver(core_plugin_manager, sleeping_note="served asleep; wake it yourself")
    err = status_of(lambda: resolver.resolve(snapshot(math_state="SLEEPING", engines=[])))
    assert err.status == 503 and err.retry_after is None
    assert "is SLEEPING and nothing will wake it: served asleep; wake it yourself" in err.message
    # Other states still promise what they will do.
    err = status_of(lambda: resolver.resolve(snapshot(math_state="ONLOADING", engines=[])))
    assert err.retry_after == DEFAULT_RETRY_AFTER[ModelState.ONLOADING]


# -- route mode ------------------------------------------------------------------------------


def test_router_mode_uses_the_model_router_url(resolver: RouteResolver) -> None:
    target = resolver.resolve(snapshot(), model="code", affinity_key="ignored-by-router")
    assert target == RouteTarget(
        role="teacher",
        model_id="code",
        url="http://router:8080",
        route_mode=RouteMode.SGLANG_ROUTER,
        engine_id=None,
        served_model_name="code-teacher",
        weight_version=None,
        generation=None,
        registry_epoch="epoch-1",
        topology_revision=7,
    )


def test_direct_target_carries_the_head_and_snapshot_identity(resolver: RouteResolver) -> None:
    snap = snapshot(engines=[engine(0, gen=5)])
    target = resolver.resolve(snap)
    assert target.route_mode is RouteMode.DIRECT
    assert target.engine_id == "math/replica-0"
    assert target.url == "http://10.0.0.1:30000"
    assert target.generation == 5
    assert (target.registry_epoch, target.topology_revision) == ("epoch-1", 7)


def test_direct_uses_only_ready_and_eligible_heads(resolver: RouteResolver) -> None:
    engines = [
        engine(0),
        engine(1, "SLEEPING"),
        engine(2, "READY", eligible=False),
        engine(3, "FAILED"),
        engine(4, "DRAINING"),
        engine(5),
    ]
    snap = snapshot(engines=engines)
    picked = Counter(resolver.resolve(snap).engine_id for _ in range(20))
    keyed = {resolver.resolve(snap, affinity_key=f"g{i}").engine_id for i in range(200)}
    assert set(picked) == {"math/replica-0", "math/replica-5"}
    assert keyed == {"math/replica-0", "math/replica-5"}


def test_direct_without_eligible_heads_is_503_with_retry_after(resolver: RouteResolver) -> None:
    snap = snapshot(engines=[engine(0, "ONLOADING"), engine(1, "READY", eligible=False)])
    err = status_of(lambda: resolver.resolve(snap))
    assert err.status == 503
    assert err.retry_after is not None and err.retry_after > 0
    assert "no READY direct-eligible replica" in err.message
    assert "1 ONLOADING, 1 READY" in err.message


def test_direct_model_with_no_heads_at_all_is_503(resolver: RouteResolver) -> None:
    err = status_of(lambda: resolver.resolve(snapshot(engines=[])))
    assert err.status == 503
    assert "(engines: none)" in err.message


# -- policy choice ---------------------------------------------------------------------------


def test_no_affinity_key_uses_process_local_round_robin(resolver: RouteResolver) -> None:
    snap = snapshot()
    picks = [resolver.resolve(snap).engine_id for _ in range(8)]
    assert picks == [f"math/replica-{i % 4}" for i in range(8)]


def test_affinity_key_uses_rendezvous_under_a_round_robin_policy(resolver: RouteResolver) -> None:
    snap = snapshot()
    ids = tuple(f"math/replica-{i}" for i in range(4))
    for i in range(50):
        key = f"group-{i}"
        expected = rendezvous_order("teacher", "math", ids, key)[0]
        assert resolver.resolve(snap, affinity_key=key).engine_id == expected
        assert resolver.resolve(snap, affinity_key=key).engine_id == expected


def test_no_affinity_key_falls_back_to_round_robin_under_an_affinity_policy(
    resolver: RouteResolver,
) -> None:
    snap = snapshot(policy="rendezvous")
    picks = [resolver.resolve(snap).engine_id for _ in range(4)]
    assert sorted(picks) == [f"math/replica-{i}" for i in range(4)]


def test_affinity_policy_named_by_the_snapshot_is_used(resolver: RouteResolver) -> None:
    snap = snapshot(policy="bounded_rendezvous")
    ids = tuple(f"math/replica-{i}" for i in range(4))
    order = rendezvous_order("teacher", "math", ids, "hot")
    assert resolver.resolve(snap, affinity_key="hot").engine_id == order[0]
    # Overloaded owner: bounded_rendezvous (not plain rendezvous) moves the key.
    inflight = {order[0]: 9}
    assert resolver.resolve(snap, affinity_key="hot", inflight=inflight).engine_id == order[1]
    plain = snapshot(policy="rendezvous")
    assert resolver.resolve(plain, affinity_key="hot", inflight=inflight).engine_id == order[0]


def test_round_robin_cursor_is_per_model_and_survives_snapshot_refresh(
    resolver: RouteResolver,
) -> None:
    first = [resolver.resolve(snapshot()).engine_id for _ in range(3)]
    # A refreshed snapshot of the same epoch continues the cursor.
    assert resolver.resolve(snapshot()).engine_id == "math/replica-3"
    assert first == ["math/replica-0", "math/replica-1", "math/replica-2"]
    # A new registry epoch restarts it.
    assert resolver.resolve(snapshot(epoch="epoch-2")).engine_id == "math/replica-0"


def test_unregistered_policy_is_503_naming_the_policy_and_the_fix(
    resolver: RouteResolver,
) -> None:
    snap = snapshot(policy="least_loaded")
    err = status_of(lambda: resolver.resolve(snap))
    assert err.status == 503
    assert 'policy "least_loaded"' in err.message
    assert "Install and enable the plugin that provides it" in err.message
    assert "(bounded_rendezvous, rendezvous, round_robin)" in err.message
    assert err.retry_after is None
    # Router-mode models do not use a DIRECT policy and keep working.
    assert resolver.resolve(snap, model="code").url == "http://router:8080"


def test_third_party_policy_from_a_plugin_is_used(core_plugin_manager: PluginManager) -> None:
    class LastHead:
        def select(self, *, candidates: tuple[Any, ...], **_: Any) -> Any:
            return candidates[-1]

    def relax_register_routing_policies(register: Callable[[RoutingPolicy], None]) -> None:
        register(RoutingPolicy(name="last", factory=LastHead))

    plugin = module_plugin("last", relax_register_routing_policies=relax_register_routing_policies)
    pm = PluginManager.create(entry_points=False, plugins=[("last", plugin)])
    resolver = RouteResolver(pm)
    snap = snapshot(policy="last")
    assert {resolver.resolve(snap).engine_id for _ in range(5)} == {"math/replica-3"}
    # An affinity request under a non-affinity policy still gets rendezvous.
    ids = tuple(f"math/replica-{i}" for i in range(4))
    expected = rendezvous_order("teacher", "math", ids, "k")[0]
    assert resolver.resolve(snap, affinity_key="k").engine_id == expected


def test_policy_that_returns_something_else_is_503(core_plugin_manager: PluginManager) -> None:
    @attrs.frozen
    class Broken:
        def select(self, **_: Any) -> Any:
            return "http://not-a-candidate:1"

    def relax_register_routing_policies(register: Callable[[RoutingPolicy], None]) -> None:
        register(RoutingPolicy(name="broken", factory=Broken))

    plugin = module_plugin("b", relax_register_routing_policies=relax_register_routing_policies)
    resolver = RouteResolver(PluginManager.create(entry_points=False, plugins=[("b", plugin)]))
    err = status_of(lambda: resolver.resolve(snapshot(policy="broken")))
    assert err.status == 503
    assert 'routing policy "broken" returned str' in err.message


def test_resolver_without_plugin_manager_uses_the_process_wide_one() -> None:
    assert RouteResolver().resolve(snapshot()).model_id == "math"


def test_resolving_reuses_prebuilt_targets(resolver: RouteResolver) -> None:
    snap = snapshot()
    first = [resolver.resolve(snap) for _ in range(4)]
    again = [resolver.resolve(snap) for _ in range(4)]
    assert all(a is b for a, b in zip(first, again, strict=True))


# -- agreement across processes --------------------------------------------------------------

_CHILD = """
import json, sys
from relax_core.discovery.routing import RouteResolver
from relax_core.discovery.schema import RoleSnapshot
snap = RoleSnapshot.from_json(sys.stdin.read())
resolver = RouteResolver()
print(json.dumps([resolver.resolve(snap, affinity_key=f"group-{i}").engine_id for i in range(64)]))
"""


def test_another_process_picks_the_same_affinity_targets(resolver: RouteResolver) -> None:
    # The gateway and direct clients run in different processes (different hash seeds).
    snap = snapshot(engines=[engine(i) for i in range(16)])
    here = [resolver.resolve(snap, affinity_key=f"group-{i}").engine_id for i in range(64)]
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(snap.to_json()),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert json.loads(out.stdout) == here


def test_inflight_accepts_any_mapping(resolver: RouteResolver) -> None:
    class Loads(Mapping[str, int]):
        def __init__(self, data: dict[str, int]) -> None:
            self._data = data

        def __getitem__(self, key: str) -> int:
            return self._data[key]

        def __iter__(self) -> Any:
            return iter(self._data)

        def __len__(self) -> int:
            return len(self._data)

    snap = snapshot(policy="bounded_rendezvous")
    ids = tuple(f"math/replica-{i}" for i in range(4))
    order = rendezvous_order("teacher", "math", ids, "k")
    loads = Loads({order[0]: 50})
    assert resolver.resolve(snap, affinity_key="k", inflight=loads).engine_id == order[1]


# -- weight versions and avoided heads ----------------------------------------------------------


def versioned(versions: list[str | None], model_version: str = "7") -> RoleSnapshot:
    """The teacher snapshot with ``math`` as an ACTOR model whose heads serve ``versions``."""
    data = snapshot().to_json()
    math = data["models"]["math"]
    math.update(weight_source="ACTOR", weight_version=model_version)
    math["engines"] = []
    for i, version in enumerate(versions):
        head = engine(i)
        if version is not None:
            head["weight_version"] = version
        math["engines"].append(head)
    return RoleSnapshot.from_json(data)


def test_weight_versions_compare_digit_runs_as_numbers() -> None:
    from relax_core.discovery.routing import weight_version_at_least, weight_version_key

    assert weight_version_key("9") < weight_version_key("10")
    assert weight_version_key("step-9") < weight_version_key("step-10")
    assert weight_version_key("v1.2") < weight_version_key("v1.10")
    assert weight_version_at_least("12", "12") and weight_version_at_least("13", "12")
    assert not weight_version_at_least("11", "12") and not weight_version_at_least(None, "1")


def test_only_heads_with_the_required_weight_version_are_candidates() -> None:
    resolver = RouteResolver(PluginManager.create(entry_points=False))
    snap = versioned(["8", "7", None, "8"])
    chosen = {resolver.resolve(snap, model="math", min_weight_version="8").engine_id for _ in "ab"}
    assert chosen == {"math/replica-0", "math/replica-3"}
    # A head without its own version serves the model's.
    target = resolver.resolve(snap, model="math", min_weight_version="7", affinity_key="k")
    assert target.weight_version in {"7", "8"}


def test_a_weight_version_no_head_serves_yet_is_503_with_retry_after() -> None:
    resolver = RouteResolver(PluginManager.create(entry_points=False))
    with pytest.raises(RoutingError) as info:
        resolver.resolve(versioned(["8", "8"]), model="math", min_weight_version="9")
    assert info.value.status == 503 and info.value.retry_after == 1.0
    assert 'weight version >= "9"' in info.value.message
    assert "math/replica-0 on 8" in info.value.message and "Nothing sent" in info.value.message
    # A router model must publish the version itself.
    data = snapshot().to_json()
    data["models"]["code"].update(weight_source="ACTOR", weight_version="3")
    with pytest.raises(RoutingError, match='>= "4"'):
        resolver.resolve(RoleSnapshot.from_json(data), model="code", min_weight_version="4")
    assert resolver.resolve(RoleSnapshot.from_json(data), model="code", min_weight_version="3")


def test_avoided_heads_are_left_out_unless_no_other_is_eligible() -> None:
    resolver = RouteResolver(PluginManager.create(entry_points=False))
    snap = snapshot(engines=[engine(0), engine(1)])
    avoid = {"http://10.0.0.1:30000"}
    assert {resolver.resolve(snap, avoid=avoid).url for _ in range(4)} == {"http://10.0.0.2:30000"}
    both = avoid | {"http://10.0.0.2:30000"}
    assert len({resolver.resolve(snap, avoid=both).url for _ in range(4)}) == 2


def test_a_weight_version_asked_of_a_static_model_is_a_400() -> None:
    resolver = RouteResolver(PluginManager.create(entry_points=False))
    with pytest.raises(RoutingError) as info:
        resolver.resolve(snapshot(), model="math", min_weight_version="1")
    assert info.value.status == 400 and "STATIC weights" in info.value.message
