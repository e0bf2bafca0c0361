"""The load generator of ``relax bench gateway``, in its own process (aiohttp on uvloop).

``python -m relax_core.bench._loadgen --url U --concurrency C --seconds S`` runs C closed-loop
workers POSTing a fixed ``/generate`` body for S seconds (after a short warm-up) and prints
``{"requests", "errors", "rps", "p50_ms", "p99_ms"}``. ``--stream N`` instead times N streamed
requests one after another and prints ``{"seconds": [...], "bytes": B}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

import aiohttp

BODY = b'{"text":"What is six times seven?","sampling_params":{"max_new_tokens":16}}'
STREAM_BODY = b'{"text":"Count to ten thousand.","stream":true}'
HEADERS = {"Content-Type": "application/json"}


async def closed_loop(
    url: str, concurrency: int, seconds: float, warmup: float
) -> dict[str, float]:
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=False)
    latencies: list[float] = []
    errors = 0
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        measure_from = start + warmup
        stop = measure_from + seconds

        async def worker() -> None:
            nonlocal errors
            while True:
                t0 = time.perf_counter()
                if t0 >= stop:
                    return
                async with session.post(url, data=BODY, headers=HEADERS) as resp:
                    await resp.read()
                    ok = resp.status == 200
                t1 = time.perf_counter()
                if t0 >= measure_from:
                    if ok:
                        latencies.append(t1 - t0)
                    else:
                        errors += 1

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    latencies.sort()
    n = len(latencies)
    return {
        "requests": n,
        "errors": errors,
        "rps": n / seconds,
        "p50_ms": latencies[n // 2] * 1000 if n else float("nan"),
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1000 if n else float("nan"),
    }


async def stream(url: str, repeat: int) -> dict[str, object]:
    seconds = []
    size = 0
    async with aiohttp.ClientSession() as session:
        for _ in range(repeat):
            t0 = time.perf_counter()
            size = 0
            async with session.post(url, data=STREAM_BODY, headers=HEADERS) as resp:
                async for chunk in resp.content.iter_any():
                    size += len(chunk)
            seconds.append(time.perf_counter() - t0)
    return {"seconds": seconds, "bytes": size}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--url", required=True)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--warmup", type=float, default=0.3)
    parser.add_argument("--stream", type=int, default=0, help="time N streamed requests")
    args = parser.parse_args()
    coro: Any
    if args.stream:
        coro = stream(args.url, args.stream)
    else:
        coro = closed_loop(args.url, args.concurrency, args.seconds, args.warmup)
    try:
        import uvloop

        result = uvloop.run(coro)
    except ImportError:
        result = asyncio.run(coro)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
