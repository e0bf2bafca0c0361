"""The job file: TOML in, frozen attrs models out; every problem named by key path and rule."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal

import attrs
import pytest

from relax_core import ConfigReader, EngineOptions
from relax_core.config import (
    HealthSettings,
    JobConfig,
    PlacementSettings,
    RouterSettings,
    key_lines,
    load_config,
    loads_config,
    parse_config,
)
from relax_core.errors import ConfigValidationError

SKETCH = """
[cluster]
num_nodes = 1
gpus_per_node = 8
gpu_memory_gib = 80

[training]
actor_gpus = 8
colocate = true
offload = true

[placement]
mode = "split"

[roles.rollout.models.policy]
backend = "sglang"
model_path = "/models/policy"
num_gpus = 4
gpus_per_engine = 2
tp = 2

[roles.genrm.models.judge]
backend = "sglang"
model_path = "/models/judge"
num_gpus = 2
gpus_per_engine = 2
tp = 2

[roles.teacher.models.math]
backend = "sglang"
model_path = "/models/teacher"
num_gpus = 2
gpus_per_engine = 2
tp = 2
aliases = ["teacher-checkpoint"]
route_keys = ["math-data"]
"""

MODEL = {"backend": "sglang", "model_path": "/models/judge", "num_gpus": 2, "tp": 2}


def doc(**models: dict[str, Any]) -> dict[str, Any]:
    """A minimal document with a genrm role holding ``models`` (default: one judge)."""
    return {
        "cluster": {"num_nodes": 1, "gpus_per_node": 8},
        "roles": {"genrm": {"models": models or {"judge": dict(MODEL)}}},
    }


def problems(data: dict[str, Any], **kwargs: Any) -> list[tuple[str, str, str]]:
    with pytest.raises(ConfigValidationError) as info:
        parse_config(data, **kwargs)
    err = info.value
    for p in err.problems:  # every problem is in the message, with its path and rule
        assert f"{p.path}: [{p.rule}]" in str(err)
    return [(p.path, p.rule, p.message) for p in err.problems]


def only(data: dict[str, Any], **kwargs: Any) -> tuple[str, str, str]:
    found = problems(data, **kwargs)
    assert len(found) == 1, found
    return found[0]


def test_the_issue_sketch_parses_into_frozen_models() -> None:
    cfg = loads_config(SKETCH, source="job.toml")
    assert cfg.source == "job.toml"
    assert cfg.cluster.total_gpus == 8 and cfg.cluster.gpu_memory_gib == 80.0
    assert cfg.training.actor_gpus == 8 and cfg.training.colocate and cfg.training.offload
    assert cfg.placement.mode == "split"
    assert cfg.role_names == ("rollout", "genrm", "teacher")
    math = cfg.role("teacher").model("math")
    size = math.placement
    assert (size.num_gpus, size.gpus_per_engine, size.tp, size.pp, size.num_engines) == (
        2,
        2,
        2,
        1,
        1,
    )
    assert math.aliases == ("teacher-checkpoint",) and math.route_keys == ("math-data",)
    assert math.path == "roles.teacher.models.math"
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        math.placement.tp = 4  # type: ignore[misc]


def test_load_config_reads_a_file(tmp_path: Path) -> None:
    path = tmp_path / "job.toml"
    path.write_text(SKETCH)
    assert load_config(path) == attrs.evolve(loads_config(SKETCH), source=str(path))


def test_optional_serving_keys_are_accepted_and_typed() -> None:
    data = doc(
        judge={
            **MODEL,
            "route_mode": "DIRECT",
            "device": "cuda",
            "weight_source": "STATIC",
            "served_model_name": "Qwen/Qwen3-0.6B",
            "weights_cpu_backup": True,
            "offload_weights": False,
            "seed": 7,
            "mem_fraction_static": 0.6,
            "extra_args": ["--enable-metrics"],
            "env": {"NCCL_DEBUG": "WARN"},
        }
    )
    data["roles"]["genrm"].update(
        default_model="judge", policy="round_robin", gateway={"port": 18000}
    )
    role = parse_config(data).role("genrm")
    judge = role.model("judge")
    assert (judge.route_mode, judge.weight_source, judge.served_model_name) == (
        "DIRECT",
        "STATIC",
        "Qwen/Qwen3-0.6B",
    )
    engine = judge.engine
    assert engine.weights_cpu_backup is True and judge.seed == 7
    assert engine.offload_weights is False
    assert parse_config(doc(judge=MODEL)).role("genrm").model("judge").engine.offload_weights
    assert engine.mem_fraction_static == 0.6
    assert engine.extra_args == ("--enable-metrics",) and engine.env == {"NCCL_DEBUG": "WARN"}
    assert (role.default_model, role.policy, role.gateway.port) == ("judge", "round_robin", 18000)


def test_engine_shape_defaults_follow_tp_and_pp() -> None:
    cfg = parse_config(
        doc(
            a={"backend": "sglang", "model_path": "/m", "tp": 2, "pp": 2},
            b={"backend": "sglang", "model_path": "/m", "gpus_per_engine": 4, "num_engines": 3},
        )
    )
    a, b = (m.placement for m in cfg.role("genrm").models)
    assert (a.gpus_per_engine, a.num_gpus, a.num_engines) == (4, 4, 1)
    assert (b.tp, b.num_gpus, b.num_engines) == (4, 12, 3)


def test_unknown_model_key_names_its_path_and_suggests_the_close_key() -> None:
    path, rule, message = only(doc(judge={**MODEL, "tpp": 2}))
    assert (path, rule) == ("roles.genrm.models.judge.tpp", "unknown-key")
    assert "did you mean 'tp'?" in message


def test_unknown_top_level_table_is_an_error_with_a_hint() -> None:
    path, rule, message = only({**doc(), "clustr": {}})
    assert (path, rule) == ("clustr", "unknown-key")
    assert "did you mean 'cluster'?" in message


def test_unknown_role_suggests_the_close_role_and_names_the_plugin_rule() -> None:
    data = doc()
    data["roles"]["genrn"] = {"models": {"j": dict(MODEL)}}
    path, rule, message = only(data, role_names=("rollout", "genrm", "teacher"))
    assert (path, rule) == ("roles.genrn", "unknown-role")
    assert "did you mean 'genrm'?" in message and "plugin" in message


def test_without_role_names_any_well_formed_role_name_is_read() -> None:
    # The config knows no role: the planner checks the names against the registered records.
    data = doc()
    data["roles"]["prm"] = {"models": {"j": dict(MODEL)}}
    assert parse_config(data).role_names == ("genrm", "prm")


def test_a_malformed_role_name_is_a_problem_naming_it() -> None:
    data = doc()
    data["roles"]["bad role"] = {"models": {"j": dict(MODEL)}}
    path, rule, message = only(data)
    assert (path, rule) == ("roles.bad role", "role-name")
    assert "starts with a letter" in message


def test_a_third_party_role_is_accepted_when_its_name_is_known() -> None:
    data = doc()
    data["roles"]["critic-llm"] = {"models": {"j": dict(MODEL)}}
    cfg = parse_config(data, role_names=("genrm", "critic-llm"))
    assert cfg.role("critic-llm").model("j").path == "roles.critic-llm.models.j"


def test_a_wrongly_typed_value_names_its_path() -> None:
    path, rule, message = only(doc(judge={**MODEL, "tp": "2"}))
    assert (path, rule) == ("roles.genrm.models.judge.tp", "type")
    assert "integer" in message and "'2'" in message


def test_a_boolean_is_not_accepted_as_a_count() -> None:
    path, rule, _ = only(doc(judge={**MODEL, "num_gpus": True}))
    assert (path, rule) == ("roles.genrm.models.judge.num_gpus", "type")


def test_backend_and_model_path_are_required() -> None:
    found = problems(doc(judge={"num_gpus": 2}))
    assert {(p, r) for p, r, _ in found} == {
        ("roles.genrm.models.judge.backend", "required"),
        ("roles.genrm.models.judge.model_path", "required"),
    }


def test_a_role_without_models_is_an_error() -> None:
    data = doc()
    data["roles"]["genrm"] = {"default_model": "judge"}
    path, rule, _ = problems(data)[0]
    assert (path, rule) == ("roles.genrm.models", "required")


@pytest.mark.parametrize(
    ("key", "value"),
    [("route_mode", "DIRECTT"), ("device", "tpu"), ("dtype", "bfloat17")],
)
def test_enumerated_values_list_the_choices(key: str, value: str) -> None:
    path, rule, message = only(doc(judge={**MODEL, key: value}))
    assert (path, rule) == (f"roles.genrm.models.judge.{key}", "choice")
    assert "must be one of" in message and "did you mean" in message


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("weights_cpu_backup", "yes"),
        ("offload_weights", 0),
        ("seed", 1.5),
        ("served_model_name", 3),
        ("weight_source", 1),
    ],
)
def test_optional_serving_keys_are_type_checked(key: str, value: Any) -> None:
    path, rule, _ = only(doc(judge={**MODEL, key: value}))
    assert (path, rule) == (f"roles.genrm.models.judge.{key}", "type")


@pytest.mark.parametrize(
    ("key", "value"),
    [("mem_fraction_static", 1.5), ("tp", 0), ("ray_gpu_fraction", 0), ("bundle_start", -1)],
)
def test_out_of_range_values_are_rejected(key: str, value: Any) -> None:
    path, rule, _ = only(doc(judge={**MODEL, key: value}))
    assert (path, rule) == (f"roles.genrm.models.judge.{key}", "range")


def test_gateway_port_must_be_a_tcp_port() -> None:
    data = doc()
    data["roles"]["genrm"]["gateway"] = {"port": 70000}
    path, rule, _ = only(data)
    assert (path, rule) == ("roles.genrm.gateway.port", "range")


def test_a_cpu_model_uses_no_gpus() -> None:
    path, rule, _ = only(doc(judge={**MODEL, "device": "cpu"}))
    assert (path, rule) == ("roles.genrm.models.judge.num_gpus", "device")
    cfg = parse_config(
        doc(judge={"backend": "hf", "model_path": "/m", "device": "cpu", "num_engines": 2})
    )
    judge = cfg.role("genrm").model("judge")
    assert (judge.placement.num_gpus, judge.placement.num_engines) == (0, 2)


def test_num_engines_and_num_gpus_must_agree() -> None:
    path, rule, message = only(doc(judge={**MODEL, "num_engines": 3}))
    assert (path, rule) == ("roles.genrm.models.judge.num_engines", "consistency")
    assert "3 engines" in message and "num_gpus = 2" in message


def test_default_model_must_name_a_model_or_alias() -> None:
    data = doc(judge={**MODEL, "aliases": ["j"]})
    data["roles"]["genrm"]["default_model"] = "j"
    assert parse_config(data).role("genrm").default_model == "j"
    data["roles"]["genrm"]["default_model"] = "judg"
    path, rule, message = only(data)
    assert (path, rule) == ("roles.genrm.default_model", "reference")
    assert "did you mean 'judge'?" in message


def test_an_alias_may_not_shadow_another_model() -> None:
    data = doc(judge=dict(MODEL), small={**MODEL, "aliases": ["judge"]})
    path, rule, _ = only(data)
    assert (path, rule) == ("roles.genrm.models.small.aliases[0]", "duplicate")


def test_a_route_key_maps_to_one_model_only() -> None:
    data = doc(judge={**MODEL, "route_keys": ["math"]}, small={**MODEL, "route_keys": ["math"]})
    path, rule, message = only(data)
    assert (path, rule) == ("roles.genrm.models.small.route_keys[0]", "duplicate")
    assert "'judge'" in message


def test_defer_roles_must_name_configured_roles() -> None:
    data = doc()
    data["placement"] = {"mode": "defer", "defer_roles": ["genrn"]}
    path, rule, message = only(data)
    assert (path, rule) == ("placement.defer_roles[0]", "reference")
    assert "did you mean 'genrm'?" in message


def test_every_problem_is_reported_at_once() -> None:
    data = copy.deepcopy(doc(judge={**MODEL, "tp": "x", "tpp": 1}))
    data["cluster"]["num_nodes"] = 0
    data["placement"] = {"pg_strategy": "PAKC"}
    found = {(p, r) for p, r, _ in problems(data)}
    assert found == {
        ("roles.genrm.models.judge.tp", "type"),
        ("roles.genrm.models.judge.tpp", "unknown-key"),
        ("cluster.num_nodes", "range"),
        ("placement.pg_strategy", "choice"),
    }


def test_bad_toml_syntax_is_a_config_error() -> None:
    with pytest.raises(ConfigValidationError) as info:
        loads_config("[cluster\nnum_nodes = 1", source="broken.toml")
    assert info.value.problems[0].rule == "toml" and "broken.toml" in str(info.value)
    # The problem's path is the file, line and column; the message quotes the line.
    assert info.value.problems[0].path == "broken.toml:1:9"
    assert "(line 1: '[cluster')" in info.value.problems[0].message


def test_a_toml_error_at_the_end_of_the_file_names_its_last_line() -> None:
    with pytest.raises(ConfigValidationError) as info:
        loads_config('[cluster]\nname = """never closed', source="job.toml")
    assert info.value.problems[0].path.startswith("job.toml:2:")


def test_a_missing_file_is_a_config_error_named_by_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigValidationError) as info:
        load_config(tmp_path / "nope.toml")
    (problem,) = info.value.problems
    assert problem.rule == "file" and problem.path == str(tmp_path / "nope.toml")


def test_a_problem_in_a_job_file_says_on_which_line_its_key_is(tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    job.write_text(
        "[cluster]\nnum_nodes = 1\n\n[roles.rollout.models.policy]\n"
        'backend = "hf"\nmodel_path = "m"\nnum_gpuz = 1\n'
    )
    with pytest.raises(ConfigValidationError) as info:
        load_config(job)
    (problem,) = info.value.problems
    assert problem.path == "roles.rollout.models.policy.num_gpuz"
    assert problem.message.endswith(f"({job}:7)"), problem.message


def test_key_lines_count_array_of_table_items_and_skip_comments() -> None:
    text = (
        '# [not.a.table]\n[run]\nsteps = 2\n[[run.stages]]\nstage = "reward"\n'
        '[[run.stages]]\nstage = "eval"\n'
    )
    assert key_lines(text) == {
        "run": 2,
        "run.steps": 3,
        "run.stages[0]": 4,
        "run.stages[0].stage": 5,
        "run.stages[1]": 6,
        "run.stages[1].stage": 7,
    }


def test_an_empty_document_is_a_valid_empty_job() -> None:
    assert parse_config({}) == JobConfig()


def test_gateway_in_ray_actor_is_a_boolean_defaulting_to_false() -> None:
    assert parse_config(doc()).role("genrm").gateway.in_ray_actor is False
    data = doc()
    data["roles"]["genrm"]["gateway"] = {"in_ray_actor": True}
    assert parse_config(data).role("genrm").gateway.in_ray_actor is True
    data["roles"]["genrm"]["gateway"] = {"in_ray_actor": "yes"}
    path, rule, _ = only(data)
    assert (path, rule) == ("roles.genrm.gateway.in_ray_actor", "type")


def test_router_and_pd_keys_are_read_and_pd_leaves_at_least_one_decode_engine() -> None:
    model = {
        **MODEL,
        "num_gpus": 4,
        "router": "smg",
        "router_policy": "consistent_hashing",
        "router_allow_dropped_fields": ["sampling_params.logit_bias"],
        "router_args": ["--log-dir", "/tmp/r"],
        "pd_prefill_engines": 1,
        "deterministic_inference": True,
    }
    judge = parse_config(doc(judge=model)).role("genrm").model("judge")
    assert (judge.router.name, judge.router.policy, judge.engine.pd_prefill_engines) == (
        "smg",
        "consistent_hashing",
        1,
    )
    assert judge.router.allow_dropped_fields == ("sampling_params.logit_bias",)
    assert judge.router.args == ("--log-dir", "/tmp/r") and judge.engine.deterministic_inference
    path, rule, message = only(doc(judge={**model, "pd_prefill_engines": 2}))
    assert (path, rule) == ("roles.genrm.models.judge.pd_prefill_engines", "range")
    assert "leave no decode engine" in message


def test_an_external_model_names_its_heads_by_url_and_places_nothing() -> None:
    external = {"external_urls": ["http://10.0.0.5:30000", "https://heads.example:443/"]}
    judge = parse_config(doc(judge=external)).role("genrm").model("judge")
    assert judge.external and judge.external_urls == (
        "http://10.0.0.5:30000",
        "https://heads.example:443",
    )
    size = judge.placement
    assert (judge.device, size.num_gpus, size.num_engines, judge.backend) == ("cpu", 0, 2, "")
    found = problems(doc(judge={"external_urls": ["10.0.0.5:30000", "http://h:1/v1"], "tp": 2}))
    assert [(p, r) for p, r, _ in found] == [
        ("roles.genrm.models.judge.external_urls[0]", "url"),
        ("roles.genrm.models.judge.external_urls[1]", "url"),
        ("roles.genrm.models.judge.tp", "external"),
    ]


def test_a_plugin_reads_its_own_table_with_the_job_files_rules() -> None:
    # relax_core.ConfigReader is what a stage or an engine backend reads its table with: every
    # problem at once, each at its key path, an unknown key with a did-you-mean hint.
    from relax_core import ConfigReader, ConfigValidationError

    r = ConfigReader()
    t = r.table({"k": 0, "mode": "maxx", "kk": 1}, "run.stages[2]", ("k", "mode"))
    assert r.value(t, "run.stages[2]", "k", int, 4, check=ConfigReader.at_least(1)) == 4
    mode = r.value(t, "run.stages[2]", "mode", str, "mean", check=ConfigReader.one_of(("max",)))
    assert mode == "mean"
    with pytest.raises(ConfigValidationError) as info:
        r.raise_problems("job.toml")
    text = str(info.value)
    assert "run.stages[2].kk: [unknown-key] unknown key; did you mean 'k'?" in text
    assert "run.stages[2].k: [range] must be >= 1, got 0" in text
    assert "run.stages[2].mode: [choice] must be one of 'max', got 'maxx'" in text
    ConfigReader().raise_problems()  # nothing recorded: nothing raised


def test_each_concern_of_a_model_table_is_a_record_of_its_own_with_the_same_key_names() -> None:
    model = {
        **MODEL,
        "gpus_per_engine": 2,
        "bundle_start": 2,
        "ray_gpu_fraction": 0.5,
        "cuda_graph_gib": 0.5,
        "num_parameters": 600_000_000,
        "dtype": "bf16",
        "kv_cache_dtype": "fp8",
        "context_length": 4096,
        "max_running_requests": 32,
        "dp": 2,
        "dp_attention": True,
        "weights_cpu_backup": False,
        "extra_args": ["--enable-metrics"],
        "env": {"NCCL_DEBUG": "WARN"},
        "router_policy": "round_robin",
        "unhealthy_after": 5,
    }
    judge = parse_config(doc(judge=model)).role("genrm").model("judge")
    assert judge.placement == PlacementSettings(
        num_gpus=2,
        gpus_per_engine=2,
        tp=2,
        pp=1,
        num_engines=1,
        bundle_start=2,
        ray_gpu_fraction=0.5,
        cuda_graph_gib=0.5,
        num_parameters=600_000_000,
    )
    assert judge.engine == EngineOptions(
        dtype="bf16",
        kv_cache_dtype="fp8",
        context_length=4096,
        max_running_requests=32,
        dp=2,
        dp_attention=True,
        weights_cpu_backup=False,
        extra_args=("--enable-metrics",),
        env={"NCCL_DEBUG": "WARN"},
    )
    assert judge.router == RouterSettings(policy="round_robin")
    assert judge.health == HealthSettings(unhealthy_after=5)
    assert judge.engine_table == {}
    # A bad value in a record is still named by its key in the model table.
    path, rule, _ = only(doc(judge={**model, "unhealthy_after": 0}))
    assert (path, rule) == ("roles.genrm.models.judge.unhealthy_after", "range")


def test_a_models_engine_table_is_kept_as_written_for_its_backend_to_read() -> None:
    # Parsing does not know the backends: the job's checks read the table into the backend's
    # options record (tests/jobs/test_engine_options.py).
    text = (
        SKETCH.replace(
            'aliases = ["teacher-checkpoint"]',
            'aliases = ["teacher-checkpoint"]\nengine = { chunked = 4096, mode = "fast" }',
        )
        + "\n[roles.rollout.models.policy.engine]\nmemory_handoff = true\n"
    )
    cfg = loads_config(text)
    assert cfg.role("rollout").model("policy").engine_table == {"memory_handoff": True}
    assert cfg.role("teacher").model("math").engine_table == {"chunked": 4096, "mode": "fast"}
    assert cfg.role("genrm").model("judge").engine_table == {}


def test_an_engine_key_that_is_not_a_table_is_refused() -> None:
    path, rule, message = only(doc(judge={**MODEL, "engine": "fast"}))
    assert (path, rule) == ("roles.genrm.models.judge.engine", "type")
    assert "must be a table of the 'sglang' backend's options" in message


def test_an_external_model_takes_no_engine_table() -> None:
    external = {"external_urls": ["http://10.0.0.5:30000"], "engine": {"memory_handoff": True}}
    path, rule, _ = only(doc(judge=external))
    assert (path, rule) == ("roles.genrm.models.judge.engine", "external")


@attrs.frozen
class _Options:
    """A backend's options record, as a plugin would declare it."""

    handoff: bool = False
    threads: int = attrs.field(default=0, metadata={"check": ConfigReader.at_least(0)})
    timeout: float = 30.0
    pool_tokens: int | None = None
    attention: Literal["sdpa", "eager"] = "sdpa"
    flags: tuple[str, ...] = ()
    label: str = "x"


def test_a_record_is_read_from_a_table_by_its_fields_names_types_and_defaults() -> None:
    r = ConfigReader()
    got = r.record(
        {"handoff": True, "timeout": 5, "pool_tokens": 64, "attention": "eager", "flags": ["-a"]},
        "roles.rollout.models.policy.engine",
        _Options,
    )
    assert r.problems == []
    assert got == _Options(
        handoff=True, timeout=5.0, pool_tokens=64, attention="eager", flags=("-a",)
    )
    assert isinstance(got.timeout, float)  # an integer is accepted where a number is asked for
    assert ConfigReader().record({}, "p", _Options) == _Options()


def test_a_records_bad_keys_are_each_a_problem_at_their_key_path() -> None:
    r = ConfigReader()
    path = "roles.rollout.models.policy.engine"
    raw = {"handof": True, "threads": -1, "timeout": True, "attention": "flash", "flags": "-a"}
    assert r.record(raw, path, _Options) is None
    assert [(p.path, p.rule) for p in r.problems] == [
        (f"{path}.handof", "unknown-key"),
        (f"{path}.threads", "range"),
        (f"{path}.timeout", "type"),
        (f"{path}.attention", "choice"),
        (f"{path}.flags", "type"),
    ]
    assert "did you mean 'handoff'?" in r.problems[0].message
    assert ConfigReader().record([1], path, _Options) is None


def test_a_records_own_validator_is_a_problem_at_the_tables_path() -> None:
    @attrs.frozen
    class Checked:
        low: int = 0
        high: int = 1

        def __attrs_post_init__(self) -> None:
            if self.low > self.high:
                raise ValueError(f"low {self.low} > high {self.high}")

    r = ConfigReader()
    assert r.record({"low": 3}, "x.engine", Checked) is None
    assert [(p.path, p.rule, p.message) for p in r.problems] == [
        ("x.engine", "value", "low 3 > high 1")
    ]


def test_a_record_a_job_file_cannot_give_is_the_records_authors_mistake() -> None:
    @attrs.frozen
    class NoDefault:
        needed: int

    @attrs.frozen
    class Nested:
        inner: dict[str, int] = attrs.field(factory=dict)

    with pytest.raises(TypeError, match=r"NoDefault.needed: give it a default"):
        ConfigReader().record({}, "x", NoDefault)
    with pytest.raises(TypeError, match=r"Nested.inner: a job file cannot give"):
        ConfigReader().record({}, "x", Nested)
    with pytest.raises(TypeError, match="not an attrs class"):
        ConfigReader().record({}, "x", dict)
