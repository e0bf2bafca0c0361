"""Where a single-stream token's time goes in the hf engine: per request, per token, per step.

    python3 tools/c1-probe.py [--device cuda] [--size 1b] [--requests 6] [--json]

Starts the engine on the random model ``relax-hf gpu-bench`` measures (its options: 85 % of the
GPU, graphs on, the overlapped schedule), warms it up as gpu-bench does, then sends requests
one at a time (concurrency 1, gpu-bench's prompt and sampling) of 1 and of 128 new tokens,
alternating, and reads the engine's counters around each:

- ``per_request_ms``: the wall time of a 1-token request (the prompt's prefill, HTTP, the
  request's bookkeeping);
- ``per_token_ms``: (the 128-token request's wall time - the 1-token one's) / 127, what each
  decoded token adds: gpu-bench's c1 is ``128 / (per_request + 127 * per_token)``;
- ``step_ms``: the engine's compute thread's seconds in steps over its decode steps, in the
  128-token requests (``step_seconds_total``, ``decode_steps_total``): a token's time on the
  compute thread; ``per_token_ms - step_ms`` is what the token waits for outside the steps
  (the scheduler loop's hand-overs);
- ``ahead``: decode steps started before the last one's token was known (the overlapped
  schedule), of the decode steps.

Set ``per_token_ms`` against the decode graph's replay on the GPU (``tools/decode-profile.py``)
to see whether a token waits for the device or for the host.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

COUNTERS = ("decode_steps_total", "decode_steps_ahead_total", "prefill_steps_total",
            "scheduler_runs_total", "step_seconds_total", "generation_tokens_total")  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default=None, help="gpu-bench's model size (default: 1b on CUDA)")
    p.add_argument("--requests", type=int, default=6, help="requests of each length")
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--no-overlap", action="store_true", help="the overlapped schedule off")
    p.add_argument("--torch-compile", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()

    import asyncio

    from relax_hf.bench import measure_throughput
    from relax_hf.gpu_bench import make_random_model
    from relax_hf.options import HFEngineOptions
    from relax_hf.plugin import launch

    from relax_core import EngineLaunchSpec, EngineOptions

    cuda = args.device.startswith("cuda")
    size = args.size or ("1b" if cuda else "tiny")
    dtype = "bfloat16" if cuda else "float32"
    with tempfile.TemporaryDirectory(prefix="relax-c1-probe-") as tmp:
        model = Path(tmp) / "model"
        make_random_model(model, size, dtype)
        spec = EngineLaunchSpec(
            engine_id="c1-probe",
            model_path=str(model),
            device=args.device,
            log_path=str(Path(tmp) / "engine.log"),
            options=EngineOptions(dtype=dtype, mem_fraction_static=0.85 if cuda else None),
            backend_options=HFEngineOptions(
                enable_torch_compile=args.torch_compile,
                disable_overlap_schedule=args.no_overlap,
            ),
        )
        proc = launch(spec)
        try:
            proc.wait_ready(900)
            url = proc.base_url or ""
            asyncio.run(measure_throughput(url, concurrency=8, requests_per_client=1,
                                           max_new_tokens=16))  # fmt: skip
            result = _measure(url, args.requests, args.tokens)
        finally:
            proc.terminate(30)
    result.update(device=args.device, size=size, overlap=not args.no_overlap,
                  torch_compile=args.torch_compile)  # fmt: skip
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"c1 {result['c1_tokens_per_s']:.0f} tokens/s: per request {result['per_request_ms']:.2f} "
        f"ms + {args.tokens - 1} x {result['per_token_ms']:.3f} ms a token; the compute thread's "
        f"step {result['step_ms']:.3f} ms; {result['ahead_fraction']:.0%} of the steps started "
        "ahead"
    )


def _counters(url: str) -> dict[str, float]:
    with urllib.request.urlopen(url + "/server_info") as resp:
        info = json.load(resp)
    return {k: float(info.get(k, 0)) for k in COUNTERS}


def _one(url: str, i: int, tokens: int) -> tuple[float, dict[str, float]]:
    body = {
        "text": f"Client 0 request {i}: tell me a story about the sea.",
        "sampling_params": {"max_new_tokens": tokens, "temperature": 1.0,
                            "sampling_seed": i, "ignore_eos": True},
    }  # fmt: skip
    data = json.dumps(body).encode()
    request = urllib.request.Request(url + "/generate", data, {"Content-Type": "application/json"})
    before = _counters(url)
    t0 = time.perf_counter()
    with urllib.request.urlopen(request) as resp:
        out = json.load(resp)
    wall = time.perf_counter() - t0
    after = _counters(url)
    assert out["meta_info"]["completion_tokens"] == tokens, out["meta_info"]
    return wall, {k: after[k] - before[k] for k in COUNTERS}


def _measure(url: str, requests: int, tokens: int) -> dict[str, Any]:
    short, long, steps = [], [], []
    for i in range(requests):
        short.append(_one(url, 100 + i, 1)[0])
        wall, d = _one(url, i, tokens)
        long.append(wall)
        steps.append(d)
    per_request = statistics.median(short)
    per_token = (statistics.median(long) - per_request) / (tokens - 1)
    decode = sum(d["decode_steps_total"] for d in steps)
    return {
        "tokens": tokens,
        "per_request_ms": per_request * 1e3,
        "per_token_ms": per_token * 1e3,
        "long_request_ms": [round(x * 1e3, 2) for x in long],
        "short_request_ms": [round(x * 1e3, 2) for x in short],
        "c1_tokens_per_s": tokens / statistics.median(long),
        "step_ms": sum(d["step_seconds_total"] for d in steps) / max(decode, 1) * 1e3,
        "decode_steps": decode,
        "ahead_fraction": sum(d["decode_steps_ahead_total"] for d in steps) / max(decode, 1),
        "prefill_steps": sum(d["prefill_steps_total"] for d in steps),
        "scheduler_runs": sum(d["scheduler_runs_total"] for d in steps),
    }


if __name__ == "__main__":
    main()
