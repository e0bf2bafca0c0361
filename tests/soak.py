"""The soak suite: a role gateway under sustained load, with an engine killed and rebuilt.

``python -m tests.soak`` (``nox -s soak``; not part of the test session, it takes minutes):

- a real local Ray; one ``teacher`` role service with two models: ``sim`` (4 replicas of the
  core's lightweight SGLang-protocol engine, ``relax_core/bench/_sim_engine.py``: real
  processes behind real admission servers, so the volume measures the gateway, not a model)
  and ``hf`` (1 replica of the ``hf`` engine on a micro model, for a slice of the requests);
- the role gateway in a process of its own (so its memory and file descriptors are its own),
  discovering the role through the service's registry server, as a gateway in a Ray actor does;
- the role service's health monitor running (every 0.5 s);
- a load generator at concurrency 512 sending 20,000 requests: 2% to ``hf``, 10% streamed and
  abandoned by their caller after the first event, 40% streamed to the end, 48% plain; each
  request with its own ``X-Request-ID``;
- at 30% of the run one ``sim`` engine process is killed (SIGKILL); the health monitor fails its
  replica and rebuilds it while the load goes on.

It prints the requests by outcome, the errors by failure class (the gateway's ``/metrics``),
p50/p99 latency, the gateway's RSS and open file descriptors before and after the run (both
after a warm-up of 1,000 requests and once idle connections have closed), the killed engine's
rebuild, and replays counted on the engines' side: every ``sim`` engine appends each request
id it receives to a log that survives ``kill -9``, and the ``hf`` engine counts the requests it
received (it is not health-checked during the run, so its count is exactly what callers sent).

It exits 1 unless: every request is accounted for, no request id reached an engine twice and
the ``hf`` engine received exactly the requests sent to it, the gateway's RSS grew < 10%, its
file descriptors did not grow, the killed replica was rebuilt, and fewer than 2% of the requests
failed (those in flight on the killed engine fail: a sent request is never replayed).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from relax_bench.gateway import _process

ROLE = "teacher"
SIM_REPLICAS = 4
WARMUP = 1000


# -- the gateway process ------------------------------------------------------------------------


def serve_gateway(registry_url: str) -> None:
    """The gateway process: serve the role gateway until stdin closes."""
    from relax_core import GatewayOptions
    from relax_core.gateway.serving import GatewayServer, registry_gateway_app

    app = registry_gateway_app(ROLE, registry_url, GatewayOptions(snapshot_ttl=0.5, timeout=60.0))
    server = GatewayServer(app).start()
    print(json.dumps({"url": server.url, "pid": os.getpid()}), flush=True)
    sys.stdin.read()
    server.stop()


def gateway_process(registry_url: str) -> contextlib.AbstractContextManager[dict[str, Any]]:
    """The gateway process (:func:`serve_gateway`); yields its ready line once it serves."""
    args = ["tests.soak", "--serve-gateway", registry_url]
    return _process(args, "the soak's gateway process", 60.0, stop_timeout=30.0)


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError(f"no VmRSS for pid {pid}")


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def metrics(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("relax_gateway_") and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


# -- the load -----------------------------------------------------------------------------------


def plan(count: int, seed: int, prefix: str) -> list[tuple[str, str]]:
    """``count`` requests ``(request id, kind)``: hf, leave (stream, abandoned), stream, plain."""
    rng = random.Random(seed)
    kinds = []
    for _ in range(count):
        x = rng.random()
        kinds.append(
            "hf" if x < 0.02 else "leave" if x < 0.12 else "stream" if x < 0.52 else "plain"
        )
    return [(f"{prefix}-{i}", kind) for i, kind in enumerate(kinds)]


async def one(session: Any, url: str, rid: str, kind: str) -> tuple[str, float]:
    """Send one request; ``(outcome, seconds)``."""
    import aiohttp

    body: dict[str, Any] = {"text": "soak", "sampling_params": {"max_new_tokens": 4}}
    if kind == "hf":
        body = {"model": "hf", "text": "hi", "sampling_params": {"max_new_tokens": 2}}
    elif kind in ("leave", "stream"):
        body["stream"] = True
    headers = {"X-Request-ID": rid}
    begin = time.perf_counter()
    try:
        async with session.post(f"{url}/{ROLE}/generate", json=body, headers=headers) as resp:
            if resp.status != 200:
                await resp.read()
                return f"http_{resp.status}", time.perf_counter() - begin
            if kind == "leave":
                await resp.content.readany()  # the first event, then the caller goes away
                resp.close()
                return "left", time.perf_counter() - begin
            data = await resp.read()
            if kind == "stream" and not data.rstrip().endswith(b"data: [DONE]"):
                return "stream_cut", time.perf_counter() - begin
            return "ok", time.perf_counter() - begin
    except aiohttp.ClientPayloadError:
        return "stream_cut", time.perf_counter() - begin
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"client_{type(exc).__name__}", time.perf_counter() - begin


async def load(
    url: str,
    requests: list[tuple[str, str]],
    concurrency: int,
    on_progress: Any = None,
) -> tuple[collections.Counter[str], list[float], dict[str, int]]:
    """Send ``requests`` at ``concurrency``; outcomes, latencies of completed requests, and
    how many of each kind were sent."""
    import aiohttp

    outcomes: collections.Counter[str] = collections.Counter()
    latencies: list[float] = []
    sent: collections.Counter[str] = collections.Counter()
    it = iter(requests)
    done = 0
    connector = aiohttp.TCPConnector(limit=concurrency)
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            nonlocal done
            for rid, kind in it:
                sent[kind] += 1
                outcome, seconds = await one(session, url, rid, kind)
                outcomes[outcome] += 1
                if outcome == "ok":
                    latencies.append(seconds)
                done += 1
                if on_progress is not None:
                    on_progress(done)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return outcomes, latencies, dict(sent)


# -- the job ------------------------------------------------------------------------------------


def replays(log_dir: Path) -> tuple[int, int]:
    """``(request ids logged by the sim engines, ids logged more than once)``."""
    counts: collections.Counter[str] = collections.Counter()
    for path in log_dir.glob("*.log"):
        counts.update(line for line in path.read_text().splitlines() if line)
    return sum(counts.values()), sum(n - 1 for n in counts.values() if n > 1)


def hf_requests(url: str) -> int:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            if line.startswith("sglang:num_requests_total"):
                return int(float(line.rpartition(" ")[2]))
    raise RuntimeError(f"{url}/metrics has no sglang:num_requests_total")


def settle(pid: int, seconds: float = 10.0) -> tuple[float, int]:
    """Let idle keep-alive connections close (the data path closes them 4-8 s after their last
    use), then measure."""
    time.sleep(seconds)
    return rss_mib(pid), open_fds(pid)


def run(total: int, concurrency: int) -> int:
    import ray
    from relax_bench.manager import SIM_BACKEND

    from relax_core import (
        EngineOptions,
        InferenceManager,
        ManagerTimeouts,
        ModelLaunch,
        PluginManager,
        ReplicaPlacement,
    )
    from relax_core.discovery.schema import RoutingSpec
    from relax_core.discovery.server import RegistryServer
    from relax_core.engine.spec import InferenceEngineSpec
    from relax_core.jobs import RoleService
    from relax_core.net import keep_local_ray_on_loopback

    began = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix="relax-soak-"))
    log_dir = work / "requests"
    pm = PluginManager.create()
    static = pm.weight_source("STATIC")
    keep_local_ray_on_loopback()
    ray.init(
        address="local", num_cpus=8, include_dashboard=False, log_to_driver=False,
        configure_logging=False,
    )  # fmt: skip
    service = RoleService(ROLE, RoutingSpec(default_model="sim"), weight_sources=pm)
    timeouts = ManagerTimeouts(start=180.0, health=5.0, shutdown=15.0, rpc_margin=5.0)
    sim = InferenceManager(
        "sim",
        spec=InferenceEngineSpec(role=ROLE, weight_source=static),
        backend=SIM_BACKEND,
        launch=ModelLaunch(
            model_path="sim",
            served_model_name="sim",
            options=EngineOptions(
                extra_args=(
                    "--request-log",
                    str(log_dir),
                    "--generate-ms",
                    "2",
                    "--stream-gap-ms",
                    "2",
                )
            ),
        ),
        placement=ReplicaPlacement.unplaced(SIM_REPLICAS),
        publisher=service.publisher,
        timeouts=timeouts,
    )
    from relax_hf.tiny import make_tiny_model

    hf = InferenceManager(
        "hf",
        spec=InferenceEngineSpec(role=ROLE, weight_source=static),
        backend=pm.engine_backend("hf"),
        launch=ModelLaunch(
            model_path=str(make_tiny_model(str(work / "model"), size="micro")),
            served_model_name="hf",
        ),
        placement=ReplicaPlacement.unplaced(1),
        publisher=service.publisher,
        timeouts=timeouts,
    )
    # Only the sim model is health-checked: the hf engine's own request count must be exactly
    # what the callers sent it (a health probe generates too).
    service.add("sim", sim)
    registry = RegistryServer({ROLE: service.snapshot})
    rebuilt: dict[str, Any] = {}
    try:
        starts = [
            threading.Thread(target=lambda m=m: m.start().raise_for_failures()) for m in (sim, hf)
        ]
        for t in starts:
            t.start()
        for t in starts:
            t.join()
        if set(sim.states().values()) != {"READY"} or set(hf.states().values()) != {"READY"}:
            raise RuntimeError(f"engines not READY: {sim.states()} {hf.states()}")
        registry.start()
        events: list[str] = []

        def on_report(model_id: str, outcome: Any) -> None:
            stamp = f"{time.monotonic() - began:6.1f}s"
            if isinstance(outcome, BaseException):
                events.append(f"{stamp} {model_id}: {outcome}")
                return
            for r in outcome.replicas:
                if not r.healthy:
                    events.append(f"{stamp} {r.engine_id}: {r.action}, now {r.state}")

        service.start_monitor(0.5, on_report=on_report)
        hf_head = hf.model_view().engines[0].base_url
        assert hf_head is not None
        with gateway_process(f"{registry.url}/{ROLE}") as gw:
            url, pid = gw["url"], gw["pid"]
            asyncio.run(load(url, plan(WARMUP, 1, "warmup"), concurrency))
            rss0, fds0 = settle(pid)
            hf0 = hf_requests(hf_head)
            logged0, _ = replays(log_dir)
            victim = sorted(sim.engine_pids())[1]
            killed = sim.engine_pids()[victim][0]

            def kill_at(done: int) -> None:
                if done == int(total * 0.3) and "pid" not in rebuilt:
                    os.kill(killed, signal.SIGKILL)
                    rebuilt["pid"], rebuilt["at"] = killed, time.monotonic()

            measured = time.monotonic()
            outcomes, latencies, sent = asyncio.run(
                load(url, plan(total, 2, "soak"), concurrency, kill_at)
            )
            seconds = time.monotonic() - measured
            after = sim.engine_pids()[victim][0]
            rebuilt["new_pid"], rebuilt["state"] = after, sim.states()[victim]
            rss1, fds1 = settle(pid)
            final = metrics(url)
            hf_received = hf_requests(hf_head) - hf0
        logged, duplicates = replays(log_dir)
    finally:
        service.stop_monitor()
        registry.stop()
        for manager in (sim, hf):
            with contextlib.suppress(Exception):
                manager.shutdown()
        ray.shutdown()

    done = sum(outcomes.values())
    failed = {k: v for k, v in outcomes.items() if k not in ("ok", "left")}
    classes = {
        kind: int(
            final.get(f'relax_gateway_upstream_failures_total{{class="{kind}",role="{ROLE}"}}', 0)
        )
        for kind in ("connect", "before_first_byte", "mid_stream")
    }
    answered = {
        kind: int(
            final.get(f'relax_gateway_upstream_errors_total{{error="{kind}",role="{ROLE}"}}', 0)
        )
        for kind in ("unreachable", "transport", "deadline", "status", "stream_aborted")
    }
    breakers = {
        to: int(final.get(f'relax_gateway_breaker_transitions_total{{role="{ROLE}",to="{to}"}}', 0))
        for to in ("open", "closed")
    }
    p50 = statistics.median(latencies) * 1000.0
    p99 = statistics.quantiles(latencies, n=100)[98] * 1000.0
    growth = (rss1 - rss0) / rss0
    checks = {
        "every request accounted for": done == total,
        "no request id reached an engine twice": duplicates == 0,
        "the hf engine received exactly what was sent to it": hf_received == sent.get("hf", 0),
        "gateway RSS grew < 10%": growth < 0.10,
        "gateway file descriptors did not grow": fds1 <= fds0,
        "the killed engine was rebuilt": rebuilt.get("new_pid") not in (None, killed)
        and rebuilt.get("state") == "READY",
        "fewer than 2% of requests failed": sum(failed.values()) < 0.02 * total,
    }
    report = {
        "requests": total,
        "concurrency": concurrency,
        "seconds": round(seconds, 1),
        "requests_per_s": round(total / seconds, 1),
        "sent_by_kind": sent,
        "outcomes": dict(sorted(outcomes.items())),
        "errors_by_class": classes,
        "gateway_error_answers": answered,
        "breakers": breakers,
        "latency_ms": {"p50": round(p50, 2), "p99": round(p99, 2), "completed": len(latencies)},
        "gateway_rss_mib": {
            "start": round(rss0, 1),
            "end": round(rss1, 1),
            "growth": round(growth, 4),
        },
        "gateway_open_fds": {"start": fds0, "end": fds1},
        "replays": {
            "sim_request_ids_logged": logged - logged0,
            "sim_ids_received_twice": duplicates,
            "hf_sent": sent.get("hf", 0),
            "hf_received": hf_received,
        },
        "killed_engine": {
            "pid": killed,
            "rebuilt_pid": rebuilt.get("new_pid"),
            "state_at_end": rebuilt.get("state"),
        },
        "health_events": events,
        "checks": checks,
        "passed": all(checks.values()),
    }
    print(format_report(report))
    print(json.dumps(report))
    return 0 if report["passed"] else 1


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"soak: {r['requests']} requests at concurrency {r['concurrency']} in {r['seconds']} s "
        f"({r['requests_per_s']} req/s) through one {ROLE} gateway process",
        f"  sent: {r['sent_by_kind']}",
        f"  outcomes: {r['outcomes']}",
        f"  upstream failures by class (gateway /metrics): {r['errors_by_class']}; breakers "
        f"{r['breakers']}",
        f"  upstream errors the gateway answered, by kind: {r['gateway_error_answers']} (status: "
        "an engine's door answered 502 for a request its killed engine had received)",
        f"  latency of completed requests: p50 {r['latency_ms']['p50']} ms, p99 "
        f"{r['latency_ms']['p99']} ms",
        f"  gateway RSS: {r['gateway_rss_mib']['start']} MiB -> {r['gateway_rss_mib']['end']} MiB "
        f"({r['gateway_rss_mib']['growth'] * 100:+.1f}%)",
        f"  gateway open fds: {r['gateway_open_fds']['start']} -> {r['gateway_open_fds']['end']}",
        f"  replays (engine side): {r['replays']['sim_ids_received_twice']} of "
        f"{r['replays']['sim_request_ids_logged']} sim request ids received twice; hf sent "
        f"{r['replays']['hf_sent']}, received {r['replays']['hf_received']}",
        f"  killed engine pid {r['killed_engine']['pid']} -> rebuilt as pid "
        f"{r['killed_engine']['rebuilt_pid']}, {r['killed_engine']['state_at_end']} at the end",
        *(f"  health: {e}" for e in r["health_events"]),
        *(f"  [{'ok' if ok else 'FAILED'}] {what}" for what, ok in r["checks"].items()),
        f"soak {'PASSED' if r['passed'] else 'FAILED'}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--concurrency", type=int, default=512)
    parser.add_argument("--serve-gateway", metavar="REGISTRY_URL", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_gateway:
        serve_gateway(args.serve_gateway)
        return 0
    return run(args.requests, args.concurrency)


if __name__ == "__main__":
    sys.exit(main())
