"""``relax-hf gpu-bench``: a ~1B-parameter random model on CUDA, measured end to end.

What it measures, all in one run against a real engine process:

- device memory held before and after releasing ``weights`` + ``kv_cache`` (torch's reserved
  bytes and the device-level used bytes; at least 90% of what the engine holds should go);
- time to resume the weights from the pinned CPU backup, against a pinned host-to-device copy
  of the same number of bytes measured in this process (ratio >= 0.5 expected);
- ``/update_weights_from_tensor`` throughput in GB/s (CUDA IPC handles, SGLang's format);
- decode throughput (output tokens/s over HTTP, 128 new tokens per request) at concurrency 1,
  16 and 64, against the memory-bandwidth roofline of one decode step: the weight bytes over
  the device-to-device copy bandwidth measured in this run (bytes read plus bytes written, as
  a copy moves them), i.e. the steps/s a forward pass that only read the weights once could
  make. ``decode.c1_over_roofline`` is concurrency 1 against that limit.

The model is made from a config (Llama architecture, random bf16 weights, no download).
``--device cpu`` runs the same steps on a tiny model as a smoke test (no pinned memory there:
the baseline is then a host memcpy).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

__all__ = ["SIZES", "format_result", "make_random_model", "run"]

#: Llama shapes by name; ``1b`` has about 1.14B parameters.
SIZES: Mapping[str, Mapping[str, int]] = {
    "1b": {
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "vocab_size": 32000,
    },
    "tiny": {
        "hidden_size": 256,
        "intermediate_size": 1024,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "vocab_size": 512,
    },
}


def make_random_model(directory: Path, size: str, dtype: str, seed: int = 0) -> dict[str, Any]:
    """Write a random Llama checkpoint of ``size`` (from a config) with the tiny tokenizer."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from relax_hf.tiny import make_tiny_model

    make_tiny_model(
        directory, seed=seed, size="micro"
    )  # tokenizer, chat template, generation config
    for f in directory.glob("*.safetensors"):
        f.unlink()
    shape = dict(SIZES[size])
    config = LlamaConfig(
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        eos_token_id=2,
        pad_token_id=3,
        **shape,
    )
    with torch.device("meta"):
        names = {n: (tuple(p.shape)) for n, p in LlamaForCausalLM(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    tensors = {}
    for name, shp in names.items():
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(shp, dtype=torch_dtype)
        else:
            tensors[name] = (torch.randn(shp, generator=gen) * 0.02).to(torch_dtype)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(directory)
    params = sum(t.numel() for t in tensors.values())
    return {
        "parameters": params,
        "bytes": sum(t.numel() * t.element_size() for t in tensors.values()),
    }


def _d2d_bandwidth(device: str, nbytes: int = 1 << 31, repeats: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s (read plus write), median of ``repeats``."""
    import torch

    if not device.startswith("cuda"):
        nbytes = min(nbytes, 1 << 28)
        src = torch.ones(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return 2 * nbytes / statistics.median(times[1:])
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats + 2):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times[2:])


def _h2d_baseline(nbytes: int, device: str, repeats: int = 3) -> float:
    """Seconds for one pinned host-to-device copy of ``nbytes`` (median of ``repeats``)."""
    import torch

    if not device.startswith("cuda"):
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        times = []
        for _ in range(repeats + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return statistics.median(times[1:])
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return statistics.median(times[1:])


async def _update_throughput(
    url: str, model_dir: Path, device: str, bucket_bytes: int
) -> dict[str, Any]:
    """Push every weight (random values) through /update_weights_from_tensor in buckets."""
    import torch
    from relax_torch_weights import serialize_named_tensors
    from safetensors import safe_open

    from relax_core import ControlClient

    with safe_open(str(model_dir / "model.safetensors"), framework="pt") as f:
        specs = [(k, f.get_slice(k).get_shape(), f.get_slice(k).get_dtype()) for k in f.keys()]  # noqa: SIM118
    dtypes = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
    where = device if device.startswith("cuda") else "cpu"
    load_format = None if where != "cpu" else "safetensors"
    total, wall, server_load = 0, 0.0, 0.0
    async with ControlClient(url, timeout=600) as client:
        bucket: list[tuple[str, Any]] = []
        size = 0
        for i, (name, shape, dt) in enumerate(specs):
            t = torch.randn(shape, dtype=torch.float32, device=where).to(dtypes[dt]) * 0.02
            bucket.append((name, t))
            size += t.numel() * t.element_size()
            if size < bucket_bytes and i < len(specs) - 1:
                continue
            if where != "cpu":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            payload = serialize_named_tensors(bucket, load_format=load_format)
            answer = await client.update_weights_from_tensor(
                [payload], load_format=load_format, flush_cache=False
            )
            wall += time.perf_counter() - t0
            server_load += float(answer["detail"]["load_seconds"])
            total += size
            bucket, size = [], 0
    return {
        "bytes": total,
        "seconds": wall,
        "gb_per_s": total / wall / 1e9,
        "server_load_seconds": server_load,
        "format": "torch IPC (SGLang default)" if load_format is None else "safetensors",
    }


def run(
    device: str = "cuda",
    quick: bool = False,
    size: str | None = None,
    mem_fraction: float = 0.85,
    torch_compile: bool = False,
    settle_s: float = 2.0,
    overlap_schedule: bool = True,
    attention_backend: Literal["triton", "torch_native"] | None = None,
) -> dict[str, Any]:
    """Make the model, start the engine on ``device``, measure, stop; return the numbers."""
    from transformers.utils import logging as hf_logging

    from relax_core import ControlClient, EngineLaunchSpec, EngineOptions
    from relax_hf.bench import measure_throughput
    from relax_hf.options import HFEngineOptions
    from relax_hf.plugin import launch

    hf_logging.disable_progress_bar()
    cuda = device.startswith("cuda")
    size = size or ("1b" if cuda else "tiny")
    dtype = "bfloat16" if cuda else "float32"
    result: dict[str, Any] = {
        "benchmark": "hf-engine-gpu",
        "device": device,
        "size": size,
        "dtype": dtype,
        "torch_compile": torch_compile,
        "overlap_schedule": overlap_schedule,
        "resume_settle_seconds": settle_s,
    }
    with tempfile.TemporaryDirectory(prefix="relax-hf-gpu-bench-") as tmp:
        model_dir = Path(tmp) / "model"
        t0 = time.perf_counter()
        result["model"] = make_random_model(model_dir, size, dtype)
        result["model"]["make_seconds"] = time.perf_counter() - t0
        log = Path(tmp) / "engine.log"
        spec = EngineLaunchSpec(
            engine_id="gpu-bench",
            model_path=str(model_dir),
            device=device,
            log_path=str(log),
            options=EngineOptions(
                dtype=dtype,
                weights_cpu_backup=True,
                mem_fraction_static=mem_fraction if cuda else None,
            ),
            backend_options=HFEngineOptions(
                enable_torch_compile=torch_compile,
                disable_overlap_schedule=not overlap_schedule,
                attention_backend=attention_backend,
            ),
        )
        t0 = time.perf_counter()
        proc = launch(spec)
        try:
            proc.wait_ready(900)
            result["engine_start_seconds"] = time.perf_counter() - t0
            url = proc.base_url or ""
            result.update(
                asyncio.run(
                    _measure(
                        url,
                        model_dir,
                        device,
                        quick,
                        ControlClient,
                        measure_throughput,
                        settle_s=settle_s,
                    )
                )
            )
            result["h2d_baseline_seconds"] = _h2d_baseline(result["memory"]["param_bytes"], device)
            result["resume_vs_pinned_h2d_ratio"] = (
                result["h2d_baseline_seconds"] / result["resume_weights_seconds"]
            )
            result["resume_right_after_release_vs_pinned_h2d_ratio"] = (
                result["h2d_baseline_seconds"] / result["resume_right_after_release_seconds"]
            )
            result["h2d_baseline_gb_per_s"] = (
                result["memory"]["param_bytes"] / result["h2d_baseline_seconds"] / 1e9
            )
            bandwidth = _d2d_bandwidth(device)
            dec = result["decode"]
            dec["d2d_copy_gb_per_s"] = bandwidth / 1e9
            dec["weight_bytes"] = result["memory"]["param_bytes"]
            dec["roofline_steps_per_s"] = bandwidth / result["memory"]["param_bytes"]
            dec["c1_over_roofline"] = dec["c1_tokens_per_s"] / dec["roofline_steps_per_s"]
        except BaseException:
            result["engine_log_tail"] = proc.log_tail()
            raise
        finally:
            proc.terminate(30)
    mem = result["memory"]
    dec = result["decode"]
    result["checks"] = {
        "freed_fraction_reserved>=0.9": mem["freed_fraction_reserved"] >= 0.9,
        "resume_vs_pinned_h2d_ratio>=0.9": result["resume_vs_pinned_h2d_ratio"] >= 0.9,
        "c1_over_roofline>=0.2": dec["c1_over_roofline"] >= 0.2,
        "c64_tokens_per_s>=10000": dec["c64_tokens_per_s"] >= 10_000,
    }
    return result


async def _measure(
    url: str,
    model_dir: Path,
    device: str,
    quick: bool,
    client_cls: Any,
    throughput: Any,
    settle_s: float = 2.0,
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    tokens = 32 if quick else 128
    await throughput(url, concurrency=8, requests_per_client=1, max_new_tokens=16)  # warm-up
    decode: dict[str, Any] = {"max_new_tokens": tokens}
    for c, per_client in ((1, 2 if quick else 4), (16, 1 if quick else 2), (64, 1 if quick else 2)):
        r = await throughput(
            url, concurrency=c, requests_per_client=per_client, max_new_tokens=tokens
        )
        decode[f"c{c}_tokens_per_s"] = r["tokens_per_s"]
        decode[f"c{c}"] = r
    decode["c16_over_c1"] = decode["c16_tokens_per_s"] / decode["c1_tokens_per_s"]
    decode["c64_over_c1"] = decode["c64_tokens_per_s"] / decode["c1_tokens_per_s"]
    async with client_cls(url, timeout=600) as c:
        info = await c.server_info()
        decode["cuda_graphs"] = info["memory"]["cuda_graphs"]
        decode["attention_backend"] = info.get("attention_backend")
        # The overlapped schedule: decode steps started before the last one's tokens were
        # appended, and those of them left unused.
        decode["steps"] = {
            k: info.get(f"decode_steps{k}_total") for k in ("", "_ahead", "_ahead_dropped")
        }
        decode["kv_cache"] = info["memory"]["kv_cache"]
    out["decode"] = decode
    async with client_cls(url, timeout=600) as c:
        before = (await c.server_info())["memory"]
        await c.release_memory(["weights", "kv_cache"])
        after = (await c.server_info())["memory"]
        resumes, walls, allocs = [], [], []
        for i in range(2 if quick else 3):
            if i:
                await c.release_memory(["weights", "kv_cache"])
            # As between two RL steps, the release has had time to settle: right after one,
            # copies to the device run at about half speed (out["resume_right_after_release"]).
            await asyncio.sleep(settle_s)
            t0 = time.perf_counter()
            answer = await c.resume_memory(["weights", "kv_cache"])
            walls.append(time.perf_counter() - t0)
            resumes.append(float(answer["detail"]["weights"]["seconds"]))
            allocs.append(float(answer["detail"]["weights"].get("alloc_seconds", 0.0)))
        await c.release_memory(["weights", "kv_cache"])
        answer = await c.resume_memory(["weights", "kv_cache"])
        out["resume_right_after_release_seconds"] = float(answer["detail"]["weights"]["seconds"])
        resumed = (await c.server_info())["memory"]
    mem: dict[str, Any] = {
        "param_bytes": before["param_bytes"],
        "before": before,
        "after_release": after,
        "after_resume": resumed,
    }
    if "cuda_memory_reserved" in before:
        mem["freed_fraction_reserved"] = 1 - after["cuda_memory_reserved"] / max(
            1, before["cuda_memory_reserved"]
        )
        used_before = before["cuda_device_total"] - before["cuda_device_free"]
        used_after = after["cuda_device_total"] - after["cuda_device_free"]
        mem["device_used_before"], mem["device_used_after"] = used_before, used_after
        mem["device_freed_bytes"] = used_before - used_after
        mem["device_freed_over_param_bytes"] = (used_before - used_after) / before["param_bytes"]
    else:
        mem["freed_fraction_reserved"] = 1 - after["resident_param_bytes"] / max(
            1, before["resident_param_bytes"]
        )
        mem["rss_freed_bytes"] = before["process_rss_bytes"] - after["process_rss_bytes"]
    out["memory"] = mem
    out["resume_weights_seconds"] = statistics.median(resumes)
    out["resume_weights_all_seconds"] = resumes
    out["resume_alloc_seconds"] = allocs
    out["resume_http_round_trip_seconds"] = statistics.median(walls)
    out["resume_gb_per_s"] = before["param_bytes"] / out["resume_weights_seconds"] / 1e9
    out["tensor_update"] = await _update_throughput(
        url, model_dir, device, bucket_bytes=(256 if quick else 1024) << 20
    )
    return out


def format_result(result: dict[str, Any]) -> str:
    """A human-readable summary of :func:`run`'s result."""
    mem, upd, dec = result["memory"], result["tensor_update"], result["decode"]
    params = result["model"]["parameters"] / 1e9
    steps = dec.get("steps") or {}
    lines = [
        f"hf engine on {result['device']}: {result['size']} model, {params:.2f}B params, "
        f"{mem['param_bytes'] / 2**30:.2f} GiB of weights ({result['dtype']})",
        f"  release weights+kv_cache: freed {mem['freed_fraction_reserved'] * 100:.1f}% "
        "of what the engine reserved",
        f"  resume weights: {result['resume_weights_seconds'] * 1e3:.1f} ms "
        f"({result['resume_gb_per_s']:.1f} GB/s); pinned H2D of the same bytes: "
        f"{result['h2d_baseline_seconds'] * 1e3:.1f} ms; "
        f"ratio {result['resume_vs_pinned_h2d_ratio']:.2f}",
        f"  tensor update: {upd['gb_per_s']:.2f} GB/s ({upd['format']})",
        f"  decode: c1 {dec['c1_tokens_per_s']:.0f} tok/s, c16 {dec['c16_tokens_per_s']:.0f} "
        f"tok/s, c64 {dec['c64_tokens_per_s']:.0f} tok/s; roofline "
        f"{dec['roofline_steps_per_s']:.0f} steps/s "
        f"(D2D copy {dec['d2d_copy_gb_per_s']:.0f} GB/s); "
        f"c1 at {dec['c1_over_roofline'] * 100:.1f}% of it",
        f"  overlapped schedule: {'on' if result.get('overlap_schedule', True) else 'off'}; "
        f"decode steps {steps.get('') or 0}, started ahead {steps.get('_ahead') or 0} "
        f"({steps.get('_ahead_dropped') or 0} left unused)",
        f"  checks: {json.dumps(result['checks'])}",
    ]
    return "\n".join(lines)
