"""``relax bench client``: route resolution speed, and InferenceClient against bare aiohttp.

Two measurements, each against a baseline or a target taken in the same run:

- ``resolver_per_s``: :meth:`RouteResolver.resolve` calls per second for a DIRECT model with 64
  READY replicas (default policy, the snapshot object reused as a client reuses it), on one core.
  ``resolver_affinity_per_s`` is the same with an affinity key (rendezvous hashing).
- ``client_rps`` / ``raw_rps``: ``/generate`` requests per second at concurrency 64 against a
  null upstream running in its own process (64 loopback ports, one per replica), through
  :meth:`InferenceClient.generate` and through a bare aiohttp session doing the same requests
  (same bodies on the wire, same URLs in the same round-robin order, orjson both ways, one
  pooled session each). Rounds alternate raw/client, back to back; ``client_rps`` and
  ``raw_rps`` are medians over rounds, ``client_vs_raw`` the median of the per-round ratios
  (so drift in a shared machine's load cancels out). ``*_cpu_us_per_request`` is this
  process's CPU time per request (the upstream runs in its own process) and
  ``client_vs_raw_cpu`` the median per-round ``raw_cpu / client_cpu``: a view of the same
  comparison that other load on the machine disturbs less.
"""

from __future__ import annotations

import asyncio
import itertools
import statistics
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import attrs
import orjson

from relax_bench._null_upstream import spawn
from relax_core import InferenceClient, RoleSnapshot, RouteResolver

__all__ = [
    "Throughput",
    "bench_resolver",
    "bench_throughput",
    "format_result",
    "run",
    "snapshot_dict",
]

REPLICAS = 64
CONCURRENCY = 64
MODEL = "bench-model"

#: A teacher-prefill-sized ``/generate`` body; ``model`` is the logical name the client strips.
PAYLOAD: dict[str, Any] = {
    "model": MODEL,
    "input_ids": list(range(1000, 1128)),
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 0, "skip_special_tokens": False},
    "return_logprob": True,
    "logprob_start_len": 63,
    "top_logprobs_num": 8,
}


def snapshot_dict(urls: list[str], *, role: str = "bench") -> dict[str, Any]:
    """A schema-2 snapshot of one READY DIRECT model whose replicas are ``urls``."""
    return {
        "schema_version": 2,
        "role": role,
        "registry_epoch": "bench",
        "topology_revision": 1,
        "routing": {
            "default_model": MODEL,
            "route_key_map": {"bench-data": MODEL},
            "aliases": {},
            "policy": "round_robin",
            "policy_revision": 0,
        },
        "models": {
            MODEL: {
                "state": "READY",
                "route_mode": "DIRECT",
                "router_url": None,
                "weight_source": "STATIC",
                "weight_version": None,
                "served_model_name": "bench/served-model",
                "engines": [
                    {
                        "engine_id": f"{MODEL}/replica-{i}",
                        "base_url": url,
                        "state": "READY",
                        "direct_eligible": True,
                        "generation": 1,
                    }
                    for i, url in enumerate(urls)
                ],
            }
        },
    }


def _resolver_rate(snapshot: RoleSnapshot, seconds: float, **kwargs: Any) -> float:
    resolver = RouteResolver()
    resolve = resolver.resolve
    resolve(snapshot, **kwargs)  # build the per-snapshot indexes outside the timing
    n = 0
    batch = 2000
    start = time.perf_counter()
    deadline = start + seconds
    while True:
        for _ in range(batch):
            resolve(snapshot, **kwargs)
        n += batch
        now = time.perf_counter()
        if now >= deadline:
            return n / (now - start)


def bench_resolver(seconds: float, rounds: int) -> tuple[float, float]:
    """(plain, with affinity key) resolutions per second: medians over ``rounds``."""
    urls = [f"http://10.0.{i // 250}.{i % 250 + 1}:30000" for i in range(REPLICAS)]
    snapshot = RoleSnapshot.from_json(snapshot_dict(urls))
    plain = [_resolver_rate(snapshot, seconds, model=MODEL) for _ in range(rounds)]
    keys = itertools.cycle([f"group-{i}" for i in range(1024)])
    affinity = []
    for _ in range(rounds):
        # Rotate keys as real traffic does (one group id per sample group).
        resolver = RouteResolver()
        resolver.resolve(snapshot, model=MODEL, affinity_key="warm")
        n, start = 0, time.perf_counter()
        deadline = start + seconds
        while time.perf_counter() < deadline:
            for _ in range(1000):
                resolver.resolve(snapshot, model=MODEL, affinity_key=next(keys))
            n += 1000
        affinity.append(n / (time.perf_counter() - start))
    return statistics.median(plain), statistics.median(affinity)


async def _drive(
    call: Callable[[], Awaitable[None]], requests: int, concurrency: int
) -> tuple[float, float]:
    """Run ``requests`` calls with ``concurrency`` workers: (requests/s, CPU µs per request)."""
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await call()

    cpu = time.process_time()
    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return requests / wall, (time.process_time() - cpu) / requests * 1e6


@attrs.frozen
class Throughput:
    """Per-round measurements of both sides (round i of each ran back to back)."""

    client_rps: tuple[float, ...]
    raw_rps: tuple[float, ...]
    client_cpu_us: tuple[float, ...]
    raw_cpu_us: tuple[float, ...]

    @property
    def ratio(self) -> float:
        """Median over rounds of client/raw throughput (drift in machine load cancels out)."""
        return statistics.median(c / r for c, r in zip(self.client_rps, self.raw_rps, strict=True))


async def bench_throughput(urls: list[str], *, requests: int, rounds: int) -> Throughput:
    """Client and raw aiohttp against the null upstream at ``urls``, in alternating rounds."""
    snapshot = RoleSnapshot.from_json(snapshot_dict(urls))
    client = InferenceClient(snapshot_provider=lambda: snapshot)

    raw_session = aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=256, limit_per_host=0, keepalive_timeout=4.0),
        skip_auto_headers=("Accept-Encoding",),
        auto_decompress=False,
    )
    raw_urls = itertools.cycle([u + "/generate" for u in urls])
    raw_headers = {"Content-Type": "application/json"}
    stripped = {k: v for k, v in PAYLOAD.items() if k != "model"}

    async def raw_call() -> None:
        # What a hand-written caller sends: the same body (encoded per request, as the client
        # does), the same URLs in the same order.
        async with raw_session.post(
            next(raw_urls), data=orjson.dumps(stripped), headers=raw_headers
        ) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"null upstream answered {resp.status}")
            orjson.loads(body)

    async def client_call() -> None:
        await client.generate(PAYLOAD)

    sides: dict[str, list[tuple[float, float]]] = {"raw": [], "client": []}
    calls = {"raw": raw_call, "client": client_call}
    try:
        warm = max(CONCURRENCY * 4, requests // 2)
        for name in ("raw", "client"):
            await _drive(calls[name], warm, CONCURRENCY)
        for i in range(rounds):
            # Alternate which side goes first so drift in machine load favours neither.
            for name in ("raw", "client") if i % 2 == 0 else ("client", "raw"):
                sides[name].append(await _drive(calls[name], requests, CONCURRENCY))
    finally:
        await client.aclose()
        await raw_session.close()
    return Throughput(
        client_rps=tuple(r for r, _ in sides["client"]),
        raw_rps=tuple(r for r, _ in sides["raw"]),
        client_cpu_us=tuple(c for _, c in sides["client"]),
        raw_cpu_us=tuple(c for _, c in sides["raw"]),
    )


def run(quick: bool = False) -> dict[str, Any]:
    """Run both measurements; ``quick`` makes it short (a smoke test, not a measurement)."""
    seconds, resolver_rounds = (0.05, 1) if quick else (1.0, 5)
    requests, rounds = (200, 1) if quick else (3000, 15)
    resolver_per_s, resolver_affinity_per_s = bench_resolver(seconds, resolver_rounds)
    with spawn(REPLICAS) as upstream:
        result = asyncio.run(bench_throughput(upstream.urls, requests=requests, rounds=rounds))
    return {
        "resolver_per_s": round(resolver_per_s, 1),
        "resolver_affinity_per_s": round(resolver_affinity_per_s, 1),
        "client_rps": round(statistics.median(result.client_rps), 1),
        "raw_rps": round(statistics.median(result.raw_rps), 1),
        "client_vs_raw": round(result.ratio, 3),
        "client_cpu_us_per_request": round(statistics.median(result.client_cpu_us), 1),
        "raw_cpu_us_per_request": round(statistics.median(result.raw_cpu_us), 1),
        "client_vs_raw_cpu": round(
            statistics.median(
                r / c for c, r in zip(result.client_cpu_us, result.raw_cpu_us, strict=True)
            ),
            3,
        ),
        "replicas": REPLICAS,
        "concurrency": CONCURRENCY,
        "rounds": rounds,
        "requests_per_round": requests,
    }


def format_result(result: dict[str, Any]) -> str:
    """A short human-readable report."""
    return "\n".join(
        [
            f"resolver ({result['replicas']} replicas): {result['resolver_per_s']:,.0f}/s"
            f" (affinity key: {result['resolver_affinity_per_s']:,.0f}/s)",
            f"InferenceClient: {result['client_rps']:,.0f} req/s   raw aiohttp: "
            f"{result['raw_rps']:,.0f} req/s   ratio {result['client_vs_raw']:.3f}"
            f"   (concurrency {result['concurrency']}, median of {result['rounds']} rounds)",
            f"CPU per request: client {result['client_cpu_us_per_request']:.1f} µs, raw "
            f"{result['raw_cpu_us_per_request']:.1f} µs (ratio {result['client_vs_raw_cpu']:.3f})",
        ]
    )
