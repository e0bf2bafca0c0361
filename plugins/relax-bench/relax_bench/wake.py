"""``relax bench wake [--job JOB]``: on-demand wake under ``relax serve``, as a client sees it.

Serves a defer job (default: relax-hf's demo job, three tiny hf models on CPU sharing one
declared GPU; ``--job`` names another, whose models must exist) with ``relax serve
--min-residency 0.25 --idle-seconds 600``, reads each role's gateway off its status table (the
roles are the job's) and sends three workloads:

- **switches**: one request per role in turn, each after the previous role's minimum residency
  lapsed, so each one wakes its role and evicts the one resident; then the same request again
  at once, to the role now awake. The baseline, measured in the same run, is that second
  request: the *wake cost* of a request is its latency minus the awake request's.
- **mix**: ``clients`` callers sending a seeded mix of requests back to back, half of them to
  the role awake when the job is ready (the one no phase deferred) and the rest spread evenly
  over the others: requests per second against the same callers sending requests to that role
  only (no wake), and each role's latency.
- every role's own wake waits as its gateway's ``/health?schema=2`` reports them (the
  controller's clock: from a request's arrival to its role being ready).

Every request is the same small one (a 64-token prompt, 8 new tokens with their log-probs),
so what is measured is residency, not decoding.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from relax_core import ConfigError

MIN_RESIDENCY = 0.25
#: Every role's request: a 64-token prompt, 8 new tokens with their log-probs (any role's
#: gateway routes SGLang's ``/generate``; the roles are the job's, read off its status table).
REQUEST: dict[str, Any] = {
    "input_ids": [(7 * i) % 200 + 3 for i in range(64)],
    "return_logprob": True,
    "logprob_start_len": 1,
    "sampling_params": {"max_new_tokens": 8, "ignore_eos": True, "temperature": 1.0},
}


def _post(url: str, body: dict[str, Any], timeout: float = 300.0) -> float:
    """Seconds for one request (raises on a non-2xx answer)."""
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    began = time.perf_counter()
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        resp.read()
    return time.perf_counter() - began


def _get(url: str, timeout: float = 10.0) -> Any:
    """The JSON body of a GET, whatever its status (a health check answers 503 with one)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        with exc:
            return json.loads(exc.read())


def _stats(seconds: list[float]) -> dict[str, float | int]:
    """Count, median and 99th percentile in ms (nearest rank, as the controller's waits)."""
    if not seconds:
        return {"count": 0}
    ranked = sorted(seconds)
    n = len(ranked)

    def rank(q: float) -> float:
        return round(ranked[max(0, math.ceil(q * n) - 1)] * 1e3, 2)

    return {"count": n, "p50_ms": rank(0.5), "p99_ms": rank(0.99)}


class _Served:
    """``relax serve JOB`` in a session of its own, its stdout read on a thread; every process
    of that session is killed on the way out, whatever happened."""

    def __init__(self, job: Path, log_dir: Path) -> None:
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "relax_core",
                "serve",
                str(job),
                "--log-dir",
                str(log_dir),
                "--min-residency",
                f"{MIN_RESIDENCY}",
                "--idle-seconds",
                "600",
                "--wake-timeout",
                "300",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not any(re.search(pattern, line) for line in self.lines):
                left = deadline - time.monotonic()
                if self.proc.poll() is not None or left <= 0:
                    tail = "\n".join(self.lines[-40:])
                    raise RuntimeError(f"relax serve never printed {pattern!r}:\n{tail}")
                self._changed.wait(min(left, 1.0))

    def gateways(self) -> dict[str, str]:
        urls: dict[str, str] = {}
        for line in self.lines:
            if m := re.search(r"^\s*([\w-]+)\s+gateway\s+(http://[\d.:]+)/\1/", line):
                urls[m.group(1)] = f"{m.group(2)}/{m.group(1)}"
        return dict(sorted(urls.items()))

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(30)


@contextlib.contextmanager
def _serve(job: Path | None, progress: bool) -> Iterator[tuple[_Served, dict[str, str]]]:
    with tempfile.TemporaryDirectory(prefix="relax-bench-wake-") as tmp:
        root = Path(tmp)
        if job is None:
            try:
                from relax_hf import DEMO_JOB, make_demo_models
            except ImportError as exc:
                raise ConfigError(
                    "--job",
                    f"the default job is relax-hf's demo job, and relax-hf is not "
                    f"installed ({exc}): `pip install -e plugins/relax-hf`, or give --job JOB",
                ) from exc
            if progress:
                print("  making three tiny models …", file=sys.stderr, flush=True)
            make_demo_models(root / "tiny")
            job = root / "job.toml"
            job.write_text(DEMO_JOB)
        served = _Served(job, root / "logs")
        try:
            if progress:
                print(f"  relax serve {job} …", file=sys.stderr, flush=True)
            served.wait_for(r"relax serve: ready", timeout=900)
            urls = served.gateways()
            woken = [r for r in urls if _residency(urls[r]) is not None]
            if len(woken) < 2:
                raise RuntimeError(
                    f"relax bench wake needs a job whose roles share GPUs (a defer layout): "
                    f"{job} has {len(woken)} role(s) woken on demand ({woken}); see "
                    "docs/serve.md, On-demand wake"
                )
            yield served, {r: urls[r] for r in woken}
        finally:
            served.stop()


def _residency(url: str) -> dict[str, Any] | None:
    residency: dict[str, Any] | None = _get(f"{url}/health?schema=2").get("residency")
    return residency


def _metric(urls: dict[str, str], name: str) -> dict[str, float]:
    """Each role's ``name{role=…}`` counter of the wake controller, from its gateway's
    ``/metrics``."""
    out: dict[str, float] = {}
    for role, url in urls.items():
        base = url.rsplit("/", 1)[0]
        text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
        if m := re.search(rf'^{name}\{{role="{role}"\}} ([\d.e+-]+)$', text, re.M):
            out[role] = float(m.group(1))
    return out


def _switches(urls: dict[str, str], rounds: int) -> dict[str, Any]:
    roles = list(urls)
    woken: dict[str, list[float]] = {r: [] for r in roles}
    awake: dict[str, list[float]] = {r: [] for r in roles}
    cost: dict[str, list[float]] = {r: [] for r in roles}
    for _ in range(rounds):
        for role in roles:
            time.sleep(MIN_RESIDENCY + 0.05)  # the resident role's hysteresis has lapsed
            url = f"{urls[role]}/generate"
            first = _post(url, REQUEST)
            second = _post(url, REQUEST)
            woken[role].append(first)
            awake[role].append(second)
            cost[role].append(first - second)
    every_cost = [c for r in roles for c in cost[r]]
    return {
        "rounds": rounds,
        "woken": {r: _stats(woken[r]) for r in roles},
        "awake": {r: _stats(awake[r]) for r in roles},
        "wake_cost": {r: _stats(cost[r]) for r in roles},
        "wake_cost_all": _stats(every_cost),
    }


def mix_plan(roles: list[str], primary: str, total: int) -> list[str]:
    """``total`` requests' roles in a seeded order: half of them ``primary``, the rest dealt
    in turn to the other ``roles``."""
    others = [r for r in roles if r != primary] or [primary]
    plan = [primary] * (total // 2) + [others[i % len(others)] for i in range(total - total // 2)]
    random.Random(0).shuffle(plan)
    return plan


def _mix(urls: dict[str, str], plan: list[str], clients: int) -> dict[str, Any]:
    total = len(plan)
    latencies: dict[str, list[float]] = {r: [] for r in urls}
    lock = threading.Lock()
    cursor = iter(plan)

    def caller() -> None:
        while True:
            with lock:
                role = next(cursor, None)
            if role is None:
                return
            seconds = _post(f"{urls[role]}/generate", REQUEST)
            with lock:
                latencies[role].append(seconds)

    began = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(caller) for _ in range(clients)]:
            f.result()
    elapsed = time.perf_counter() - began
    return {
        "requests": total,
        "clients": clients,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(total / elapsed, 2),
        "latency": {r: _stats(latencies[r]) for r in urls if latencies[r]},
    }


def run(quick: bool = False, job: str | None = None, progress: bool = True) -> dict[str, Any]:
    rounds, total, clients = (2, 24, 4) if quick else (10, 240, 8)
    with _serve(Path(job).resolve() if job else None, progress) as (_, urls):
        roles = list(urls)
        awake = [r for r in roles if (_residency(urls[r]) or {}).get("state") == "AWAKE"]
        primary = awake[0] if awake else roles[0]
        for role in [*roles, primary]:  # each role woken once (engines warmed), untimed
            _post(f"{urls[role]}/generate", REQUEST)
        if progress:
            print(f"  switches: {rounds} rounds …", file=sys.stderr, flush=True)
        switches = _switches(urls, rounds)
        counters = ("wakes", "evictions")
        before = {k: _metric(urls, f"relax_wake_{k}_total") for k in counters}
        if progress:
            print(f"  mix: {total} requests from {clients} callers …", file=sys.stderr, flush=True)
        mix = _mix(urls, mix_plan(roles, primary, total), clients)
        after = {k: _metric(urls, f"relax_wake_{k}_total") for k in counters}
        for k in counters:
            mix[k] = {r: int(after[k].get(r, 0) - before[k].get(r, 0)) for r in roles}
        _post(f"{urls[primary]}/generate", REQUEST)
        alone = _mix(urls, [primary] * total, clients)
        waits = {r: (_residency(urls[r]) or {}).get("wake_waits") for r in roles}
    costs = switches["wake_cost_all"]
    return {
        "job": job or "embedded demo job (docs/examples/run-cpu.toml)",
        "roles": roles,
        "primary": primary,
        "min_residency_s": MIN_RESIDENCY,
        "switches": switches,
        "mix": mix,
        "primary_alone": alone,
        "mix_vs_primary_alone_requests_per_s": round(
            mix["requests_per_s"] / alone["requests_per_s"], 3
        ),
        "controller_wake_waits": waits,
        "wake_cost_p50_ms": costs.get("p50_ms"),
        "wake_cost_p99_ms": costs.get("p99_ms"),
        "median_awake_ms": round(
            statistics.median(v["p50_ms"] for v in switches["awake"].values() if "p50_ms" in v),
            2,
        ),
    }


def format_result(result: dict[str, Any]) -> str:
    s = result["switches"]
    lines = [
        f"on-demand wake under relax serve: {result['job']} "
        f"(min residency {result['min_residency_s']} s)",
        f"switches ({s['rounds']} rounds; woken request vs the same request awake):",
    ]
    for role in result["roles"]:
        w, a, c = s["woken"][role], s["awake"][role], s["wake_cost"][role]
        lines.append(
            f"  {role:8} woken p50 {w['p50_ms']} ms p99 {w['p99_ms']} ms | awake p50 "
            f"{a['p50_ms']} ms | wake cost p50 {c['p50_ms']} ms p99 {c['p99_ms']} ms"
        )
    m, b = result["mix"], result["primary_alone"]
    lines.append(
        f"mix: {m['requests']} requests, {m['clients']} callers, half to {result['primary']}: "
        f"{m['requests_per_s']} req/s ({result['primary']} alone: {b['requests_per_s']} req/s; "
        f"ratio {result['mix_vs_primary_alone_requests_per_s']}); wakes {m['wakes']}, "
        f"evictions {m['evictions']}"
    )
    for role, lat in m["latency"].items():
        lines.append(f"  {role:8} p50 {lat['p50_ms']} ms p99 {lat['p99_ms']} ms ({lat['count']})")
    lines.append(f"controller wake waits: {json.dumps(result['controller_wake_waits'])}")
    return "\n".join(lines)
