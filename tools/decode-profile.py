"""Profile one decode step of the hf engine on a GPU: where single-stream decode's time goes.

    python3 tools/decode-profile.py [--size 1b | --model PATH] [--ctx 128] [--batch 1 64]
        [--attention-backend triton|torch_native] [--json OUT]

Makes the random model ``relax-hf gpu-bench`` measures (nothing downloaded; ``--model``: loads
a checkpoint instead, e.g. the judge of ``run-h200.toml``), builds the engine's model runner on
CUDA with a KV cache pool of twice the batch's contexts (each row's at slots of its own), and
for each batch size:

- times a replay of the captured decode graph (the engine's own ``StepGraphs.run``: the
  inputs' host-to-device copy, the replay) and the same step eager, synchronised each step;
- profiles the eager step with ``torch.profiler`` and lists its kernels grouped by name: how
  many launches, and their GPU time (the graph replays the same kernels);
- sets the step against the weight-bandwidth roofline (weight bytes over the device-to-device
  copy bandwidth, as ``gpu-bench`` computes it).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any


def _time(fn: Any, sync: Any, repeats: int) -> list[float]:
    for _ in range(10):
        fn()
    sync()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def _one_batch(runner: Any, b: int, args: Any, roofline_s: float, sync: Any) -> dict[str, Any]:
    """Time, profile and print one batch size (see the module's docstring)."""
    import torch
    from relax_hf.modeling import DECODE_INPUTS, sample_simple
    from relax_hf.sampling import row_keys
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    packed = torch.zeros((DECODE_INPUTS, b), dtype=torch.int64)
    packed[0] = 5
    packed[1] = args.ctx // 2  # positions
    packed[2] = torch.arange(b)  # rows
    packed[3] = row_keys(torch.arange(b), torch.zeros(b, dtype=torch.int64))  # seeds, steps
    temps = torch.ones(b, dtype=torch.float32)
    # Each row's context at slots of its own, as a running batch's are: with the table empty
    # every position would point at slot 0, and the gather would read one slot from cache.
    table = runner.pool.req_to_token
    table[:b, : args.ctx] = 1 + torch.arange(b * args.ctx, device=table.device).view(b, args.ctx)
    graph = _time(lambda: runner.decode(packed, temps, args.ctx), sync, args.repeats)
    dev_packed, dev_temps = packed.to(args.device), temps.to(args.device)

    def eager() -> Any:
        with torch.inference_mode():
            return runner.native.decode_step(runner.pool, dev_packed, dev_temps, args.ctx)

    eager_s = _time(eager, sync, max(20, args.repeats // 4))
    activity = ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU
    with profile(activities=[activity]) as prof:
        for _ in range(5):
            eager()
        sync()
    kernels: dict[str, list[float]] = defaultdict(list)
    for e in prof.events():
        if e.device_type.name == ("CUDA" if cuda else "CPU"):
            kernels[e.name].append(e.device_time if cuda else e.self_cpu_time_total)
    per_step = {k: (len(v) / 5, sum(v) / 5) for k, v in kernels.items()}
    launches = sum(n for n, _ in per_step.values())
    gpu_us = sum(t for _, t in per_step.values())
    top = sorted(per_step.items(), key=lambda kv: -kv[1][1])[: args.top]
    row = {
        "batch": b,
        "graph_replay_ms_p50": statistics.median(graph) * 1e3,
        "eager_ms_p50": statistics.median(eager_s) * 1e3,
        "kernels_per_step": launches,
        "kernel_gpu_ms_per_step": gpu_us / 1e3,
        "graph_over_roofline": roofline_s / statistics.median(graph) * b,
        "top": [{"kernel": k[:120], "per_step": n, "us": round(t, 1)} for k, (n, t) in top],
    }
    # Sampling alone (the Gumbel noise's hash: ~21 element-wise kernels over the vocabulary,
    # and here its rows' part too, which the engine computes on the host), eager and as one
    # compiled function, with their tokens compared.
    vocab = runner.native.lm_head.shape[0]
    logits = torch.randn((b, vocab), device=args.device)
    seeds = torch.arange(b, device=args.device) * 7919 + 1
    steps = torch.full((b,), 3, device=args.device)
    dt = dev_temps
    row["sampling_eager_ms"] = (
        statistics.median(_time(lambda: sample_simple(logits, dt, seeds, steps), sync, 50)) * 1e3
    )
    if cuda:
        fused = torch.compile(sample_simple, dynamic=False, fullgraph=True)
        same = all(
            bool(
                torch.equal(
                    fused(lg, dt, seeds + i, steps + i),
                    sample_simple(lg, dt, seeds + i, steps + i),
                )
            )
            for i, lg in enumerate(torch.randn((50, b, vocab), device=args.device))
        )
        row["sampling_compiled_ms"] = (
            statistics.median(_time(lambda: fused(logits, dt, seeds, steps), sync, 50)) * 1e3
        )
        row["sampling_compiled_same_tokens"] = same
    if cuda and args.whole_compile:
        whole = torch.compile(runner.native.decode_step, dynamic=False)
        t0 = time.perf_counter()
        with torch.inference_mode():
            whole(runner.pool, dev_packed, dev_temps, args.ctx)
        sync()
        row["whole_compile_seconds"] = time.perf_counter() - t0
        cg = torch.cuda.CUDAGraph()
        with torch.inference_mode():
            for _ in range(3):
                whole(runner.pool, dev_packed, dev_temps, args.ctx)
            sync()
            with torch.cuda.graph(cg):
                whole(runner.pool, dev_packed, dev_temps, args.ctx)
        row["whole_compiled_graph_ms"] = (
            statistics.median(_time(cg.replay, sync, args.repeats)) * 1e3
        )
    print({k: v for k, v in row.items() if k != "top"}, flush=True)
    print(
        f"batch {b}: graph {row['graph_replay_ms_p50']:.3f} ms, eager "
        f"{row['eager_ms_p50']:.3f} ms, {launches:.0f} kernels, "
        f"{row['kernel_gpu_ms_per_step']:.3f} ms of kernel time; roofline "
        f"{roofline_s * 1e3:.3f} ms",
        flush=True,
    )
    for t in row["top"]:
        print(f"  {t['per_step']:6.1f} x {t['us']:8.1f} us  {t['kernel']}")
    return row


def main() -> None:
    from relax_hf.options import ATTENTION_BACKENDS

    p = argparse.ArgumentParser()
    p.add_argument("--size", default="1b")
    p.add_argument("--ctx", type=int, default=128)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--compile", action="store_true", help="--enable-torch-compile's pieces")
    p.add_argument(
        "--whole-compile",
        action="store_true",
        help="also time the whole decode step under torch.compile (static shapes)",
    )
    p.add_argument("--json", type=Path)
    p.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    p.add_argument(
        "--model",
        type=Path,
        help="a checkpoint to profile (e.g. the judge of run-h200.toml) instead of gpu-bench's "
        "random model of --size",
    )
    p.add_argument(
        "--attention-backend",
        choices=ATTENTION_BACKENDS,
        help="the engine's --attention-backend (default: the engine's own choice)",
    )
    args = p.parse_args()

    import torch
    from relax_hf.gpu_bench import _d2d_bandwidth, make_random_model
    from relax_hf.runner import ModelRunner

    result: dict[str, Any] = {
        "size": str(args.model) if args.model else args.size, "ctx": args.ctx,
        "compile": args.compile,
    }  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="relax-decode-profile-") as tmp:
        model_dir = args.model or Path(tmp) / "model"
        cuda = args.device == "cuda"
        weight_bytes = None  # a checkpoint's: the runner's, once loaded
        if args.model is None:
            dtype = "bfloat16" if cuda else "float32"
            weight_bytes = make_random_model(model_dir, args.size, dtype)["bytes"]
        runner = ModelRunner(
            str(model_dir),
            device=args.device,
            dtype="bfloat16" if args.device == "cuda" else "float32",
            max_total_tokens=max(args.batch) * args.ctx * 2,
            max_running_requests=max(args.batch),
            torch_compile=args.compile,
            attention_backend=args.attention_backend,
        )
        bw = _d2d_bandwidth("cuda:0") if cuda else 1e11
        weight_bytes = weight_bytes or runner.param_bytes
        roofline_s = weight_bytes / bw
        result["weight_bytes"] = weight_bytes
        result["attention_backend"] = runner.attention_backend
        print(f"decode attention: {runner.attention_backend}", flush=True)
        result["roofline_ms"] = roofline_s * 1e3
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        for b in args.batch:
            result.setdefault("batches", []).append(_one_batch(runner, b, args, roofline_s, sync))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
