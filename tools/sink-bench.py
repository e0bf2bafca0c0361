"""A step's batch through the batch sink as ``relax run`` sends it: the run puts the samples
(the ``sink_put`` phase) and a reader actor in another process gets them (the trainer, before
its optimizer step). ``RayBatchSink`` against the samples passed to and from the store actor
themselves (what it did before it kept one reference to them), alternated, on one local Ray.
Samples as a distillation step's: rollout log-probs, a reward, the teacher's log-probs and top-k
ids and log-probs at each token.

    python tools/sink-bench.py [--samples 256] [--tokens 120] [--k 8] [--rounds 7]

Prints one JSON object: each way's median put, get and put + get in milliseconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any


def _samples(n: int, tokens: int, k: int) -> list[Any]:
    from relax_core import Sample

    rng = random.Random(0)
    out = []
    for i in range(n):
        lps = [-rng.random() for _ in range(tokens)]
        s = Sample(f"s{i}", f"g{i // 8}", list(range(130)), list(range(tokens)),
                   rollout_logprobs=lps, weight_version="v1")  # fmt: skip
        s.fields.update(
            reward=0.5,
            rewards={"judge": 0.5},
            teacher_logprobs=tuple(-rng.random() for _ in range(tokens)),
            teacher_topk_ids=tuple(tuple(rng.randrange(50000) for _ in range(k)) for _ in lps),
            teacher_topk_logprobs=tuple(
                tuple(sorted((-rng.random() for _ in range(k)), reverse=True)) for _ in lps
            ),
        )
        out.append(s)
    return out


class _Reader:
    """The trainer's side: gets a partition and counts what came."""

    async def get(self, sink: Any, partition: str) -> tuple[int, float]:
        began = time.perf_counter()
        samples = await sink.get(partition)
        return len(samples), time.perf_counter() - began


class _Direct:
    """The samples themselves to and from the store actor (the sink before its references)."""

    def __init__(self, actor: Any) -> None:
        self.actor = actor

    async def put(self, partition: str, samples: Any, *, is_last: bool) -> Any:
        return await self.actor.put.remote(partition, list(samples), is_last=is_last)

    async def get(self, partition: str) -> Any:
        return await self.actor.get.remote(partition)

    async def delete(self, partition: str) -> Any:
        return await self.actor.delete.remote(partition)


async def _bench(args: argparse.Namespace) -> dict[str, Any]:
    import ray

    from relax_core.coordination import MemoryBatchSink, RayBatchSink

    samples = _samples(args.samples, args.tokens, args.k)
    reader = ray.remote(_Reader).options(num_cpus=0).remote()
    sinks = {
        "references (RayBatchSink)": RayBatchSink.start(),
        "samples through the actor": _Direct(
            ray.remote(MemoryBatchSink).options(num_cpus=0).remote()
        ),
    }
    times: dict[str, dict[str, list[float]]] = {w: {"put": [], "get": []} for w in sinks}
    for r in range(args.rounds + 1):  # the first round warms up each way
        for way, sink in sinks.items():
            partition = f"train_{r}"
            began = time.perf_counter()
            await sink.put(partition, samples, is_last=True)
            put = time.perf_counter() - began
            count, get = await reader.get.remote(sink, partition)
            if count != len(samples):
                raise SystemExit(f"{way}: the reader got {count} of {len(samples)} samples")
            await sink.delete(partition)
            if r:
                times[way]["put"].append(put * 1e3)
                times[way]["get"].append(get * 1e3)
    out: dict[str, Any] = {"samples": args.samples, "tokens": args.tokens, "k": args.k}
    for way, t in times.items():
        both = [a + b for a, b in zip(t["put"], t["get"], strict=True)]
        out[way] = {k: round(statistics.median(v), 1) for k, v in (*t.items(), ("both", both))}
    return out


def main() -> int:
    import ray

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        print(json.dumps(asyncio.run(_bench(args))))
    finally:
        ray.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
