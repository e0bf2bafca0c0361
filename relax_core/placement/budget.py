"""The memory budget: per-GPU and per-node host memory from ``<model_path>/config.json`` (what is
counted: ``docs/placement.md``, "Memory budget"); a budget that cannot be computed says why."""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from relax_core.config import JobConfig, ModelConfig
from relax_core.placement.plan import (
    HostMemoryBudget,
    MemoryBudget,
    MemoryItem,
    ModelPlacement,
    Pool,
    Violation,
    Violations,
)

GIB = 1024**3
#: The static fraction assumed when a model gives neither ``mem_fraction_static`` nor
#: ``max_running_requests`` (SGLang's usual default for large GPUs).
DEFAULT_MEM_FRACTION_STATIC = 0.88

_DTYPE_BYTES: Mapping[str, float] = {
    **dict.fromkeys(("float32", "fp32", "float"), 4),
    **dict.fromkeys(("bfloat16", "bf16", "float16", "fp16", "half"), 2),
    **dict.fromkeys(("fp8", "float8_e4m3fn", "fp8_e4m3", "fp8_e5m2", "int8"), 1),
    "int4": 0.5,
}


def dtype_bytes(name: str) -> float | None:
    """Bytes per element of a dtype name (``None`` if unknown)."""
    return _DTYPE_BYTES.get(name.removeprefix("torch."))


@attrs.frozen
class ModelFacts:
    """What the budget needs to know about a model's shape (``None``: unknown)."""

    num_parameters: int
    num_layers: int | None
    num_kv_heads: int | None
    head_dim: int | None
    config_dtype_bytes: float | None
    max_position_embeddings: int | None
    source: str


def _text_config(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    if "hidden_size" not in cfg and isinstance(cfg.get("text_config"), dict):
        return cfg["text_config"]  # type: ignore[no-any-return]
    return cfg


def count_parameters(cfg: Mapping[str, Any]) -> int:
    """Parameters of a Llama/Qwen-style (dense or MoE) decoder from its ``config.json``.

    :raises KeyError: naming the first missing key."""
    c = _text_config(cfg)
    h, layers, heads = c["hidden_size"], c["num_hidden_layers"], c["num_attention_heads"]
    vocab = c["vocab_size"]
    kv = c.get("num_key_value_heads") or heads
    hd = c.get("head_dim") or h // heads
    model_type = str(c.get("model_type", ""))
    attn = h * heads * hd + 2 * h * kv * hd + heads * hd * h
    if c.get("attention_bias") or model_type.startswith("qwen2"):
        attn += heads * hd + 2 * kv * hd
    if model_type.startswith("qwen3"):
        attn += 2 * hd  # q_norm and k_norm
    experts = c.get("num_experts") or c.get("num_local_experts") or c.get("n_routed_experts")
    dense_mlp = 3 * h * c["intermediate_size"] if "intermediate_size" in c else 0
    total_mlp = 0
    if experts:
        moe_inter = c.get("moe_intermediate_size") or c["intermediate_size"]
        shared = c.get("shared_expert_intermediate_size") or (
            (c.get("n_shared_experts") or 0) * moe_inter
        )
        moe_mlp = experts * 3 * h * moe_inter + h * experts + (3 * h * shared if shared else 0)
        step = c.get("decoder_sparse_step") or 1
        dense_layers = set(c.get("mlp_only_layers") or ())
        dense_layers |= set(range(c.get("first_k_dense_replace") or 0))
        for i in range(layers):
            sparse = i not in dense_layers and (i + 1) % step == 0
            total_mlp += moe_mlp if sparse else dense_mlp
    else:
        if "intermediate_size" not in c:
            raise KeyError("intermediate_size")
        total_mlp = layers * dense_mlp
    norms = layers * 2 * h + h
    embed = vocab * h * (1 if c.get("tie_word_embeddings", False) else 2)
    return int(layers * attn + total_mlp + norms + embed)


def _config_dtype_bytes(cfg: Mapping[str, Any]) -> float | None:
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict):
        if "fp8" in str(quant.get("quant_method", "")).lower():
            return 1
        if isinstance(quant.get("bits"), int):
            return float(quant["bits"]) / 8
    c = _text_config(cfg)
    name = c.get("torch_dtype") or c.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
    return dtype_bytes(str(name)) if name else None


def model_facts(model: ModelConfig, cache: dict[str, Any]) -> ModelFacts | str:
    """The model's shape from ``<model_path>/config.json`` and ``num_parameters``, or why it is
    unknown; ``cache``: files already read, by path."""
    path = Path(model.model_path) / "config.json"
    key = str(path)
    if key not in cache:
        try:
            cache[key] = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            cache[key] = f"no config.json at {path} (model_path is not a local model directory)"
        except (OSError, ValueError) as exc:
            cache[key] = f"cannot read {path}: {exc}"
        if not isinstance(cache[key], (dict, str)):
            cache[key] = f"{path} does not hold a JSON object"
    cfg = cache[key]
    given = model.placement.num_parameters
    if isinstance(cfg, str):
        if given is None:
            return f"{cfg}; set num_parameters to budget the weights"
        return ModelFacts(given, None, None, None, None, None, "num_parameters")
    c = _text_config(cfg)
    try:
        params = given or count_parameters(cfg)
    except (KeyError, TypeError, ZeroDivisionError) as exc:
        return f"{path} lacks {exc} needed to count parameters; set num_parameters"
    heads = c.get("num_attention_heads")
    hd = c.get("head_dim") or (c["hidden_size"] // heads if heads and "hidden_size" in c else None)
    return ModelFacts(
        num_parameters=params,
        num_layers=c.get("num_hidden_layers"),
        num_kv_heads=c.get("num_key_value_heads") or heads,
        head_dim=hd,
        config_dtype_bytes=_config_dtype_bytes(cfg),
        max_position_embeddings=c.get("max_position_embeddings"),
        source=key if given is None else f"{key} + num_parameters",
    )


def kv_bytes_per_token(facts: ModelFacts, tp: int, pp: int, kv_bytes: float) -> float | None:
    """KV-cache bytes one token takes on one GPU (KV heads replicated when fewer than ``tp``)."""
    if facts.num_layers is None or facts.num_kv_heads is None or facts.head_dim is None:
        return None
    heads_per_gpu = max(facts.num_kv_heads / tp, 1)
    return 2 * math.ceil(facts.num_layers / pp) * heads_per_gpu * facts.head_dim * kv_bytes


def _weight_bytes(model: ModelConfig, facts: ModelFacts) -> tuple[float, str]:
    if model.engine.dtype != "auto":
        return dtype_bytes(model.engine.dtype) or 2, model.engine.dtype
    if facts.config_dtype_bytes is not None:
        return facts.config_dtype_bytes, "config dtype"
    return 2, "bfloat16 assumed"


def weights_gib_per_gpu(model: ModelConfig, facts: ModelFacts) -> float:
    """The weight shard each GPU of an engine holds, in GiB."""
    per_param, _ = _weight_bytes(model, facts)
    return facts.num_parameters * per_param / (model.placement.tp * model.placement.pp) / GIB


def _engine_items(
    model: ModelConfig, facts: ModelFacts, capacity: float, notes: list[str]
) -> tuple[list[MemoryItem], Violation | None] | str:
    weights = weights_gib_per_gpu(model, facts)
    size, engine = model.placement, model.engine
    wlabel = f"weights ({facts.num_parameters / 1e9:.2f}B params / tp{size.tp} x pp{size.pp})"
    fraction = engine.mem_fraction_static
    requests = engine.max_running_requests
    if fraction is None and requests is not None:
        per_param, _ = _weight_bytes(model, facts)
        kv_b = dtype_bytes(engine.kv_cache_dtype) if engine.kv_cache_dtype != "auto" else per_param
        per_token = kv_bytes_per_token(facts, size.tp, size.pp, kv_b or per_param)
        context = engine.context_length or facts.max_position_embeddings
        if per_token is None or context is None:
            return (
                f"the KV cache needs num_hidden_layers, num_key_value_heads, head_dim and a "
                f"context length, which {facts.source} does not give; set mem_fraction_static"
            )
        kv = per_token * context * requests / GIB
        items = [
            MemoryItem(wlabel, weights),
            MemoryItem(f"KV cache ({requests} requests x {context} tokens)", kv),
        ]
    else:
        if fraction is None:
            fraction = DEFAULT_MEM_FRACTION_STATIC
            notes.append(
                f"{model.path}: assumes SGLang's default mem_fraction_static "
                f"{DEFAULT_MEM_FRACTION_STATIC}; set mem_fraction_static or max_running_requests"
            )
        static = fraction * capacity
        label = f"static pool (mem_fraction_static {fraction:g}; weights {weights:.1f} of it)"
        items = [MemoryItem(label, static)]
        if weights > static:
            return items, Violation(
                f"{model.path}.mem_fraction_static",
                "memory-static",
                f"the weight shard needs {weights:.1f} GiB per GPU but mem_fraction_static "
                f"{fraction:g} x {capacity:g} GiB = {static:.1f} GiB leaves no KV cache; raise "
                "mem_fraction_static, or spread the model over more GPUs (tp/pp)",
            )
    if size.cuda_graph_gib:
        items.append(MemoryItem("CUDA graphs", size.cuda_graph_gib))
    return items, None


def _overlap(a: ModelPlacement, b: ModelPlacement) -> bool:
    return (a.bundle_start or 0) < b.bundle_end and (b.bundle_start or 0) < a.bundle_end


def node_ranges(nodes: Sequence[int]) -> str:
    """``0-3, 7``: sorted indices as ranges."""
    out: list[str] = []
    start = prev = nodes[0]
    for n in [*nodes[1:], None]:
        if n is not None and n == prev + 1:
            prev = n
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ", ".join(out)


def budget_memory(
    config: JobConfig,
    placements: Sequence[ModelPlacement],
    pools: Mapping[str, Pool],
    backups: Collection[str],
    kept_graphs: Collection[str] = (),
) -> tuple[list[MemoryBudget], list[HostMemoryBudget], list[Violation], list[str]]:
    """Budget every GPU placement and every node's host memory: per-placement budgets, per-node
    host budgets, violations and notes. ``backups``, ``kept_graphs``: the ``role.model`` that
    keep a CPU copy of their weights, that keep their CUDA graphs while they sleep."""
    cache: dict[str, Any] = {}
    gpu_capacity = config.cluster.gpu_memory_gib
    training = config.training
    budgets: list[MemoryBudget] = []
    violations = Violations()
    notes: list[str] = []
    host_weights: dict[str, float] = {}  # role.model -> GiB per GPU of backup
    kept: list[tuple[ModelPlacement, str, float]] = []  # what stays while its model sleeps
    for p in placements:
        model = config.role(p.role).model(p.model)
        if p.pool is not None and p.key in kept_graphs and model.placement.cuda_graph_gib:
            kept.append((p, "CUDA graphs", model.placement.cuda_graph_gib))
        if p.pool is not None and not model.engine.offload_weights:
            if isinstance(facts := model_facts(model, cache), str):
                notes.append(f"{p.path}: weights kept while it sleeps not budgeted: {facts}")
            else:
                kept.append((p, "weights", weights_gib_per_gpu(model, facts)))
    for p in placements:
        if p.pool is None:
            continue
        model = config.role(p.role).model(p.model)
        pool = pools[p.pool]
        span = (p.bundle_start or 0, p.bundle_end)
        facts = model_facts(model, cache)

        def skipped(reason: str, p: ModelPlacement = p, span: tuple[int, int] = span) -> None:
            budgets.append(
                MemoryBudget(p.role, p.model, p.pool, p.phase, span, "skipped", note=reason)
            )

        if p.key in backups and not isinstance(facts, str):
            host_weights[p.key] = weights_gib_per_gpu(model, facts)
        elif p.key in backups:
            notes.append(f"{p.path}: CPU weight backup not budgeted: {facts}")
        if gpu_capacity is None:
            skipped("cluster.gpu_memory_gib is not set")
            continue
        if isinstance(facts, str):
            skipped(facts)
            continue
        result = _engine_items(model, facts, gpu_capacity, notes)
        if isinstance(result, str):
            skipped(result)
            continue
        items, violation = result
        if pool.shared and pool.training and training.offload:
            resident = training.offload_resident_gib
            for role in pool.training:
                items.append(MemoryItem(f"training {role} (offloaded, resident)", resident, True))
        for q, what, gib in kept:
            if q.pool == p.pool and q.phase != p.phase and _overlap(q, p):
                items.append(MemoryItem(f"{q.path} {what} (kept while it sleeps)", gib, True))
        total = sum(i.gib for i in items)
        status = "ok"
        if violation is not None:
            violations.append(violation)
            status = "over"
        elif total > gpu_capacity + 1e-9:
            status = "over"
            users = " + ".join(f"{i.label} {i.gib:.1f}" for i in items)
            violations.add(
                p.path,
                "memory-gpu",
                f"needs {total:.1f} GiB per GPU on bundles {span[0]}-{span[1] - 1} of pool "
                f"{p.pool!r} in phase {p.phase!r}, but a GPU has {gpu_capacity:g} GiB "
                f"(cluster.gpu_memory_gib): {users}. Lower mem_fraction_static / "
                "max_running_requests, or raise tp",
            )
        budgets.append(
            MemoryBudget(p.role, p.model, p.pool, p.phase, span, status, gpu_capacity, tuple(items))
        )
    host, host_violations = _budget_host(config, placements, pools, host_weights)
    return budgets, host, violations + host_violations, notes


def _budget_host(
    config: JobConfig,
    placements: Sequence[ModelPlacement],
    pools: Mapping[str, Pool],
    host_weights: Mapping[str, float],
) -> tuple[list[HostMemoryBudget], list[Violation]]:
    gpn = config.cluster.gpus_per_node
    per_node: dict[int, dict[str, float]] = {}

    def add(pool: Pool, start: int, end: int, label: str, gib_per_gpu: float) -> None:
        for local in range(pool.local_node(start), pool.local_node(max(end - 1, start)) + 1):
            lo, hi = max(start, local * gpn), min(end, (local + 1) * gpn)
            if hi <= lo or local >= len(pool.nodes):
                continue
            node = per_node.setdefault(pool.nodes[local], {})
            node[label] = node.get(label, 0.0) + gib_per_gpu * (hi - lo)

    for p in placements:
        if p.pool is not None and p.pool in pools and p.key in host_weights:
            label, gib = f"{p.path} CPU weight backup", host_weights[p.key]
            add(pools[p.pool], p.bundle_start or 0, p.bundle_end, label, gib)
    training = config.training
    if training.offload and training.offload_host_gib:
        for pool in pools.values():
            for role in pool.training:
                label = f"training {role} offloaded state"
                add(pool, 0, pool.size, label, training.offload_host_gib)
    capacity = config.cluster.host_memory_gib
    groups: dict[tuple[MemoryItem, ...], list[int]] = {}
    for node, load in sorted(per_node.items()):
        items = tuple(MemoryItem(label, gib) for label, gib in sorted(load.items()))
        groups.setdefault(items, []).append(node)
    out: list[HostMemoryBudget] = []
    violations = Violations()
    for items, nodes in groups.items():
        total = sum(i.gib for i in items)
        if capacity is None:
            note = "cluster.host_memory_gib is not set"
            out.append(HostMemoryBudget(tuple(nodes), "skipped", None, items, note))
            continue
        status = "over" if total > capacity + 1e-9 else "ok"
        out.append(HostMemoryBudget(tuple(nodes), status, capacity, items))
        if status == "over":
            users = " + ".join(f"{i.label} {i.gib:.1f}" for i in items)
            violations.add(
                "cluster.host_memory_gib",
                "memory-host",
                f"node(s) {node_ranges(nodes)} each need {total:.1f} GiB of host memory but "
                f"have {capacity:g} GiB: {users}. Set weights_cpu_backup = false or "
                "offload_weights = false on some models, or spread them over more nodes",
            )
    return out, violations
