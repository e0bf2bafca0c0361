"""How fast the decode step's context gather can be on this GPU: one layer's K and V of ``b``
rows of ``ctx`` positions gathered from a KV pool with K and V apart (``[2, slots, kv_heads,
head_dim]``, the hf engine's layout before 2026-12-05) by ``index_select`` over dimension 1 and
by alternatives, and from one with a slot's K and V side by side (``[slots, 2, kv_heads,
head_dim]``, the engine's layout since) by one ``index_select`` of whole rows.

    python tools/gather-probe.py [--slots N] [--kv-heads 8] [--head-dim 128]

Prints one JSON line per (b, ctx, way): microseconds per gather (CUDA events, median of 50)
and the bytes it moved per second. Every way's result is checked equal to the engine's.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.nn.functional as F


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", type=int, default=400_000)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    args = ap.parse_args()
    dev = torch.device("cuda")
    s, h, d = args.slots, args.kv_heads, args.head_dim
    kv = torch.randn(2, s, h, d, device=dev, dtype=torch.bfloat16)
    flat_kv = kv.view(2, s, h * d)
    rows_kv = kv.transpose(0, 1).contiguous().view(s, 2 * h * d)  # [slots, 2, h, d]

    ways = {
        "index_select_dim1": lambda idx: kv.index_select(1, idx),
        "index_select_dim0_k_v": lambda idx: torch.stack(
            (flat_kv[0].index_select(0, idx), flat_kv[1].index_select(0, idx))
        ),
        "embedding_k_v": lambda idx: torch.stack(
            (F.embedding(idx, flat_kv[0]), F.embedding(idx, flat_kv[1]))
        ),
        "advanced_index": lambda idx: kv[:, idx],
        "side_by_side_rows": lambda idx: rows_kv.index_select(0, idx),
    }
    for b, ctx in ((1, 128), (64, 128), (64, 512), (256, 256)):
        idx = torch.randint(0, s, (b * ctx,), device=dev)
        want = kv.index_select(1, idx)
        moved = 2 * 2 * b * ctx * h * d * 2  # read and written, K and V, bf16
        for name, fn in ways.items():
            got = fn(idx)
            if name == "side_by_side_rows":
                got = got.view(-1, 2, h, d).transpose(0, 1)
            got = got.reshape(want.shape)
            assert torch.equal(got, want), name
            times = []
            for _ in range(60):
                start, end = (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True),
                )
                start.record()
                fn(idx)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
            us = statistics.median(times[10:])
            print(
                json.dumps(
                    {
                        "b": b,
                        "ctx": ctx,
                        "way": name,
                        "us": round(us, 1),
                        "gb_per_s": round(moved / us / 1e3, 1),
                    }
                ),
                flush=True,
            )


if __name__ == "__main__":
    main()
