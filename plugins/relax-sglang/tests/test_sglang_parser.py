"""Every command line the sglang backend builds parses with SGLang's own parser, as meant.

For every example job under docs/examples/, every engine process ``relax serve`` would launch
(each node of each replica, prefill and decode workers included) gets its command line from
the backend, and ``sglang.srt.server_args.prepare_server_args`` — SGLang's own, at the version
this project pins — parses it; each value the backend set must come back as meant. A flag
SGLang does not know makes its argparse exit, which fails the test.

``nox -s sglang`` installs SGLang (without its GPU stack) and runs this module with
``RELAX_REQUIRE_SGLANG=1``, so a missing SGLang fails there; elsewhere it is skipped.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from relax_sglang.server_args import disaggregation_mode, launch_server_argv

from relax_core import EngineLaunchSpec, PluginManager, engine_launch_specs, load_config

if os.environ.get("RELAX_REQUIRE_SGLANG") == "1":
    from sglang.srt import server_args as sglang_server_args
else:
    sglang_server_args = pytest.importorskip(
        "sglang.srt.server_args", reason="SGLang is not installed here; `nox -s sglang` runs this"
    )

#: The pinned SGLang version (noxfile.py installs it).
PINNED = "0.5.23"
EXAMPLES = sorted((Path(__file__).parents[3] / "docs" / "examples").glob("*.toml"))
_DTYPE = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32"}
_KV = {"fp8": "fp8_e4m3", "float8_e4m3fn": "fp8_e4m3", "bf16": "bfloat16"}


def _engines() -> list[tuple[str, EngineLaunchSpec]]:
    pm = PluginManager.create()
    out = []
    for path in EXAMPLES:
        config = load_config(path)
        backends = {m.path: m.backend for m in config.models()}
        for model_path, engines in engine_launch_specs(config, pm).items():
            if backends[model_path] != "sglang":
                continue
            for workers in engines.values():
                out += [(f"{path.name}:{spec.engine_id}", spec) for spec in workers]
    return out


def _expected(spec: EngineLaunchSpec, port: int, bootstrap: int | None) -> dict[str, Any]:
    opts = spec.options
    want: dict[str, Any] = {
        "model_path": spec.model_path,
        "host": spec.host,
        "port": port,
        "tp_size": spec.tp,
        "pp_size": spec.pp,
        "nnodes": spec.nnodes,
        "node_rank": spec.node_rank,
        "enable_memory_saver": True,
        "enable_weights_cpu_backup": bool(opts.weights_cpu_backup) or spec.static,
        "enable_deterministic_inference": bool(opts.deterministic_inference),
        "dp_size": opts.dp,
        "enable_dp_attention": opts.dp_attention,
        "served_model_name": spec.served_model_name,
        "disaggregation_mode": disaggregation_mode(spec) or "null",
    }
    if spec.nnodes > 1:
        want["dist_init_addr"] = spec.dist_init_addr
    if spec.seed is not None:
        want["random_seed"] = spec.seed
    if spec.weight_version:
        want["weight_version"] = spec.weight_version
    if opts.dtype != "auto":
        want["dtype"] = _DTYPE.get(opts.dtype, opts.dtype)
    if opts.kv_cache_dtype != "auto":
        want["kv_cache_dtype"] = _KV.get(opts.kv_cache_dtype, opts.kv_cache_dtype)
    for key in ("mem_fraction_static", "context_length", "max_running_requests"):
        if getattr(opts, key) is not None:
            want[key] = getattr(opts, key)
    if bootstrap is not None:
        want["disaggregation_bootstrap_port"] = bootstrap
    # The model's own overrides, --flag value or a bare --flag (true).
    args = list(opts.extra_args)
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            value = args[i + 1] if i + 1 < len(args) and not args[i + 1].startswith("--") else True
            want[arg[2:].replace("-", "_")] = value
    return want


ENGINES = _engines()


def test_the_pinned_sglang_is_the_one_installed() -> None:
    import importlib.metadata

    assert importlib.metadata.version("sglang") == PINNED


def test_the_examples_include_single_node_multi_node_and_pd_sglang_jobs() -> None:
    specs = [spec for _, spec in ENGINES]
    assert any(s.nnodes > 1 for s in specs)
    assert {disaggregation_mode(s) for s in specs} >= {"prefill", "decode", None}
    assert any(s.static for s in specs) and any(not s.static for s in specs)


@pytest.mark.parametrize(("name", "spec"), ENGINES, ids=[name for name, _ in ENGINES])
def test_every_built_command_line_parses_with_sglangs_parser_as_meant(
    name: str, spec: EngineLaunchSpec
) -> None:
    port = 30000 + spec.replica_index
    bootstrap = 8998 + spec.replica_index if disaggregation_mode(spec) == "prefill" else None
    argv = launch_server_argv(spec, port=port, bootstrap_port=bootstrap)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    parsed = sglang_server_args.prepare_server_args(argv[3:])
    wrong = {
        key: (want, getattr(parsed, key, "<missing>"))
        for key, want in _expected(spec, port, bootstrap if spec.node_rank == 0 else None).items()
        if str(getattr(parsed, key, "<missing>")) != str(want)
    }
    assert wrong == {}, f"{name}: {' '.join(argv[3:])}"


def test_a_flag_sglang_does_not_know_fails_the_parse() -> None:
    _, spec = ENGINES[0]
    argv = launch_server_argv(spec, port=30000, bootstrap_port=8998)
    with pytest.raises(SystemExit):
        sglang_server_args.prepare_server_args([*argv[3:], "--tensor-paralel-size", "2"])
