"""Schema 2: strict parsing with field paths, validation in code, JSON round trip, schema 1."""

from __future__ import annotations

import copy
import json
import pickle
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from relax_core.discovery.schema import (
    EngineView,
    ModelState,
    ModelView,
    RoleSnapshot,
    RouteMode,
    RoutingSpec,
)
from relax_core.errors import SnapshotError
from relax_core.plugins import PluginManager, module_plugin
from relax_core.records import WeightSource
from tests.support.roles import builtin_roles


def reference_doc() -> dict[str, Any]:
    """The snapshot of the reference design, plus a router-mode model and a second head."""
    return {
        "schema_version": 2,
        "role": "teacher",
        "registry_epoch": "manager-incarnation",
        "topology_revision": 3,
        "routing": {
            "default_model": "math",
            "route_key_map": {"math-data": "math"},
            "aliases": {"teacher-checkpoint": "math"},
            "policy": "round_robin",
            "policy_revision": 0,
        },
        "models": {
            "math": {
                "state": "READY",
                "route_mode": "DIRECT",
                "router_url": None,
                "weight_source": "STATIC",
                "weight_version": None,
                "served_model_name": "Qwen/Qwen3-0.6B",
                "engines": [
                    {
                        "engine_id": "math/replica-0",
                        "base_url": "http://head:30000",
                        "state": "READY",
                        "direct_eligible": True,
                        "generation": 1,
                    },
                    {
                        "engine_id": "math/replica-1",
                        "base_url": None,
                        "state": "FAILED",
                        "direct_eligible": False,
                        "generation": 2,
                    },
                ],
            },
            "code": {
                "state": "SLEEPING",
                "route_mode": "SGLANG_ROUTER",
                "router_url": "https://router.internal:8080",
                "weight_source": "STATIC",
                "weight_version": None,
                "served_model_name": "code-teacher",
                "engines": [],
            },
        },
    }


def test_reference_snapshot_parses_and_round_trips() -> None:
    doc = reference_doc()
    snap = RoleSnapshot.from_json(doc)
    assert snap.role == "teacher"
    assert snap.models["math"].state is ModelState.READY
    assert snap.models["math"].engines[0].state is ModelState.READY
    assert snap.models["code"].route_mode is RouteMode.SGLANG_ROUTER
    assert snap.to_json() == doc
    assert RoleSnapshot.from_json(snap.to_json()) == snap


def test_json_text_and_bytes_are_accepted() -> None:
    text = json.dumps(reference_doc())
    assert RoleSnapshot.from_json(text) == RoleSnapshot.from_json(text.encode())


def test_invalid_json_text_is_rejected() -> None:
    with pytest.raises(SnapshotError, match="not valid JSON"):
        RoleSnapshot.from_json("{not json")


def _set(path: tuple[Any, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return apply


def _delete(path: tuple[Any, ...]) -> Callable[[dict[str, Any]], None]:
    def apply(doc: dict[str, Any]) -> None:
        node: Any = doc
        for key in path[:-1]:
            node = node[key]
        del node[path[-1]]

    return apply


def _engine0(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return _set(("models", "math", "engines", 0, field), value)


def _math(field: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return _set(("models", "math", field), value)


def _duplicate_engine(doc: dict[str, Any]) -> None:
    engines = doc["models"]["math"]["engines"]
    engines.append(copy.deepcopy(engines[0]))


def _as_genrm_actor(doc: dict[str, Any]) -> None:
    doc["role"] = "genrm"
    doc["models"]["math"]["weight_source"] = "ACTOR"


# (id, mutation, expected path, a phrase of the rule)
MALFORMED: list[tuple[str, Callable[[dict[str, Any]], None], str, str]] = [
    ("unknown-top-field", _set(("phase_epoch",), 8), "phase_epoch", "unknown field"),
    ("schema-1", _set(("schema_version",), 1), "schema_version", "expected 2"),
    ("missing-role", _delete(("role",)), "role", "required field is missing"),
    ("bad-role-type", _set(("role",), 7), "role", "must be a string"),
    ("empty-epoch", _set(("registry_epoch",), ""), "registry_epoch", "must not be empty"),
    ("revision-as-string", _set(("topology_revision",), "3"), "topology_revision", "integer"),
    ("negative-revision", _set(("topology_revision",), -1), "topology_revision", ">= 0"),
    ("unknown-routing-field", _set(("routing", "weights"), {}), "routing.weights", "unknown"),
    (
        "default-not-a-model",
        _set(("routing", "default_model"), "chem"),
        "routing.default_model",
        "not a model",
    ),
    (
        "route-key-target-missing",
        _set(("routing", "route_key_map", "chem-data"), "chem"),
        "routing.route_key_map.chem-data",
        "not a model",
    ),
    (
        "alias-target-missing",
        _set(("routing", "aliases", "old"), "chem"),
        "routing.aliases.old",
        "not a model",
    ),
    (
        "alias-shadows-model",
        _set(("routing", "aliases", "code"), "math"),
        "routing.aliases.code",
        "shadows a model id",
    ),
    (
        "odd-route-key-path",
        _set(("routing", "route_key_map", "a b"), "chem"),
        'routing.route_key_map["a b"]',
        "not a model",
    ),
    (
        "bad-policy-name",
        _set(("routing", "policy"), "round robin!"),
        "routing.policy",
        "routing-policy name",
    ),
    (
        "policy-revision-bool",
        _set(("routing", "policy_revision"), True),
        "routing.policy_revision",
        "integer",
    ),
    ("models-not-object", _set(("models",), []), "models", "JSON object"),
    ("bad-model-id", _set(("models", "has space"), {}), 'models["has space"]', "model id"),
    ("unknown-model-field", _math("pid", 4242), "models.math.pid", "unknown field"),
    (
        "missing-model-field",
        _delete(("models", "math", "served_model_name")),
        "models.math.served_model_name",
        "missing",
    ),
    ("unknown-model-state", _math("state", "RUNNING"), "models.math.state", "unknown state"),
    ("unknown-route-mode", _math("route_mode", "PD"), "models.math.route_mode", "unknown"),
    (
        "unknown-weight-source",
        _math("weight_source", "S3CKPT"),
        "models.math.weight_source",
        "unknown weight source",
    ),
    (
        "static-with-version",
        _math("weight_version", "v7"),
        "models.math.weight_version",
        "STATIC model never carries a weight_version",
    ),
    (
        "direct-with-router-url",
        _math("router_url", "http://router:1"),
        "models.math.router_url",
        "DIRECT model has no router_url",
    ),
    (
        "ready-router-without-url",
        _set(
            ("models", "code"),
            {**reference_doc()["models"]["code"], "state": "READY", "router_url": None},
        ),
        "models.code.router_url",
        "must publish its router_url",
    ),
    (
        "router-url-ftp",
        _set(("models", "code", "router_url"), "ftp://router:21"),
        "models.code.router_url",
        "http:// or https://",
    ),
    ("engines-not-array", _math("engines", {}), "models.math.engines", "JSON array"),
    (
        "unknown-engine-field",
        _engine0("node_ip", "10.0.0.1"),
        "models.math.engines[0].node_ip",
        "unknown field",
    ),
    (
        "missing-engine-field",
        _delete(("models", "math", "engines", 0, "generation")),
        "models.math.engines[0].generation",
        "missing",
    ),
    (
        "unknown-engine-state",
        _engine0("state", "HEALTHY"),
        "models.math.engines[0].state",
        "unknown state",
    ),
    (
        "non-http-base-url",
        _engine0("base_url", "grpc://head:1"),
        "models.math.engines[0].base_url",
        "http:// or https://",
    ),
    (
        "host-less-base-url",
        _engine0("base_url", "http://:30000"),
        "models.math.engines[0].base_url",
        "no host",
    ),
    (
        "base-url-bad-port",
        _engine0("base_url", "http://head:99999"),
        "models.math.engines[0].base_url",
        "not a valid URL",
    ),
    (
        "base-url-with-query",
        _engine0("base_url", "http://head:1/?token=x"),
        "models.math.engines[0].base_url",
        "query",
    ),
    (
        "eligible-but-not-ready",
        _engine0("state", "SLEEPING"),
        "models.math.engines[0].direct_eligible",
        "only a READY engine",
    ),
    (
        "eligible-without-url",
        _engine0("base_url", None),
        "models.math.engines[0].direct_eligible",
        "only an engine with a URL",
    ),
    (
        "failed-publishes-url",
        _set(("models", "math", "engines", 1, "base_url"), "http://h:1"),
        "models.math.engines[1].base_url",
        "FAILED engine never publishes a URL",
    ),
    (
        "generation-bool",
        _engine0("generation", True),
        "models.math.engines[0].generation",
        "integer",
    ),
    (
        "eligible-not-bool",
        _engine0("direct_eligible", 1),
        "models.math.engines[0].direct_eligible",
        "true or false",
    ),
    (
        "duplicate-engine-id",
        _duplicate_engine,
        "models.math.engines[2].engine_id",
        "already used by engines[0]",
    ),
    (
        "engine-id-with-space",
        _engine0("engine_id", "math replica"),
        "models.math.engines[0].engine_id",
        "engine id",
    ),
]


@pytest.mark.parametrize(
    ("mutate", "path", "phrase"),
    [pytest.param(m, p, r, id=i) for i, m, p, r in MALFORMED],
)
def test_malformed_snapshot_is_rejected_naming_the_field_path(
    mutate: Callable[[dict[str, Any]], None], path: str, phrase: str
) -> None:
    doc = reference_doc()
    mutate(doc)
    with pytest.raises(SnapshotError) as info:
        RoleSnapshot.from_json(doc)
    assert info.value.path == path
    assert str(info.value).startswith(f"{path}: ")
    assert phrase in info.value.message


def test_at_least_fifteen_distinct_malformed_cases_are_covered() -> None:
    assert len({path for _, _, path, _ in MALFORMED}) >= 15


def test_snapshot_that_is_not_an_object_is_rejected() -> None:
    with pytest.raises(SnapshotError, match="must be a JSON object"):
        RoleSnapshot.from_json("[1, 2]")


# -- validation when built in code -----------------------------------------------------------


def test_engine_built_in_code_cannot_be_direct_eligible_unless_ready() -> None:
    with pytest.raises(SnapshotError) as info:
        EngineView("e0", "http://h:1", ModelState.DRAINING, True, 1)
    assert info.value.path == "direct_eligible"


def test_engine_built_in_code_rejects_unknown_state_strings() -> None:
    with pytest.raises(SnapshotError, match="unknown state 'BUSY'"):
        EngineView("e0", "http://h:1", "BUSY", False, 1)  # type: ignore[arg-type]


def test_model_built_in_code_converts_state_strings_to_enums() -> None:
    view = ModelView("READY", "DIRECT", None, "ACTOR", "v3", "m")  # type: ignore[arg-type]
    assert view.state is ModelState.READY and view.route_mode is RouteMode.DIRECT


def test_snapshot_built_in_code_checks_routing_targets() -> None:
    with pytest.raises(SnapshotError) as info:
        RoleSnapshot(
            role="rollout",
            registry_epoch="e",
            topology_revision=0,
            routing=RoutingSpec(default_model="policy"),
            models={},
        )
    assert info.value.path == "routing.default_model"
    assert "known models: (none)" in info.value.message


def test_snapshot_models_cannot_be_mutated_after_construction() -> None:
    snap = RoleSnapshot.from_json(reference_doc())
    with pytest.raises(TypeError):
        snap.models["chem"] = snap.models["math"]  # type: ignore[index]
    with pytest.raises(TypeError):
        snap.routing.aliases["x"] = "math"  # type: ignore[index]


# -- weight sources from plugins -------------------------------------------------------------


def _s3_plugin_manager() -> PluginManager:
    def relax_register_weight_sources(register: Callable[[WeightSource], None]) -> None:
        register(WeightSource(name="S3CKPT", update_paths={"disk"}, publishes_version=True))

    plugin = module_plugin("s3", relax_register_weight_sources=relax_register_weight_sources)
    return PluginManager.create(entry_points=False, plugins=[("s3", plugin)])


def _rollout_doc(source: str, version: str | None) -> dict[str, Any]:
    doc = reference_doc()
    doc["role"] = "rollout"
    doc["models"]["math"]["weight_source"] = source
    doc["models"]["math"]["weight_version"] = version
    return doc


def test_weight_source_registered_by_a_plugin_is_accepted_with_that_plugin_manager() -> None:
    snap = RoleSnapshot.from_json(
        _rollout_doc("S3CKPT", "v12"), weight_sources=_s3_plugin_manager()
    )
    assert snap.models["math"].weight_version == "v12"


def test_weight_source_unknown_to_the_default_set_names_the_field() -> None:
    with pytest.raises(SnapshotError) as info:
        RoleSnapshot.from_json(_rollout_doc("S3CKPT", "v12"))
    assert info.value.path == "models.math.weight_source"
    assert "known: ACTOR, DCS, STATIC" in info.value.message


def test_source_that_publishes_no_version_rejects_a_weight_version() -> None:
    records = {"FROZEN": WeightSource(name="FROZEN", update_paths=(), publishes_version=False)}
    with pytest.raises(SnapshotError) as info:
        RoleSnapshot.from_json(_rollout_doc("FROZEN", "v1"), weight_sources=records)
    assert info.value.path == "models.math.weight_version"


def test_static_role_model_whose_source_allows_updates_is_rejected() -> None:
    # A STATIC-named record that allows updates cannot come from two plugins (names are
    # unique), so this builds the record mapping directly.
    records = {
        "STATIC": WeightSource(name="STATIC", update_paths={"disk"}, publishes_version=False)
    }
    with pytest.raises(SnapshotError) as info:
        RoleSnapshot.from_json(reference_doc(), weight_sources=records)
    assert info.value.path == "models.math.weight_source"
    assert "refuse every update path" in info.value.message


def test_a_model_of_a_static_only_role_must_be_static_by_its_record() -> None:
    doc = reference_doc()
    _as_genrm_actor(doc)
    RoleSnapshot.from_json(doc)  # without role records nothing says genrm is STATIC-only
    with pytest.raises(SnapshotError) as info:
        RoleSnapshot.from_json(doc, weight_sources=builtin_roles())
    assert info.value.path == "models.math.weight_source"
    assert "a genrm model must be STATIC" in info.value.message


def test_static_roles_can_be_chosen_by_the_caller() -> None:
    doc = _rollout_doc("ACTOR", "v3")
    RoleSnapshot.from_json(doc)  # rollout is not a STATIC role by default
    with pytest.raises(SnapshotError, match="a rollout model must be STATIC"):
        RoleSnapshot.from_json(doc, static_roles={"rollout"})


def test_core_plugin_manager_knows_the_builtin_sources(
    core_plugin_manager: PluginManager,
) -> None:
    snap = RoleSnapshot.from_json(
        _rollout_doc("DCS", "version-4"), weight_sources=core_plugin_manager
    )
    assert snap.models["math"].weight_source == "DCS"


# -- schema 1 --------------------------------------------------------------------------------


def test_schema1_view_lists_rank_status_and_url_of_heads_only() -> None:
    view = RoleSnapshot.from_json(reference_doc()).schema1()
    assert view == {
        "engines": [
            {"rank": 0, "status": "READY", "url": "http://head:30000"},
            {"rank": 2, "status": "FAILED", "url": None},
        ]
    }


def test_schema1_ranks_stay_when_another_models_heads_change() -> None:
    doc = reference_doc()
    doc["models"]["code"].update(route_mode="DIRECT", router_url=None, state="READY")
    code = doc["models"]["code"]["engines"]
    code.append(
        {"engine_id": "code/replica-0", "base_url": "http://c0:1", "state": "READY",
         "direct_eligible": True, "generation": 1}
    )  # fmt: skip

    def ranks() -> dict[str | None, int]:
        view = RoleSnapshot.from_json(doc).schema1()["engines"]
        return {e["url"]: e["rank"] for e in view if e["url"] is not None}

    before = ranks()
    code.append({**code[0], "engine_id": "code/replica-1", "base_url": "http://c1:1"})
    code.append({**code[0], "engine_id": "code/replica-2", "base_url": "http://c2:1"})
    after = ranks()
    assert after["http://head:30000"] == before["http://head:30000"] == 0
    assert after["http://c0:1"] == before["http://c0:1"] == 1
    del code[0]  # scaled in: the others keep theirs
    assert ranks() == {k: v for k, v in after.items() if k != "http://c0:1"}
    assert len(set(after.values())) == len(after)


# -- round trip property ---------------------------------------------------------------------

_ids = st.from_regex(r"[a-z][a-z0-9_-]{0,8}", fullmatch=True)
_urls = st.builds(
    lambda scheme, host, port: f"{scheme}://{host}:{port}",
    st.sampled_from(["http", "https"]),
    st.from_regex(r"[a-z][a-z0-9-]{0,10}(\.[a-z]{2,5})?", fullmatch=True),
    st.integers(1, 65535),
)


@st.composite
def _engines(draw: st.DrawFn) -> list[dict[str, Any]]:
    out = []
    for index in range(draw(st.integers(0, 5))):
        state = draw(st.sampled_from(list(ModelState)))
        url = None if state is ModelState.FAILED else draw(st.none() | _urls)
        eligible = state is ModelState.READY and url is not None and draw(st.booleans())
        out.append(
            {
                "engine_id": f"e-{index}",
                "base_url": url,
                "state": state.value,
                "direct_eligible": eligible,
                "generation": draw(st.integers(0, 10**6)),
            }
        )
    return out


@st.composite
def _snapshots(draw: st.DrawFn) -> dict[str, Any]:
    model_ids = draw(st.lists(_ids, min_size=1, max_size=4, unique=True))
    models = {}
    for model_id in model_ids:
        mode = draw(st.sampled_from(list(RouteMode)))
        state = draw(st.sampled_from(list(ModelState)))
        source = draw(st.sampled_from(["STATIC", "ACTOR", "DCS"]))
        router = None
        if mode is RouteMode.SGLANG_ROUTER:
            router = draw(_urls) if state is ModelState.READY else draw(st.none() | _urls)
        models[model_id] = {
            "state": state.value,
            "route_mode": mode.value,
            "router_url": router,
            "weight_source": source,
            "weight_version": None if source == "STATIC" else draw(st.none() | _ids),
            "served_model_name": draw(_ids),
            "engines": draw(_engines()),
        }
    targets = st.sampled_from(model_ids)
    keys = st.from_regex(r"K[a-z0-9-]{0,6}", fullmatch=True)
    return {
        "schema_version": 2,
        "role": "rollout",
        "registry_epoch": draw(_ids),
        "topology_revision": draw(st.integers(0, 10**9)),
        "routing": {
            "default_model": draw(st.none() | targets),
            "route_key_map": draw(st.dictionaries(keys, targets, max_size=3)),
            "aliases": draw(st.dictionaries(keys, targets, max_size=3)),
            "policy": draw(st.sampled_from(["round_robin", "rendezvous", "bounded_rendezvous"])),
            "policy_revision": draw(st.integers(0, 100)),
        },
        "models": models,
    }


@settings(max_examples=60, deadline=None)
@given(_snapshots())
def test_any_valid_snapshot_survives_a_json_round_trip(doc: dict[str, Any]) -> None:
    snap = RoleSnapshot.from_json(doc)
    wire = json.loads(json.dumps(snap.to_json()))
    assert wire == doc
    assert RoleSnapshot.from_json(wire) == snap


def test_routing_spec_keeps_its_own_copy_of_the_maps() -> None:
    aliases = {"old": "math"}
    spec = RoutingSpec(default_model="math", aliases=aliases)
    aliases["new"] = "math"
    assert dict(spec.aliases) == {"old": "math"}


def test_snapshot_pickles_for_other_processes() -> None:
    snap = RoleSnapshot.from_json(reference_doc())
    copy_ = pickle.loads(pickle.dumps(snap))
    assert copy_ == snap
    assert copy_.to_json() == snap.to_json()


def test_a_heads_weight_version_is_optional_and_omitted_when_null() -> None:
    doc = reference_doc()
    assert "weight_version" not in doc["models"]["math"]["engines"][0]
    snap = RoleSnapshot.from_json(doc)
    assert snap.models["math"].engines[0].weight_version is None
    assert "weight_version" not in snap.to_json()["models"]["math"]["engines"][0]
    model = doc["models"]["math"]
    model.update(weight_source="ACTOR", weight_version="12")
    model["engines"][0]["weight_version"] = "11"
    versioned = RoleSnapshot.from_json(doc)
    assert versioned.models["math"].engines[0].weight_version == "11"
    assert RoleSnapshot.from_json(versioned.to_json()) == versioned


def test_a_static_models_head_with_a_weight_version_is_rejected() -> None:
    doc = reference_doc()
    doc["models"]["math"]["engines"][0]["weight_version"] = "3"
    with pytest.raises(SnapshotError) as info:
        RoleSnapshot.from_json(doc)
    assert info.value.path == "models.math.engines[0].weight_version"
    doc["models"]["math"]["engines"][0]["weight_version"] = 3
    with pytest.raises(SnapshotError, match="weight_version"):
        RoleSnapshot.from_json(doc)
