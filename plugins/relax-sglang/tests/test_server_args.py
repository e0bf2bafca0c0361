"""The sglang backend's command lines: what each spec becomes, and the rules it refuses.

These need no SGLang: ``test_sglang_parser.py`` (run by ``nox -s sglang``) checks the same
command lines against SGLang's own parser.
"""

from __future__ import annotations

import sys

import attrs
import pytest
from relax_sglang.server_args import launch_server_argv

from relax_core import (
    ConfigError,
    EngineLaunchSpec,
    EngineOptions,
    PluginManager,
    engine_launch_specs,
    loads_config,
)

_OPTION_FIELDS = frozenset(f.name for f in attrs.fields(EngineOptions))


def _argv(**fields: object) -> list[str]:
    """The command line of a spec of ``fields`` (those naming an ``EngineOptions`` field go
    into its ``options``)."""
    options = {k: fields.pop(k) for k in list(fields) if k in _OPTION_FIELDS}
    spec = EngineLaunchSpec(
        engine_id="policy/replica-0",
        model_path="/m",
        options=EngineOptions(**options),  # type: ignore[arg-type]
        **fields,  # type: ignore[arg-type]
    )
    return launch_server_argv(spec, port=30000, bootstrap_port=8998)


def _flags(argv: list[str]) -> dict[str, str | bool]:
    out: dict[str, str | bool] = {}
    for i, arg in enumerate(argv):
        if arg.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else "--"
            out[arg] = nxt if not nxt.startswith("--") else True
    return out


JOB = """\
[cluster]
num_nodes = 3
gpus_per_node = 8

[roles.rollout.models.policy]
backend = "sglang"
model_path = "/models/policy"
num_gpus = 4
gpus_per_engine = 2
tp = 2
seed = 7
mem_fraction_static = 0.6
context_length = 4096
extra_args = ["--chunked-prefill-size", "4096", "--load-format", "dummy"]

[roles.genrm.models.judge]
backend = "sglang"
model_path = "/models/judge"
num_gpus = 2
tp = 2

[roles.teacher.models.math]
backend = "sglang"
model_path = "/models/teacher"
num_gpus = 16
gpus_per_engine = 16
tp = 8
pp = 2
deterministic_inference = true
"""


@pytest.fixture(scope="module")
def job_specs() -> dict[str, dict[str, list[EngineLaunchSpec]]]:
    return engine_launch_specs(loads_config(JOB), PluginManager.create())


def test_a_head_runs_launch_server_with_the_current_interpreter_and_its_settings() -> None:
    argv = _argv(tp=4, pp=2, seed=3, served_model_name="policy", weight_version="7")
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    flags = _flags(argv)
    assert flags["--model-path"] == "/m" and flags["--port"] == "30000"
    assert flags["--tp-size"] == "4" and flags["--pp-size"] == "2"
    assert flags["--random-seed"] == "3" and flags["--served-model-name"] == "policy"
    assert flags["--weight-version"] == "7"
    # The manager releases and resumes memory: every engine gets the memory saver.
    assert flags["--enable-memory-saver"] is True
    assert "--nnodes" not in flags and "--disaggregation-mode" not in flags


def test_the_models_settings_become_sglang_flags() -> None:
    flags = _flags(
        _argv(
            dtype="bf16",
            mem_fraction_static=0.55,
            context_length=2048,
            max_running_requests=64,
            kv_cache_dtype="fp8",
            dp=2,
            dp_attention=True,
            deterministic_inference=True,
        )
    )
    assert flags["--dtype"] == "bfloat16" and flags["--kv-cache-dtype"] == "fp8_e4m3"
    assert flags["--mem-fraction-static"] == "0.55" and flags["--context-length"] == "2048"
    assert flags["--max-running-requests"] == "64" and flags["--dp-size"] == "2"
    assert flags["--enable-dp-attention"] is True
    assert flags["--enable-deterministic-inference"] is True


def test_every_node_of_a_multi_node_replica_joins_the_heads_address(
    job_specs: dict[str, dict[str, list[EngineLaunchSpec]]],
) -> None:
    workers = job_specs["roles.teacher.models.math"]["math/replica-0"]
    assert [w.node_rank for w in workers] == [0, 1]
    for worker in workers:
        flags = _flags(launch_server_argv(worker, port=30000))
        assert flags["--nnodes"] == "2" and flags["--node-rank"] == str(worker.node_rank)
        assert flags["--dist-init-addr"] == worker.dist_init_addr
        assert flags["--tp-size"] == "8" and flags["--pp-size"] == "2"


def test_a_static_engine_always_keeps_a_cpu_weight_backup(
    job_specs: dict[str, dict[str, list[EngineLaunchSpec]]],
) -> None:
    judge = job_specs["roles.genrm.models.judge"]["judge/replica-0"][0]
    assert judge.static
    assert "--enable-weights-cpu-backup" in launch_server_argv(judge, port=1)
    # Even a spec that forgot it gets it.
    assert "--enable-weights-cpu-backup" in _argv(static=True, weights_cpu_backup=False)
    assert "--enable-weights-cpu-backup" not in _argv()


def test_a_static_engine_refuses_dummy_weights_and_lora() -> None:
    with pytest.raises(ConfigError, match=r"engines.policy/replica-0.extra_args.*dummy"):
        _argv(static=True, role="genrm", extra_args=("--load-format", "dummy"))
    with pytest.raises(ConfigError, match=r"--load-format=dummy_weights|dummy"):
        _argv(static=True, role="genrm", extra_args=("--load-format=dummy_weights",))
    with pytest.raises(ConfigError, match=r"--enable-lora.*never loads LoRA"):
        _argv(static=True, role="teacher", extra_args=("--enable-lora",))
    with pytest.raises(ConfigError, match=r"--lora-paths"):
        _argv(static=True, role="teacher", extra_args=("--lora-paths", "a=/a"))
    # A policy engine may start from dummy weights (the trainer pushes real ones) and load LoRA.
    assert "dummy" in _argv(extra_args=("--load-format", "dummy", "--enable-lora"))


def test_the_policys_sglang_settings_never_reach_a_static_engine(
    job_specs: dict[str, dict[str, list[EngineLaunchSpec]]],
) -> None:
    policy = job_specs["roles.rollout.models.policy"]["policy/replica-0"][0]
    policy_flags = _flags(launch_server_argv(policy, port=1))
    assert policy_flags["--chunked-prefill-size"] == "4096"
    assert policy_flags["--mem-fraction-static"] == "0.6" and policy_flags["--random-seed"] == "7"
    for model in ("roles.genrm.models.judge", "roles.teacher.models.math"):
        for workers in job_specs[model].values():
            for spec in workers:
                flags = _flags(launch_server_argv(spec, port=1))
                for leaked in (
                    "--chunked-prefill-size",
                    "--load-format",
                    "--mem-fraction-static",
                    "--random-seed",
                    "--context-length",
                ):
                    assert leaked not in flags, (spec.engine_id, leaked)


def test_genrm_runs_deterministic_inference_by_default_and_a_model_key_can_ask_for_it(
    job_specs: dict[str, dict[str, list[EngineLaunchSpec]]],
) -> None:
    def deterministic(model: str) -> bool:
        spec = next(iter(job_specs[model].values()))[0]
        return "--enable-deterministic-inference" in launch_server_argv(spec, port=1)

    assert deterministic("roles.genrm.models.judge")
    assert deterministic("roles.teacher.models.math")  # deterministic_inference = true
    assert not deterministic("roles.rollout.models.policy")


def test_pd_replicas_are_prefill_then_decode_and_a_prefill_head_gets_its_bootstrap_port() -> None:
    options = EngineOptions(pd_prefill_engines=2)
    modes = []
    for index in range(4):
        flags = _flags(_argv(replica_index=index, pd_prefill_engines=2))
        modes.append(flags["--disaggregation-mode"])
        assert ("--disaggregation-bootstrap-port" in flags) == (index < 2)
    assert modes == ["prefill", "prefill", "decode", "decode"]
    with pytest.raises(ConfigError, match="bootstrap port"):
        launch_server_argv(
            EngineLaunchSpec(engine_id="p/replica-0", model_path="/m", options=options), port=1
        )


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        (("--tp-size", "4"), "from tp"),
        (("--mem-fraction-static=0.9",), "mem_fraction_static"),
        (("--port", "1"), "free port"),
        (("--disaggregation-mode", "prefill"), "pd_prefill_engines"),
    ],
)
def test_extra_args_may_not_set_what_a_key_owns_and_the_error_names_the_key(
    extra: tuple[str, ...], key: str
) -> None:
    with pytest.raises(ConfigError, match=rf"extra_args: {extra[0].split('=')[0]} .*{key}"):
        _argv(extra_args=extra)


def test_bad_values_are_refused_naming_the_key() -> None:
    with pytest.raises(ConfigError, match=r"kv_cache_dtype.*'float16'"):
        _argv(kv_cache_dtype="float16")
    # Options are a typed record: one the core does not define cannot be given at all.
    with pytest.raises(TypeError, match=r"speculative"):
        EngineOptions(speculative=True)  # type: ignore[call-arg]
    with pytest.raises(ConfigError, match=r"dist_init_addr"):
        _argv(nnodes=2, node_rank=1)
    with pytest.raises(ConfigError, match=r"node_rank"):
        _argv(nnodes=2, node_rank=2, dist_init_addr="10.0.0.1:5000")
