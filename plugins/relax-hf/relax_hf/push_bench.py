"""``relax-hf push-bench``: a bucketed weight push into a real engine, against copies of the
same bytes in the same run.

A checkpoint's weights (made with ``make-tiny-model``) are loaded in this process, on the
engine's device, and pushed into an engine process started on the same device, once per bucket
size: each bucket one ``/update_weights_from_tensor`` call — on CUDA SGLang's
``flattened_bucket`` (one flat buffer, one IPC handle per bucket), on CPU one safetensors file
per bucket — with the version moving on the last call only, as the manager's bucketed update
does. Each push is timed end to end (flattening, serialization, the calls) and checked: the
engine's weights equal the pushed ones (``/get_weights_by_name``: every parameter, whole on
CPU, its first rows on CUDA).

The baselines, measured in this process on the same byte count: a pinned host-to-device copy
and a device-to-device copy (on CPU both are host memory copies). ``vs_h2d`` and ``vs_d2d`` are
the baseline's seconds over the push's (1.0: as fast as that copy).
"""

from __future__ import annotations

import asyncio
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_BUCKETS", "format_result", "run"]

#: Bucket sizes measured by default; 0 is the whole model in one bucket.
DEFAULT_BUCKETS = (64 << 20, 256 << 20, 512 << 20, 1 << 30, 0)


def _copy_seconds(nbytes: int, device: str, *, source: str, repeats: int) -> float:
    """Median seconds of one copy of ``nbytes`` into a device buffer from a pinned host buffer
    (``source="host"``) or another device buffer (``"device"``); host memcpy on CPU."""
    import torch

    cuda = device.startswith("cuda")
    where = device if cuda else "cpu"
    if source == "host":
        src = torch.ones(nbytes, dtype=torch.uint8, pin_memory=cuda)
    else:
        src = torch.ones(nbytes, dtype=torch.uint8, device=where)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=where)
    times = []
    for _ in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=cuda)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return statistics.median(times[1:])


async def _push(
    client: Any, weights: dict[str, Any], bucket_bytes: int, version: str, cuda: bool
) -> dict[str, Any]:
    """One bucketed push of ``weights``; the engine's version moves with the last bucket."""
    import torch
    from relax_torch_weights import flatten_bucket, serialize_bucket, serialize_named_tensors

    from relax_core import plan_weight_buckets

    total = sum(t.numel() * t.element_size() for t in weights.values())
    buckets = plan_weight_buckets(weights.items(), bucket_bytes or total)
    held = await client.weight_version()
    load_format = "flattened_bucket" if cuda else "safetensors"
    began = time.perf_counter()
    engine_seconds = 0.0
    for i, bucket in enumerate(buckets):
        last = i == len(buckets) - 1
        if cuda:
            flat = flatten_bucket(bucket, weights)
            torch.cuda.synchronize()
            payload = serialize_bucket(bucket, flat)
        else:
            named = [(n, weights[n]) for n in bucket.names]
            payload = serialize_named_tensors(named, load_format=load_format)
        answer = await client.update_weights_from_tensor(
            [payload],
            load_format=load_format,
            weight_version=version if last else held,
            flush_cache=last,
        )
        engine_seconds += float(answer["detail"]["load_seconds"])
        del payload
    seconds = time.perf_counter() - began
    return {
        "bucket_bytes": bucket_bytes or total,
        "buckets": len(buckets),
        "bytes": total,
        "seconds": seconds,
        "gb_per_s": total / seconds / 1e9,
        "engine_load_seconds": engine_seconds,
        "format": load_format,
    }


async def _check(url: str, weights: dict[str, Any], rows: int) -> list[str]:
    """Names whose first ``rows`` rows the engine does not hold as pushed."""
    import aiohttp
    import torch

    wrong = []
    async with aiohttp.ClientSession() as session:
        for name, tensor in weights.items():
            body = {"name": name, "truncate_size": rows}
            async with session.post(f"{url}/get_weights_by_name", json=body) as resp:
                values = await resp.json()
            held = torch.tensor(values, dtype=torch.float64)
            pushed = tensor[:rows] if tensor.dim() else tensor
            if not torch.equal(held, pushed.detach().cpu().to(torch.float64)):
                wrong.append(name)
    return wrong


async def _measure(
    url: str, weights: dict[str, Any], buckets: Sequence[int], cuda: bool, repeats: int
) -> list[dict[str, Any]]:
    from relax_core import ControlClient

    out = []
    async with ControlClient(url, timeout=600) as client:
        await _push(client, weights, buckets[0], "warm-up", cuda)  # allocator, first calls
        for size in buckets:
            runs = [
                await _push(client, weights, size, f"push-{size}-{r}", cuda) for r in range(repeats)
            ]
            best = min(runs, key=lambda r: r["seconds"])
            best["seconds_all"] = [r["seconds"] for r in runs]
            best["seconds"] = statistics.median(best["seconds_all"])
            best["gb_per_s"] = best["bytes"] / best["seconds"] / 1e9
            # As JSON floats: every value on CPU (a tiny model), the first rows on CUDA.
            best["checked_rows"] = 1 << 40 if not cuda else 4
            best["weights_equal"] = await _check(url, weights, best["checked_rows"]) == []
            out.append(best)
    return out


def run(
    model: str | Path,
    *,
    device: str = "cuda",
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    repeats: int = 3,
    log_dir: str | Path | None = None,
) -> dict[str, Any]:
    """Start an engine on ``device`` with ``model``, push its own weights into it once per
    bucket size (``0``: the whole model), ``repeats`` times each, and measure the two copies;
    return the numbers (``ok``: every push left the engine's weights equal to the pushed ones).

    Blocks; the engine is stopped before it returns.

    :raises LifecycleError: the engine did not start (its log quoted).
    """
    import torch
    from safetensors.torch import load_file

    from relax_core import EngineLaunchSpec, EngineOptions
    from relax_hf.plugin import launch

    cuda = device.startswith("cuda")
    files = sorted(Path(model).glob("*.safetensors"))
    weights: dict[str, Any] = {}
    for path in files:
        weights.update(load_file(str(path), device=device if cuda else "cpu"))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    result: dict[str, Any] = {
        "benchmark": "hf-engine-push",
        "device": device,
        "model": str(model),
        "parameters": sum(t.numel() for t in weights.values()),
        "bytes": total,
        "dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in weights.values()}),
        "torch": torch.__version__,
    }
    with tempfile.TemporaryDirectory(prefix="relax-hf-push-bench-") as tmp:
        spec = EngineLaunchSpec(
            engine_id="push-bench",
            model_path=str(model),
            device=device,
            log_path=str(Path(log_dir or tmp) / "push-bench-engine.log"),
            options=EngineOptions(mem_fraction_static=0.5 if cuda else None),
        )
        t0 = time.perf_counter()
        proc = launch(spec)
        try:
            proc.wait_ready(900)
            result["engine_start_seconds"] = time.perf_counter() - t0
            pushes = asyncio.run(_measure(proc.base_url or "", weights, buckets, cuda, repeats))
        finally:
            proc.terminate(30)
    h2d = _copy_seconds(total, device, source="host", repeats=repeats)
    d2d = _copy_seconds(total, device, source="device", repeats=repeats)
    result["h2d_pinned_seconds"] = h2d
    result["d2d_seconds"] = d2d
    result["h2d_pinned_gb_per_s"] = total / h2d / 1e9
    result["d2d_gb_per_s"] = total / d2d / 1e9
    for push in pushes:
        push["vs_h2d"] = h2d / push["seconds"]
        push["vs_d2d"] = d2d / push["seconds"]
    result["pushes"] = pushes
    result["ok"] = all(p["weights_equal"] for p in pushes)
    return result


def format_result(result: dict[str, Any]) -> str:
    """A few human-readable lines of :func:`run`'s result."""
    lines = [
        f"{result['device']}: {result['bytes'] / 1e9:.3f} GB of weights "
        f"({result['parameters'] / 1e6:.1f}M parameters, {', '.join(result['dtypes'])}); "
        f"pinned H2D {result['h2d_pinned_seconds'] * 1e3:.1f} ms "
        f"({result['h2d_pinned_gb_per_s']:.1f} GB/s), D2D {result['d2d_seconds'] * 1e3:.1f} ms "
        f"({result['d2d_gb_per_s']:.1f} GB/s)"
    ]
    for p in result["pushes"]:
        lines.append(
            f"  buckets of {p['bucket_bytes'] / (1 << 20):8.1f} MiB x {p['buckets']:3d}: "
            f"{p['seconds'] * 1e3:8.1f} ms ({p['gb_per_s']:.1f} GB/s; {p['vs_h2d']:.2f} of H2D, "
            f"{p['vs_d2d']:.2f} of D2D; {p['format']}; weights equal: {p['weights_equal']})"
        )
    return "\n".join(lines)
