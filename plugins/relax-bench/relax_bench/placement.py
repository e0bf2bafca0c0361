"""``relax bench placement``: preflight-planning a 512-node x 8-GPU job, against a 50 ms budget.

The job has three roles and six models (one of them cross-node, one with a KV-cache budget)
whose ``config.json`` files are written to a temporary directory and read by the planner, as
in real use. The roles are the benchmark's own records (a batch generator and two deferrable
scorers, shaped like a policy, a reward model and a teacher), so it needs no role plugin.
Each mode (split, defer, decoupled) is planned ``repeats`` times; the median is
compared with the budget and, as a ratio, with a baseline measured in the same run: parsing
the job's TOML text into a ``JobConfig``.
"""

from __future__ import annotations

import functools
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from relax_core import PluginManager, RoleSpec, loads_config, module_plugin, preflight

NODES = 512
GPUS_PER_NODE = 8
BUDGET_MS = 50.0

_SHAPES = {
    "qwen2-7b": {
        "model_type": "qwen2",
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "torch_dtype": "bfloat16",
        "max_position_embeddings": 32768,
    },
    "llama3-70b": {
        "model_type": "llama",
        "hidden_size": 8192,
        "intermediate_size": 28672,
        "num_hidden_layers": 80,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "vocab_size": 128256,
        "torch_dtype": "bfloat16",
    },
}

#: The benchmark's roles: what a policy, a generative reward model and a teacher declare.
ROLES = (
    RoleSpec(
        name="generator",
        allowed_weight_sources={"ACTOR", "DCS"},
        default_route_mode="SGLANG_ROUTER",
        default_weight_source="ACTOR",
        generation_phase=True,
    ),
    RoleSpec(
        name="scorer",
        allowed_weight_sources={"STATIC"},
        default_route_mode="DIRECT",
        deferrable=True,
    ),
    RoleSpec(
        name="distiller",
        allowed_weight_sources={"STATIC"},
        default_route_mode="DIRECT",
        deferrable=True,
    ),
)

# (role, model, shape, GPUs in shared modes, gpus_per_engine, tp, pp, extra TOML lines)
_MODELS = (
    ("generator", "policy", "qwen2-7b", 2048, 8, 8, 1, "mem_fraction_static = 0.7"),
    ("generator", "draft", "qwen2-7b", 512, 4, 4, 1, "mem_fraction_static = 0.7"),
    ("scorer", "judge", "llama3-70b", 512, 16, 8, 2, "mem_fraction_static = 0.8"),
    ("scorer", "judge-small", "qwen2-7b", 256, 2, 2, 1, "mem_fraction_static = 0.7"),
    ("distiller", "math", "llama3-70b", 512, 8, 8, 1, "mem_fraction_static = 0.85"),
    (
        "distiller",
        "code",
        "qwen2-7b",
        256,
        8,
        8,
        1,
        "max_running_requests = 64\ncontext_length = 16384",
    ),
)


def job_toml(models_dir: Path, mode: str) -> str:
    """The benchmark job as TOML text for ``mode``."""
    shared = mode != "decoupled"
    scale = 1 if shared else 2
    lines = [
        "[cluster]",
        f"num_nodes = {NODES}",
        f"gpus_per_node = {GPUS_PER_NODE}",
        "gpu_memory_gib = 80",
        "host_memory_gib = 2048",
        "[training]",
        f"actor_gpus = {NODES * GPUS_PER_NODE // scale}",
        f"colocate = {str(shared).lower()}",
        "offload = true",
        "[placement]",
        f'mode = "{mode}"',
    ]
    if mode == "defer":
        lines.append('defer_roles = ["scorer", "distiller"]')
    for role, name, shape, gpus, gpe, tp, pp, extra in _MODELS:
        lines += [
            f'[roles.{role}.models."{name}"]',
            'backend = "sglang"',
            f'model_path = "{models_dir / shape}"',
            f"num_gpus = {gpus // scale}",
            f"gpus_per_engine = {gpe}",
            f"tp = {tp}",
            f"pp = {pp}",
            extra,
        ]
    return "\n".join(lines) + "\n"


def plugin_manager() -> PluginManager:
    """The core's built-ins and the benchmark's :data:`ROLES` (no entry points)."""

    def register(register: Callable[[RoleSpec], None]) -> None:
        for spec in ROLES:
            register(spec)

    plugin = module_plugin("bench-roles", relax_register_roles=register)
    return PluginManager.create(entry_points=False, plugins=[("bench-roles", plugin)])


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def run(quick: bool) -> dict[str, Any]:
    """Plan the job in every built-in mode; report medians, the budget and the ratios."""
    repeats = 5 if quick else 30
    pm = plugin_manager()
    plan_ms: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models_dir = Path(tmp)
        for shape, cfg in _SHAPES.items():
            (models_dir / shape).mkdir()
            (models_dir / shape / "config.json").write_text(json.dumps(cfg))
        texts = {mode: job_toml(models_dir, mode) for mode in ("split", "defer", "decoupled")}
        parse_ms = _median_ms(lambda: loads_config(texts["split"]), repeats)
        for mode, text in texts.items():
            config = loads_config(text)
            result = preflight(config, pm)
            if result.plan is None:
                raise RuntimeError(f"benchmark job ({mode}) rejected: {result.violations[:3]}")
            plan_ms[mode] = _median_ms(functools.partial(preflight, config, pm), repeats)
    worst = max(plan_ms.values())
    return {
        "nodes": NODES,
        "gpus": NODES * GPUS_PER_NODE,
        "roles": len(ROLES),
        "models": len(_MODELS),
        "repeats": repeats,
        "budget_ms": BUDGET_MS,
        "plan_ms": {k: round(v, 3) for k, v in plan_ms.items()},
        "plan_ms_worst": round(worst, 3),
        "baseline_parse_ms": round(parse_ms, 3),
        "ratio_plan_to_parse": round(worst / parse_ms, 2),
        "ratio_plan_to_budget": round(worst / BUDGET_MS, 3),
        "within_budget": worst <= BUDGET_MS,
    }


def format_result(result: dict[str, Any]) -> str:
    """A short human-readable report."""
    modes = ", ".join(f"{k} {v:.2f} ms" for k, v in result["plan_ms"].items())
    verdict = "within" if result["within_budget"] else "OVER"
    return (
        f"placement preflight, {result['nodes']} nodes x {GPUS_PER_NODE} GPUs, "
        f"{result['roles']} roles, {result['models']} models (median of {result['repeats']}):\n"
        f"  plan: {modes}\n"
        f"  worst {result['plan_ms_worst']:.2f} ms = {result['ratio_plan_to_budget']:.0%} of the "
        f"{result['budget_ms']:g} ms budget ({verdict})\n"
        f"  baseline (parse the TOML): {result['baseline_parse_ms']:.2f} ms; plan/parse = "
        f"{result['ratio_plan_to_parse']:.1f}x"
    )
