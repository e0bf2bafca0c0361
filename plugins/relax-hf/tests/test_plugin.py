"""The hf backend as the core sees it: entry point, launch, control client, CLI, tiny models."""

from __future__ import annotations

import asyncio
import hashlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from relax_hf.options import HFEngineOptions
from relax_hf.plugin import HF_BACKEND, serve_argv

from relax_core import (
    ConfigError,
    ControlClient,
    EngineLaunchSpec,
    EngineOptions,
    EngineProcess,
    LifecycleError,
    PluginManager,
    SubprocessEngineProcess,
)


def test_hf_backend_is_found_through_the_relax_entry_point(plugin_manager: PluginManager) -> None:
    backend = plugin_manager.engine_backend("hf")
    assert backend is HF_BACKEND
    assert backend.devices == frozenset({"cpu", "cuda"}) and backend.multi_node is True
    reg = plugin_manager.registered("engine_backends")["hf"]
    assert reg.distribution == "relax-hf"
    assert backend.control_client("http://127.0.0.1:1").base_url == "http://127.0.0.1:1"


@pytest.mark.parametrize("field", ["tp", "pp"])
def test_launch_refuses_sharded_engines_naming_the_field(field: str, tiny_model: Path) -> None:
    spec = EngineLaunchSpec(engine_id="e1", model_path=str(tiny_model), **{field: 2})
    with pytest.raises(ConfigError) as info:
        HF_BACKEND.launch(spec)
    assert info.value.path == f"engines.e1.{field}"


@pytest.mark.parametrize(
    ("fields", "path", "needle"),
    [
        ({"nnodes": 0}, "nnodes", "must be >= 1"),
        (
            {"nnodes": 2, "node_rank": 2, "dist_init_addr": "127.0.0.1:1"},
            "node_rank",
            "[0, nnodes=2)",
        ),
        ({"nnodes": 2, "node_rank": 1}, "dist_init_addr", "not host:port"),
        ({"nnodes": 2, "dist_init_addr": "10.0.0.1"}, "dist_init_addr", "not host:port"),
    ],
)
def test_launch_refuses_a_bad_multi_node_spec_naming_the_field(
    fields: dict[str, Any], path: str, needle: str, tiny_model: Path
) -> None:
    spec = EngineLaunchSpec(engine_id="m/replica-0", model_path=str(tiny_model), **fields)
    with pytest.raises(ConfigError) as info:
        HF_BACKEND.launch(spec)
    assert info.value.path == f"engines.m/replica-0.{path}" and needle in str(info.value)


def test_serve_argv_runs_the_module_with_this_interpreter() -> None:
    spec = EngineLaunchSpec(
        engine_id="e",
        model_path="/m",
        port=5,
        seed=3,
        served_model_name="n",
        weight_version="v7",
        options=EngineOptions(weights_cpu_backup=True, extra_args=("--threads", "1")),
    )
    argv = serve_argv(spec, 5)
    assert argv[:4] == [sys.executable, "-m", "relax_hf", "serve"]
    for pair in (
        ["--port", "5"],
        ["--seed", "3"],
        ["--served-model-name", "n"],
        ["--weight-version", "v7"],
    ):
        i = argv.index(pair[0])
        assert argv[i : i + 2] == pair
    assert "--weights-cpu-backup" in argv and argv[-2:] == ["--threads", "1"]
    assert "--nnodes" not in argv


@pytest.mark.parametrize("given", [("--device", "cpu"), ("--device=cpu",)])
def test_a_device_in_extra_args_is_the_only_device_on_the_command_line(
    given: tuple[str, ...],
) -> None:
    # An engine on CPU on a declared GPU bundle (the demo's layout): one --device, the given one.
    spec = EngineLaunchSpec(
        engine_id="e", model_path="/m", device="cuda", options=EngineOptions(extra_args=given)
    )
    argv = serve_argv(spec, 5)
    devices = [a for a in argv if a.startswith("--device")]
    assert devices == [given[0]] and "cuda" not in argv, argv


def test_serve_argv_names_the_bundles_device_when_extra_args_do_not() -> None:
    argv = serve_argv(EngineLaunchSpec(engine_id="e", model_path="/m", device="cuda"), 5)
    i = argv.index("--device")
    assert argv[i : i + 2] == ["--device", "cuda"] and argv.count("--device") == 1


def test_serve_argv_of_a_follower_names_its_rank_and_the_heads_address() -> None:
    spec = EngineLaunchSpec(
        engine_id="m/replica-0/node-1",
        model_path="/m",
        nnodes=3,
        node_rank=1,
        dist_init_addr="10.0.0.1:29500",
    )
    argv = serve_argv(spec, 7)
    for pair in (["--nnodes", "3"], ["--node-rank", "1"], ["--dist-init-addr", "10.0.0.1:29500"]):
        i = argv.index(pair[0])
        assert argv[i : i + 2] == pair


def test_the_job_files_sizing_keys_reach_the_engines_command_line() -> None:
    # mem_fraction_static, context_length and max_running_requests of a model table travel as
    # EngineLaunchSpec.options; the hf engine takes them as SGLang's flags (extra_args win).
    from relax_core import PluginManager, engine_launch_specs, loads_config

    config = loads_config(
        "[roles.rollout.models.policy]\n"
        'backend = "hf"\ndevice = "cpu"\nmodel_path = "/m"\n'
        "mem_fraction_static = 0.6\ncontext_length = 512\nmax_running_requests = 8\n"
        'extra_args = ["--max-running-requests", "4"]\n'
    )
    specs = engine_launch_specs(config, PluginManager.create())
    spec = specs["roles.rollout.models.policy"]["policy/replica-0"][0]
    argv = serve_argv(spec, 9)
    for pair in (["--mem-fraction-static", "0.6"], ["--context-length", "512"]):
        i = argv.index(pair[0])
        assert argv[i : i + 2] == pair
    assert argv[-4:] == ["--max-running-requests", "8", "--max-running-requests", "4"]
    bare = EngineLaunchSpec(engine_id="e", model_path="/m")
    assert "--mem-fraction-static" not in serve_argv(bare, 9)


def _policy(tiny_model: Path | str, engine: str) -> str:
    return (
        "[roles.rollout.models.policy]\n"
        f'backend = "hf"\ndevice = "cpu"\nmodel_path = "{tiny_model}"\nroute_mode = "DIRECT"\n'
        'extra_args = ["--threads", "1"]\n'
        f"[roles.rollout.models.policy.engine]\n{engine}"
    )


def test_an_engine_table_is_typed_for_hf_and_its_options_become_serve_flags() -> None:
    from relax_core import PluginManager, engine_launch_specs, loads_config

    assert HF_BACKEND.options is HFEngineOptions
    config = loads_config(
        _policy(
            "/m", 'memory_handoff = true\nmax_total_tokens = 64\nattn_implementation = "eager"\n'
        )
    )
    specs = engine_launch_specs(config, PluginManager.create())
    spec = specs["roles.rollout.models.policy"]["policy/replica-0"][0]
    assert spec.backend_options == HFEngineOptions(
        memory_handoff=True, max_total_tokens=64, attn_implementation="eager"
    )
    argv = serve_argv(spec, 9)
    # Only the options that differ from their defaults, before the model's extra_args (which win).
    assert argv[-7:] == [
        "--memory-handoff",
        "--max-total-tokens",
        "64",
        "--attn-implementation",
        "eager",
        "--threads",
        "1",
    ]
    bare = engine_launch_specs(loads_config(_policy("/m", "")), PluginManager.create())
    spec = bare["roles.rollout.models.policy"]["policy/replica-0"][0]
    assert spec.backend_options == HFEngineOptions() and serve_argv(spec, 9)[-2:] == [
        "--threads",
        "1",
    ]


def test_every_hf_engine_option_is_the_serve_flag_of_its_name() -> None:
    import attrs
    from relax_hf.cli import build_parser
    from relax_hf.options import options_argv

    changed = HFEngineOptions(
        memory_handoff=True,
        disable_cuda_graph=True,
        cuda_graph_max_bs=8,
        cuda_graph_backend_prefill="disabled",
        cuda_graph_max_bs_prefill=512,
        enable_torch_compile=True,
        max_total_tokens=64,
        attn_implementation="eager",
        threads=2,
        dist_timeout=7.5,
        constrained_json_disable_any_whitespace=True,
        constrained_json_max_whitespace_cnt=1,
        disable_radix_cache=True,
        enable_custom_logit_processor=True,
        enable_cache_report=True,
        disable_overlap_schedule=True,
        num_continuous_decode_steps=4,
        attention_backend="torch_native",
    )
    fields = attrs.fields(HFEngineOptions)
    # A new option must be added above too: each one differs from its default here.
    assert [f.name for f in fields if getattr(changed, f.name) == f.default] == []
    args = build_parser().parse_args(["serve", "--model", "/m", *options_argv(changed)])
    assert {f.name: getattr(args, f.name) for f in fields} == attrs.asdict(changed)


def test_an_unknown_hf_engine_option_is_refused_at_its_key_path_with_a_hint() -> None:
    from relax_core import ConfigValidationError, PluginManager, engine_launch_specs, loads_config

    config = loads_config(_policy("/m", "memory_handof = true\nthreads = -1\n"))
    with pytest.raises(ConfigValidationError) as info:
        engine_launch_specs(config, PluginManager.create())
    assert [(p.path, p.rule) for p in info.value.problems] == [
        ("roles.rollout.models.policy.engine.memory_handof", "unknown-key"),
        ("roles.rollout.models.policy.engine.threads", "range"),
    ]
    assert "did you mean 'memory_handoff'?" in info.value.problems[0].message


def test_the_typed_engine_options_reach_the_launched_hf_engine(
    tiny_model: Path, tmp_path: Path
) -> None:
    # From the job file's engine table to the running engine: its /server_info echoes the
    # serve flags it was started with.
    import attrs

    from relax_core import PluginManager, engine_launch_specs, loads_config

    text = _policy(
        tiny_model,
        'max_total_tokens = 48\nattn_implementation = "eager"\nenable_cache_report = true\n',
    )
    specs = engine_launch_specs(loads_config(text), PluginManager.create())
    spec = specs["roles.rollout.models.policy"]["policy/replica-0"][0]
    proc = HF_BACKEND.launch(attrs.evolve(spec, log_path=str(tmp_path / "e.log")))
    try:
        proc.wait_ready(120)

        async def info() -> dict[str, Any]:
            async with HF_BACKEND.control_client(proc.base_url) as c:
                return await c.server_info()  # type: ignore[no-any-return]

        got = asyncio.run(info())
        assert (got["max_total_tokens"], got["attn_implementation"]) == (48, "eager")
        assert got["memory_handoff"] is False and got["enable_cache_report"] is True
    finally:
        proc.terminate(10)


def test_launch_refuses_another_backends_options_record(tiny_model: Path) -> None:
    spec = EngineLaunchSpec(engine_id="e", model_path=str(tiny_model), backend_options=object())
    with pytest.raises(ConfigError) as info:
        HF_BACKEND.launch(spec)
    assert info.value.path == "engines.e.backend_options"


def test_launch_and_control_client_drive_an_engine_end_to_end(
    tiny_model: Path, tmp_path: Path
) -> None:
    spec = EngineLaunchSpec(
        engine_id="e2e",
        model_path=str(tiny_model),
        weight_version="w0",
        log_path=str(tmp_path / "e.log"),
        options=EngineOptions(mem_fraction_static=0.02),
    )
    proc = HF_BACKEND.launch(spec)
    try:
        assert isinstance(proc, EngineProcess) and isinstance(proc, SubprocessEngineProcess)
        proc.wait_ready(120)
        assert proc.poll() is None

        async def drive() -> dict[str, Any]:
            async with HF_BACKEND.control_client(proc.base_url) as c:
                assert isinstance(c, ControlClient)
                await c.health()
                await c.health_generate()
                assert await c.weight_version() == "w0"
                info = await c.server_info()
                assert info["model_path"] == str(tiny_model)
                # The pool is sized by the fraction the spec's options gave (SGLang's flag).
                assert info["memory"]["kv_cache"]["mem_fraction_static"] == 0.02
                await c.pause_generation("in_place")
                await c.continue_generation()
                await c.flush_cache(wait=5)
                assert (await c.abort("nobody"))["found"] is False
                await c.abort()
                await c.release_memory(["kv_cache", "weights"])
                with pytest.raises(LifecycleError, match="resume"):
                    await c.update_weights_from_disk(str(tiny_model))
                await c.resume_memory(None)
                await c.health_generate()
                return await c.update_weights_from_disk(str(tiny_model), weight_version="w1")

        out = asyncio.run(drive())
        assert out["weight_version"] == "w1"
    finally:
        code = proc.terminate(10)
    assert proc.poll() == code
    assert "serving" in proc.log_tail()


def test_the_public_api_is_what_it_should_be() -> None:
    import relax_hf

    assert relax_hf.__all__ == [
        "DEMO_JOB",
        "DEMO_MODELS",
        "HF_BACKEND",
        "__version__",
        "launch",
        "make_demo_models",
        "make_tiny_model",
    ]
    for name in relax_hf.__all__:
        assert getattr(relax_hf, name) is not None


def test_python_m_relax_hf_lists_its_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "relax_hf", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    for cmd in ("serve", "make-tiny-model", "bench", "gpu-bench", "engine-throughput"):
        assert cmd in out.stdout


def test_make_tiny_model_is_deterministic_per_seed(tmp_path: Path) -> None:
    from relax_hf.tiny import make_tiny_model

    def digests(name: str) -> dict[str, str]:
        return {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest()
            for f in sorted((tmp_path / name).iterdir())
        }

    cmd = [
        sys.executable,
        "-m",
        "relax_hf",
        "make-tiny-model",
        str(tmp_path / "a"),
        "--seed",
        "1",
        "--size",
        "micro",
    ]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120)
    make_tiny_model(tmp_path / "b", seed=1, size="micro")
    make_tiny_model(tmp_path / "c", seed=2, size="micro")
    a, b, c = digests("a"), digests("b"), digests("c")
    assert a == b
    assert a["model.safetensors"] != c["model.safetensors"]
    assert a["tokenizer.json"] == c["tokenizer.json"]  # the tokenizer does not depend on the seed
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors"} <= set(
        a
    )


def test_the_tiny_tokenizer_round_trips_text_and_has_a_chat_template(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    text = "Hello, café 你好 123"
    assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def test_the_backend_builds_control_clients_that_switch_in_one_call_each() -> None:
    from relax_hf.plugin import HF_BACKEND

    from relax_core import ControlClient

    client = HF_BACKEND.control_client("http://127.0.0.1:1")
    assert isinstance(client, ControlClient)
    assert (client.release_flushes, client.resume_checks) == (True, True)


def test_with_the_memory_handoff_a_sleeping_models_graphs_are_budgeted_in_the_other_phases(
    tiny_model: Path,
) -> None:
    from relax_core import PluginManager, loads_config, plan_inference_placement

    def job(judge: str, math: str) -> str:
        head = (
            "[cluster]\nnum_nodes = 1\ngpus_per_node = 1\ngpu_memory_gib = 80\n"
            "[training]\nactor_gpus = 1\ncolocate = true\noffload = true\n"
            '[placement]\nmode = "defer"\ndefer_roles = ["genrm", "teacher"]\n'
        )
        model = f'backend = "hf"\nmodel_path = "{tiny_model}"\nmem_fraction_static = 0.5\n'
        return (
            f"{head}[roles.rollout.models.policy]\n{model}"
            f"[roles.genrm.models.judge]\n{model}{judge}"
            f"[roles.teacher.models.math]\n{model}{math}"
        )

    def kept(text: str) -> dict[str, list[str]]:
        plan = plan_inference_placement(loads_config(text), PluginManager.create())
        return {m.role: [i.label for i in m.items if "sleeps" in i.label] for m in plan.memory}

    # The judge by its engine table, the teacher by its flag; rollout keeps nothing.
    found = kept(
        job(
            "[roles.genrm.models.judge.engine]\nmemory_handoff = true\n",
            'extra_args = ["--memory-handoff"]\n',
        )
    )
    judge = "roles.genrm.models.judge CUDA graphs (kept while it sleeps)"
    math = "roles.teacher.models.math CUDA graphs (kept while it sleeps)"
    assert found == {"rollout": [judge, math], "genrm": [math], "teacher": [judge]}, found
    # Graphs off, or no handoff: the graphs go with the release (nothing kept).
    off = kept(job('extra_args = ["--memory-handoff", "--disable-cuda-graph"]\n', ""))
    assert off == {"rollout": [], "genrm": [], "teacher": []}, off
