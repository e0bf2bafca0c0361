"""Where a prefill step of the hf engine goes: the judge phase's many small prefills.

    python3 tools/prefill-probe.py MODEL [--device cuda] [--prompts 1 4 16 64] [--cached 60]
        [--new 150] [--running 64] [--json OUT] [--cuda-graph-backend-prefill disabled]

Builds the engine's model runner and batch on MODEL (e.g. ``relax-hf make-tiny-model …
--size small``), caches a shared prefix of ``--cached`` tokens (the judge's system prompt),
keeps ``--running`` sequences decoding, then for each count of ``--prompts`` times
``Batch.step`` with that many new prompts (the prefix, then ``--new`` random tokens each):

- its wall time (the step ends by reading the first tokens: the device is done too);
- the device's own time (``torch.profiler``: the kernels' summed time and their count);
- where the host spends it (``cProfile``: the top functions by cumulative time);

and a decode step of the running sequences, for scale. A step whose wall time is far above its
kernels' time is bound by the host (the eager launches, the Python around them).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import random
import statistics
import time
from typing import Any


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--cached", type=int, default=60)
    p.add_argument("--new", type=int, default=150)
    p.add_argument("--running", type=int, default=64)
    p.add_argument("--max-new-tokens", type=int, default=2)
    p.add_argument(
        "--runner-new-tokens",
        type=int,
        default=None,
        help="the running sequences' max_new_tokens (default: 100000 / --running)",
    )
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--mem-fraction-static", type=float, default=0.5)
    p.add_argument("--json", default=None)
    p.add_argument(
        "--cuda-graph-backend-prefill",
        choices=("full", "disabled"),
        default="full",
        help="the engine's flag: small prefills after a cached prefix replay graphs (full)",
    )
    p.add_argument("--quiet", action="store_true", help="no cProfile listing per row")
    args = p.parse_args()

    import torch
    from relax_hf.batch import Batch, Sequence
    from relax_hf.protocol import LogprobParams, SamplingParams
    from relax_hf.runner import ModelRunner
    from torch.profiler import ProfilerActivity, profile

    cuda = args.device == "cuda"
    runner_new = args.runner_new_tokens or 100_000 // max(1, args.running)
    # A CPU pool of what the probe holds at most: the running sequences and the largest batch
    # of new prompts (one more for the cached prefix), each to its last token (finished
    # prompts stay in the prefix cache, whose slots are evictable).
    longest = args.cached + args.new + max(runner_new, args.max_new_tokens)
    cpu_slots = (args.running + max(args.prompts) + 1) * longest
    runner = ModelRunner(
        args.model,
        device=args.device,
        dtype="bfloat16" if cuda else "float32",
        mem_fraction_static=args.mem_fraction_static if cuda else None,
        max_total_tokens=None if cuda else cpu_slots,
        max_running_requests=max(args.prompts) + args.running + 8,
        cuda_graph_prefill=args.cuda_graph_backend_prefill == "full",
    )
    batch = Batch(runner)
    rng = random.Random(0)
    vocab = runner.vocab_size
    system = [rng.randrange(3, vocab) for _ in range(args.cached)]
    made = 0

    def seq(new: int, max_new: int) -> Any:
        nonlocal made
        made += 1
        return Sequence(
            rid=f"p{made}",
            prompt_ids=system + [rng.randrange(3, vocab) for _ in range(new)],
            sampling=SamplingParams(temperature=0.0, max_new_tokens=max_new, ignore_eos=True),
            logprob=LogprobParams(),
        )

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    # The shared prefix cached, then the running sequences (long enough to outlive the probe).
    batch.step([seq(args.new, 1)])
    runners = [seq(args.new, runner_new) for _ in range(args.running)]
    if runners:
        batch.step(runners)
    for _ in range(3):
        batch.step([])
    sync()

    def timed(fn: Any) -> float:
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        return time.perf_counter() - t0

    out: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "cuda_graph_backend_prefill": args.cuda_graph_backend_prefill,
        "rows": [],
    }
    decode = [timed(lambda: batch.step([])) for _ in range(args.repeats)]
    out["decode_ms"] = statistics.median(decode) * 1e3
    print(f"decode step, {len(batch)} rows: {out['decode_ms']:.2f} ms")
    for k in args.prompts:
        walls = []
        for _ in range(args.repeats):
            new = [seq(args.new, args.max_new_tokens) for _ in range(k)]
            walls.append(timed(lambda new=new: batch.step(new)))
            while len(batch) > args.running:  # the new ones finish in --max-new-tokens steps
                batch.step([])
        new = [seq(args.new, args.max_new_tokens) for _ in range(k)]
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=acts) as prof:
            batch.step(new)
            sync()
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        gpu_ms = sum(e.device_time for e in kernels) / 1e3 if cuda else None
        ops = sum(1 for e in prof.events() if e.name.startswith("aten::") and e.cpu_parent is None)
        while len(batch) > args.running:
            batch.step([])
        new = [seq(args.new, args.max_new_tokens) for _ in range(k)]
        prof2 = cProfile.Profile()
        prof2.enable()
        batch.step(new)
        sync()
        prof2.disable()
        buf = io.StringIO()
        pstats.Stats(prof2, stream=buf).sort_stats("cumulative").print_stats(18)
        row = {
            "prompts": k,
            "wall_ms": statistics.median(walls) * 1e3,
            "wall_ms_all": [round(w * 1e3, 2) for w in walls],
            "kernels": len(kernels),
            "kernel_ms": gpu_ms,
            "top_level_ops": ops,
            "rows_after": len(batch),
        }
        out["rows"].append(row)
        print(json.dumps(row))
        if not args.quiet:
            print(buf.getvalue())
        # Keep the batch at its running size: the new ones finish within their max_new_tokens.
        while len(batch) > args.running:
            batch.step([])
    out["prefill_graph_replays"] = runner.graphs.prefill_replays if runner.graphs else 0
    print(f"prefill graph replays: {out['prefill_graph_replays']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
