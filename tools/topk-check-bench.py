"""The teacher's top-k fields' check (``relax_teacher.distill.teacher_topk_fields``) over a step's
samples, as a run's ``validate`` phase runs it: random ids and sorted log-probs, the median of
seven passes.

    python tools/topk-check-bench.py [--samples 256] [--tokens 120] [--k 8]

Needs relax-teacher installed.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main() -> int:
    from relax_teacher.distill import teacher_topk_fields

    from relax_core import Sample, validate_samples

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=120)
    parser.add_argument("--k", type=int, default=8)
    args = parser.parse_args()
    rng = random.Random(0)
    fields = teacher_topk_fields(args.k)
    batch = []
    for i in range(args.samples):
        sample = Sample(f"g{i}-s0", f"g{i}", [1, 2], [7] * args.tokens)
        sample.fields["teacher_topk_ids"] = [
            [rng.randrange(50_000) for _ in range(args.k)] for _ in range(args.tokens)
        ]
        sample.fields["teacher_topk_logprobs"] = [
            sorted((-10 * rng.random() for _ in range(args.k)), reverse=True)
            for _ in range(args.tokens)
        ]
        batch.append(sample)
    times = []
    for _ in range(7):
        began = time.perf_counter()
        problems = validate_samples(batch, fields)
        times.append(time.perf_counter() - began)
        assert not problems, problems[:3]
    print(
        f"{args.samples} samples x {args.tokens} tokens x top-{args.k}: "
        f"median {1e3 * statistics.median(times):.1f} ms"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
