"""The load generator of ``relax bench gateway`` when ``wrk`` is not installed.

``python -m relax_bench._loadgen --url U --concurrency C --seconds S [--processes P]``
runs C closed-loop connections POSTing a fixed ``/generate`` body for S seconds (after a short
warm-up), spread over P processes (default: 1 for C = 1, else the number of cores, as ``wrk``
spreads connections over threads), and prints ``{"requests", "errors", "rps", "p50_ms",
"p99_ms", "processes"}``. ``--stream N`` instead times N streamed requests one after another
and prints ``{"seconds": [...], "bytes": B}``.

A load generator must cost far less per request than what it measures, or on a small machine
it takes the cores the system under test needs. Each connection here is a bare
:class:`asyncio.Protocol` on uvloop that writes a pre-built request and counts answers with the
httptools parser (about 10 µs of CPU per request, against about 100 µs for an aiohttp client).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import time
from typing import Any
from urllib.parse import urlsplit

BODY = b'{"text":"What is six times seven?","sampling_params":{"max_new_tokens":16}}'
STREAM_BODY = b'{"text":"Count to ten thousand.","stream":true}'
HEADERS = {"Content-Type": "application/json"}


class _Conn(asyncio.Protocol):
    """One keep-alive connection sending ``request`` again each time an answer completes."""

    def __init__(self, request: bytes, run: _Run) -> None:
        import httptools

        self._request = request
        self._run = run
        self._parser = httptools.HttpResponseParser(self)
        self._transport: Any = None
        self._sent = 0.0
        self.lost: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self._transport = transport
        self._send()

    def _send(self) -> None:
        self._sent = time.perf_counter()
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        self._parser.feed_data(data)

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        self._run.done(self._sent, now, self._parser.get_status_code() == 200)
        if now < self._run.stop:
            self._send()
        else:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.lost.done():
            self.lost.set_result(None)


class _Run:
    """Latencies of the answers that started inside the measured window."""

    def __init__(self, measure_from: float, stop: float) -> None:
        self.measure_from = measure_from
        self.stop = stop
        self.latencies: list[float] = []
        self.errors = 0

    def done(self, sent: float, now: float, ok: bool) -> None:
        if sent >= self.measure_from and now <= self.stop:
            if ok:
                self.latencies.append(now - sent)
            else:
                self.errors += 1


async def _closed_loop(url: str, concurrency: int, seconds: float, warmup: float) -> dict[str, Any]:
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = (
        f"POST {parts.path or '/'} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(BODY)}\r\n\r\n"
    ).encode() + BODY
    loop = asyncio.get_running_loop()
    start = time.perf_counter()
    run = _Run(start + warmup, start + warmup + seconds)
    conns = []
    for _ in range(concurrency):
        _, conn = await loop.create_connection(lambda: _Conn(request, run), host, port)
        conns.append(conn)
    await asyncio.wait_for(asyncio.gather(*(c.lost for c in conns)), warmup + seconds + 60)
    return {"latencies": run.latencies, "errors": run.errors}


def _worker(url: str, concurrency: int, seconds: float, warmup: float) -> dict[str, Any]:
    coro = _closed_loop(url, concurrency, seconds, warmup)
    try:
        import uvloop

        return uvloop.run(coro)
    except ImportError:
        return asyncio.run(coro)


def closed_loop(
    url: str, concurrency: int, seconds: float, warmup: float, processes: int
) -> dict[str, Any]:
    """Run the closed loop over ``processes`` processes; merge their latencies."""
    processes = max(1, min(processes, concurrency))
    shares = [concurrency // processes + (i < concurrency % processes) for i in range(processes)]
    if processes == 1:
        results = [_worker(url, concurrency, seconds, warmup)]
    else:
        with multiprocessing.get_context("spawn").Pool(processes) as pool:
            results = pool.starmap(_worker, [(url, n, seconds, warmup) for n in shares])
    latencies = sorted(x for r in results for x in r["latencies"])
    n = len(latencies)
    return {
        "requests": n,
        "errors": sum(r["errors"] for r in results),
        "rps": n / seconds,
        "p50_ms": latencies[n // 2] * 1000 if n else float("nan"),
        "p99_ms": latencies[min(n - 1, int(n * 0.99))] * 1000 if n else float("nan"),
        "processes": processes,
    }


async def stream(url: str, repeat: int) -> dict[str, object]:
    """Time ``repeat`` streamed requests one after another (aiohttp reads the stream)."""
    import aiohttp

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
    parser.add_argument("--processes", type=int, default=0, help="0: 1 for c=1, else the cores")
    parser.add_argument("--stream", type=int, default=0, help="time N streamed requests")
    args = parser.parse_args()
    result: Any
    if args.stream:
        try:
            import uvloop

            result = uvloop.run(stream(args.url, args.stream))
        except ImportError:
            result = asyncio.run(stream(args.url, args.stream))
    else:
        processes = args.processes or (1 if args.concurrency == 1 else os.cpu_count() or 1)
        result = closed_loop(args.url, args.concurrency, args.seconds, args.warmup, processes)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
