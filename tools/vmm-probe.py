"""Probe of relax_hf.vmm on a CUDA GPU: what mapping, freeing and handing over memory cost.

    python3 tools/vmm-probe.py [--pool-gb 89] [--weights-gb 0.88] [--chunk-gib 8]
        [--handover-only] [--rounds 3]

Prints one JSON object per measurement. Two processes: this one (A) and a child (B) it starts,
on the same GPU; B takes over what A parks, and A takes it back. ``--chunk-gib``: the size of
a segment's bulk chunks in both (default ``relax_hf.vmm.BULK_CHUNK_BYTES``, what engines use;
1: every chunk 1 GiB, as before bulk chunks);
``--handover-only``: only the hand-over's rounds (what a switch between two engines pays).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from relax_hf import vmm


def free_gb() -> float:
    return torch.cuda.mem_get_info()[0] / 1e9


def say(**row: object) -> None:
    print(json.dumps(row), flush=True)


def fill(seg: vmm.Segment, value: int) -> None:
    t = seg.tensor()
    t.fill_(value)
    torch.cuda.synchronize()


def check(seg: vmm.Segment, value: int) -> bool:
    t = seg.tensor()
    ok = bool((t[:: 1 << 20] == value).all().item())
    return ok


def child(pool: int, weights: int) -> None:
    torch.cuda.init()
    torch.empty(1, device="cuda")
    ex = vmm.Exchange(vmm.device_uuid(0), device=0, log=lambda m: say(log=m))
    w = vmm.Segment(0, weights, exchange=ex, name="weights")
    p = vmm.Segment(0, pool, exchange=ex, name="pool")
    print("ready", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "take":
            f0 = free_gb()
            t0 = time.perf_counter()
            dw = w.map()
            host = torch.empty(weights, dtype=torch.uint8, pin_memory=True)
            t1 = time.perf_counter()
            w.tensor().copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            dp = p.map()
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            say(
                who="B",
                op="take",
                weights=dw,
                pool=dp,
                weights_map_s=t1 - t0,
                copy_s=t2 - t1,
                pool_map_s=t3 - t2,
                free_before=f0,
                free_after=free_gb(),
                pool_data_kept=check(p, 7),
            )
            fill(p, 9)
        elif cmd == "park":
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dw = w.unmap(park=True)
            dp = p.unmap(park=True)
            say(
                who="B",
                op="park",
                s=time.perf_counter() - t0,
                weights=dw,
                pool=dp,
                free_after=free_gb(),
            )
        elif cmd == "quit":
            ex.close()
            return
        print("done", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pool-gb", type=float, default=89.0)
    ap.add_argument("--weights-gb", type=float, default=0.88)
    ap.add_argument("--chunk-gib", type=int, default=vmm.BULK_CHUNK_BYTES >> 30)
    ap.add_argument("--handover-only", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", action="store_true")
    a = ap.parse_args()
    vmm.BULK_CHUNK_BYTES = a.chunk_gib << 30
    pool, weights = int(a.pool_gb * 1e9), int(a.weights_gb * 1e9)
    if a.child:
        child(pool, weights)
        return
    torch.cuda.init()
    torch.empty(1, device="cuda")
    gpu = vmm.device_uuid(0)
    say(gpu=gpu, free=free_gb(), bulk_chunk=vmm.BULK_CHUNK_BYTES, chunk=vmm.CHUNK_BYTES)
    host = torch.empty(weights, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(weights, dtype=torch.uint8, device="cuda")
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
        say(op="pinned h2d into a held buffer", s=time.perf_counter() - t0)
    del dev
    torch.cuda.empty_cache()
    p = vmm.Segment(0, pool, name="pool")
    w = vmm.Segment(0, weights, name="weights")
    if not a.handover_only:
        one_process(p, w, host, weights)
    handover(a, gpu, p, w)


def one_process(p: vmm.Segment, w: vmm.Segment, host: torch.Tensor, weights: int) -> None:
    # 1. one process, to the driver and back
    d = p.map()
    say(op="pool map (created)", **d, free=free_gb())
    fill(p, 3)
    say(op="pool data", ok=check(p, 3))
    t0 = time.perf_counter()
    d = p.unmap(park=False)
    say(op="pool unmap+free to driver", s=time.perf_counter() - t0, **d, free=free_gb())
    d = p.map()
    say(op="pool map right after its free", **d)
    d = p.unmap(park=False)
    time.sleep(2)
    t0 = time.perf_counter()
    d = w.map()
    t1 = time.perf_counter()
    w.tensor().copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    say(
        op="weights map 2 s after the pool's free, then copy",
        map_s=t1 - t0,
        copy_s=time.perf_counter() - t1,
        **d,
    )
    w.unmap(park=False)
    p.map()
    p.unmap(park=False)
    t0 = time.perf_counter()
    vmm.Chunk.create(0, 2 << 20).free()
    warm = time.perf_counter() - t0
    time.sleep(2)
    t0 = time.perf_counter()
    d = w.map()
    say(
        op="weights map 2 s after the pool's free and a 2 MiB create+free right after it",
        warm_s=warm,
        map_s=time.perf_counter() - t0,
        **d,
    )
    w.unmap(park=False)
    p.map()
    w.map()
    time.sleep(1)
    for seg in (p, w):
        seg.unmap(park=False)
    time.sleep(2)
    t0 = time.perf_counter()
    x = torch.empty(weights, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    say(op="cudaMalloc of the weights 2 s after a VMM free of the pool", s=time.perf_counter() - t0)
    del x
    torch.cuda.empty_cache()


def handover(a: argparse.Namespace, gpu: str, p: vmm.Segment, w: vmm.Segment) -> None:
    # 2. two processes: A parks, B takes, B parks, A takes back
    ex = vmm.Exchange(gpu, device=0, log=lambda m: say(log=m))
    p.exchange = ex
    w.exchange = ex
    p.map()
    w.map()
    fill(p, 7)
    b = subprocess.Popen(
        [
            sys.executable,
            __file__,
            "--child",
            "--pool-gb",
            str(a.pool_gb),
            "--weights-gb",
            str(a.weights_gb),
            "--chunk-gib",
            str(a.chunk_gib),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert b.stdin is not None and b.stdout is not None

    def ask(cmd: str) -> None:
        assert b.stdin is not None and b.stdout is not None
        b.stdin.write(cmd + "\n")
        b.stdin.flush()
        for line in b.stdout:
            if line.strip() == "done":
                return
            print(line, end="", flush=True)

    for line in b.stdout:
        if line.strip() == "ready":
            break
        print(line, end="", flush=True)
    for rnd in range(a.rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dw = w.unmap(park=True)
        dp = p.unmap(park=True)
        say(
            who="A",
            op="park",
            round=rnd,
            s=time.perf_counter() - t0,
            weights=dw,
            pool=dp,
            free=free_gb(),
        )
        ask("take")
        ask("park")
        t0 = time.perf_counter()
        dw = w.map()
        dp = p.map()
        torch.cuda.synchronize()
        say(
            who="A",
            op="take back",
            round=rnd,
            s=time.perf_counter() - t0,
            weights=dw,
            pool=dp,
            data_from_b=check(p, 9),
            free=free_gb(),
        )
        fill(p, 7)
    ask("quit")
    b.wait(timeout=60)
    for seg in (p, w):
        seg.unmap(park=False)
    ex.close()
    say(op="end", free=free_gb())


if __name__ == "__main__":
    main()
