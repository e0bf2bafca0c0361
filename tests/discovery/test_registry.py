"""RegistryPublisher: epochs, revisions that move only on change, generations, invalidation."""

from __future__ import annotations

import threading

import pytest

from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.routing import RouteResolver
from relax_core.discovery.schema import ModelState, RoleSnapshot, RoutingSpec
from relax_core.errors import RoutingError, SnapshotError
from relax_core.plugins import PluginManager
from tests.support.roles import builtin_roles


def publisher(role: str = "teacher", **kwargs: object) -> RegistryPublisher:
    reg = RegistryPublisher(role, RoutingSpec(default_model="math"), **kwargs)  # type: ignore[arg-type]
    reg.set_model(
        "math",
        state="READY",
        route_mode="DIRECT",
        weight_source="STATIC",
        served_model_name="Qwen/Qwen3-0.6B",
    )
    return reg


# -- epochs and revisions --------------------------------------------------------------------


def test_each_publisher_has_its_own_epoch() -> None:
    first, second = publisher(), publisher()
    assert first.epoch != second.epoch
    assert first.epoch.startswith("teacher-")
    assert first.snapshot().registry_epoch == first.epoch


def test_a_given_epoch_is_kept() -> None:
    assert publisher(epoch="incarnation-7").snapshot().registry_epoch == "incarnation-7"


def test_snapshot_is_the_same_object_while_nothing_changes() -> None:
    reg = publisher()
    snap = reg.snapshot()
    assert reg.snapshot() is snap
    reg.set_model_state("math", "READY")  # same value: nothing changes
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    after = reg.snapshot()
    assert after is not snap
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    assert reg.snapshot() is after


def test_topology_revision_moves_only_on_a_real_change() -> None:
    reg = publisher()
    start = reg.snapshot().topology_revision
    reg.set_model_state("math", ModelState.READY)
    reg.set_routing(RoutingSpec(default_model="math"))
    assert reg.snapshot().topology_revision == start
    reg.set_model_state("math", ModelState.SLEEPING)
    assert reg.snapshot().topology_revision == start + 1
    reg.set_engine("math", "e0", base_url=None, state="SLEEPING")
    assert reg.snapshot().topology_revision == start + 2
    reg.set_engine_state("math", "e0", "SLEEPING")
    assert reg.snapshot().topology_revision == start + 2


def test_published_snapshot_round_trips_through_json() -> None:
    reg = publisher()
    reg.set_engine("math", "math/replica-0", base_url="http://10.0.0.1:30000", state="READY")
    reg.set_engine("math", "math/replica-1", base_url="http://10.0.0.2:30000", state="FAILED")
    snap = reg.snapshot()
    assert RoleSnapshot.from_json(snap.to_json()) == snap


# -- engines and generations -----------------------------------------------------------------


def test_new_engine_starts_at_generation_one_and_is_eligible_when_ready() -> None:
    reg = publisher()
    assert reg.set_engine("math", "e0", base_url="http://h:1", state="READY") == 1
    view = reg.snapshot().models["math"].engines[0]
    assert (view.generation, view.direct_eligible, view.base_url) == (1, True, "http://h:1")


def test_generation_moves_when_the_endpoint_changes() -> None:
    reg = publisher()
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    assert reg.set_engine("math", "e0", base_url="http://h:2", state="READY") == 2
    assert reg.snapshot().models["math"].engines[0].base_url == "http://h:2"


def test_generation_stays_on_a_state_change() -> None:
    reg = publisher()
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    reg.set_engine_state("math", "e0", "SLEEPING")
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    assert reg.snapshot().models["math"].engines[0].generation == 1


def test_generation_moves_when_the_worker_is_replaced_behind_the_same_url() -> None:
    reg = publisher()
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    gen = reg.set_engine("math", "e0", base_url="http://h:1", state="READY", replaced=True)
    assert gen == 2
    assert reg.snapshot().models["math"].engines[0].generation == 2


def test_failed_engine_is_published_without_url_and_not_eligible() -> None:
    reg = publisher()
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    reg.set_engine_state("math", "e0", "FAILED")
    view = reg.snapshot().models["math"].engines[0]
    assert (view.state, view.base_url, view.direct_eligible) == (ModelState.FAILED, None, False)
    # Recovered on the same endpoint: the URL comes back, the generation is unchanged.
    reg.set_engine_state("math", "e0", "READY")
    view = reg.snapshot().models["math"].engines[0]
    assert (view.base_url, view.generation) == ("http://h:1", 1)


def test_ready_engine_can_be_kept_out_of_direct_routing() -> None:
    reg = publisher()
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY", direct_eligible=False)
    assert reg.snapshot().models["math"].engines[0].direct_eligible is False


def test_removed_engine_is_no_longer_published() -> None:
    reg = publisher()
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    reg.set_engine("math", "e1", base_url="http://h:2", state="READY")
    reg.remove_engine("math", "e0")
    assert [e.engine_id for e in reg.snapshot().models["math"].engines] == ["e1"]


# -- validation at entry ---------------------------------------------------------------------


def test_bad_engine_url_is_rejected_where_it_enters() -> None:
    reg = publisher()
    revision = reg.topology_revision
    with pytest.raises(SnapshotError) as info:
        reg.set_engine("math", "e0", base_url="tcp://h:1", state="READY")
    assert info.value.path == "models.math.engines[e0].base_url"
    assert reg.topology_revision == revision
    assert reg.snapshot().models["math"].engines == ()


def test_bad_url_of_a_failed_engine_is_still_rejected() -> None:
    with pytest.raises(SnapshotError, match="no host"):
        publisher().set_engine("math", "e0", base_url="http://", state="FAILED")


def test_eligible_engine_that_is_not_ready_is_rejected() -> None:
    with pytest.raises(SnapshotError) as info:
        publisher().set_engine(
            "math", "e0", base_url="http://h:1", state="SLEEPING", direct_eligible=True
        )
    assert info.value.path == "models.math.engines[e0].direct_eligible"


def test_unknown_engine_state_is_rejected() -> None:
    with pytest.raises(SnapshotError) as info:
        publisher().set_engine("math", "e0", base_url="http://h:1", state="HEALTHY")
    assert info.value.path == "models.math.engines[e0].state"


def test_static_model_refuses_a_weight_version() -> None:
    reg = publisher()
    with pytest.raises(SnapshotError) as info:
        reg.set_weight_version("math", "v3")
    assert info.value.path == "models.math.weight_version"
    assert reg.snapshot().models["math"].weight_version is None


def _refused_at(reg: RegistryPublisher, model: str, *, route_mode: str) -> str:
    """The key path :class:`SnapshotError` names when ``reg`` refuses ``model`` READY with the
    actor's weights and ``route_mode`` (its served name: the model's initial)."""
    with pytest.raises(SnapshotError) as info:
        reg.set_model(
            model,
            state="READY",
            route_mode=route_mode,
            weight_source="ACTOR",
            served_model_name=model[0],
        )
    return info.value.path


@pytest.mark.parametrize(
    "how",
    [
        pytest.param({"static_roles": {"genrm"}}, id="static-roles-given"),
        pytest.param({"weight_sources": builtin_roles()}, id="from-the-role-records"),
    ],
)
def test_a_static_roles_model_must_be_static(how: dict[str, object]) -> None:
    reg = RegistryPublisher("genrm", RoutingSpec(), **how)
    assert _refused_at(reg, "judge", route_mode="DIRECT") == "models.judge.weight_source"


def test_a_role_whose_record_allows_updates_may_publish_actor_models() -> None:
    reg = RegistryPublisher("rollout", RoutingSpec(), weight_sources=builtin_roles())
    reg.set_model(
        "policy", state="READY", route_mode="DIRECT", weight_source="ACTOR", served_model_name="p"
    )
    assert reg.snapshot().models["policy"].weight_source == "ACTOR"


def test_rollout_model_publishes_weight_versions() -> None:
    reg = RegistryPublisher("rollout", RoutingSpec(default_model="policy"))
    reg.set_model(
        "policy",
        state="READY",
        route_mode="SGLANG_ROUTER",
        router_url="http://router:9000",
        weight_source="ACTOR",
        served_model_name="policy",
    )
    reg.set_weight_version("policy", "step-12")
    assert reg.snapshot().models["policy"].weight_version == "step-12"


def test_ready_router_model_without_router_url_is_rejected() -> None:
    reg = RegistryPublisher("rollout", RoutingSpec())
    assert _refused_at(reg, "policy", route_mode="SGLANG_ROUTER") == "models.policy.router_url"


def test_update_model_rejects_unknown_fields() -> None:
    with pytest.raises(TypeError, match="unknown fields \\['colour'\\]"):
        publisher().update_model("math", colour="blue")


def test_unknown_model_or_engine_is_a_key_error_saying_what_exists() -> None:
    reg = publisher()
    with pytest.raises(KeyError, match="publishes no model 'chem'"):
        reg.set_engine("chem", "e0", base_url=None, state="STARTING")
    with pytest.raises(KeyError, match="publishes no engine 'e9'"):
        reg.set_engine_state("math", "e9", "READY")


def test_model_the_routing_points_to_cannot_be_removed() -> None:
    reg = publisher()
    with pytest.raises(SnapshotError, match=r"routing\.default_model still point to it"):
        reg.remove_model("math")
    reg.set_routing(RoutingSpec())
    reg.remove_model("math")
    assert dict(reg.snapshot().models) == {}


def test_routing_to_a_model_not_yet_published_fails_when_the_snapshot_is_taken() -> None:
    reg = RegistryPublisher("teacher", RoutingSpec(default_model="math"))
    with pytest.raises(SnapshotError) as info:
        reg.snapshot()
    assert info.value.path == "routing.default_model"
    reg.set_model(
        "math", state="STARTING", route_mode="DIRECT", weight_source="STATIC", served_model_name="m"
    )
    assert reg.snapshot().routing.default_model == "math"


def test_invalid_role_name_is_rejected_at_construction() -> None:
    with pytest.raises(SnapshotError) as info:
        RegistryPublisher("not a role", RoutingSpec())
    assert info.value.path == "role"


# -- invalidation ----------------------------------------------------------------------------


def test_invalidate_marks_everything_unknown_and_nothing_routable(
    core_plugin_manager: PluginManager,
) -> None:
    reg = publisher()
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    resolver = RouteResolver(core_plugin_manager)
    assert resolver.resolve(reg.snapshot()).engine_id == "e0"
    before = reg.topology_revision
    reg.invalidate()
    snap = reg.snapshot()
    assert snap.topology_revision == before + 1
    assert snap.models["math"].state is ModelState.UNKNOWN
    engine = snap.models["math"].engines[0]
    assert (engine.state, engine.direct_eligible) == (ModelState.UNKNOWN, False)
    with pytest.raises(RoutingError) as info:
        resolver.resolve(snap)
    assert info.value.status == 503 and "UNKNOWN" in info.value.message


def test_invalidate_twice_publishes_nothing_new() -> None:
    reg = publisher()
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    reg.invalidate()
    snap = reg.snapshot()
    reg.invalidate()
    assert reg.snapshot() is snap


def test_managers_reporting_again_restore_routing_after_invalidate() -> None:
    reg = publisher()
    reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    reg.invalidate()
    reg.set_model_state("math", "READY")
    reg.set_engine_state("math", "e0", "READY")
    engine = reg.snapshot().models["math"].engines[0]
    assert (engine.state, engine.direct_eligible, engine.generation) == (ModelState.READY, True, 1)


# -- concurrency -----------------------------------------------------------------------------


def test_concurrent_updates_from_many_threads_are_all_published() -> None:
    reg = publisher()
    start = reg.topology_revision
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def manager(worker: int) -> None:
        try:
            barrier.wait(timeout=10)
            for i in range(50):
                reg.set_engine(
                    "math",
                    f"w{worker}-e{i}",
                    base_url=f"http://h{worker}:{1000 + i}",
                    state="READY",
                )
                reg.snapshot()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=manager, args=(w,)) for w in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    snap = reg.snapshot()
    assert len(snap.models["math"].engines) == 400
    assert snap.topology_revision == start + 400


def test_publish_many_is_the_calls_it_stands_for_in_one() -> None:
    one, many = publisher(), publisher()
    for reg in (one, many):
        reg.set_engine("math", "gone", base_url="http://h:9", state="READY")
        reg.set_engine("math", "e0", base_url="http://h:1", state="READY")
    model = {
        "state": "SLEEPING",
        "route_mode": "DIRECT",
        "weight_source": "STATIC",
        "served_model_name": "Qwen/Qwen3-0.6B",
    }
    engines = [
        ("e0", {"base_url": "http://h:1", "state": "SLEEPING", "replaced": True}),
        ("e1", {"base_url": "http://h:2", "state": "READY"}),
    ]
    one.set_model("math", **model)
    expected = {e: one.set_engine("math", e, **fields) for e, fields in engines}
    one.remove_engine("math", "gone")
    assert many.publish_many("math", model, engines, ["gone"]) == expected == {"e0": 2, "e1": 1}
    assert many.snapshot().models == one.snapshot().models
