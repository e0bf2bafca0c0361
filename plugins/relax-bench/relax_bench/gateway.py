"""``relax bench gateway``: the role gateway against the upstream direct and against sglang-router.

Every party runs in its own process(es) on loopback: a null engine
(:mod:`relax_bench._gateway_upstream`), the gateway of the benchmark's role in front of it
(:mod:`relax_bench._gateway_proc`, uvicorn on uvloop + httptools), the real sglang-router
binary in front of it (``python -m sglang_router.launch_router --worker-urls <null engine>``),
and the load generator (``wrk`` when installed, else :mod:`relax_bench._loadgen`, a
multi-process httptools client that costs about 10 µs of CPU per request).

What is compared (stated under ``fairness`` in the result): the router runs with its default
runtime, one worker thread per core (tokio), and the gateway with as many worker processes as
there are cores (``GatewayServer(workers=N)``, SO_REUSEPORT), both on the same cores, one after
the other. ``gateway_1w`` is the gateway with one worker (one core at most), for scale. Set
``RELAX_BENCH_GATEWAY_WORKERS`` to change N.

Measured, in interleaved rounds (median of rounds), in one run:

- ``c1``: p50 latency of ``POST /generate`` at concurrency 1: direct, gateway, router;
- ``c32``: requests/s at concurrency 32: direct, gateway, gateway_1w, router;
- ``stream``: seconds to receive a streamed answer of 10,000 SSE events: direct, gateway, and
  ``gateway_uncoalesced`` (the one-worker gateway with ``stream_coalesce=0``: every upstream
  read relayed at once, for comparison).

The null engine writes its events as fast as its loop turns (about 6 µs apart), far faster
than any engine emits tokens. The gateway reads such a fire hose once per
``stream_coalesce`` (1 ms by default) instead of once per event (see
:class:`~relax_core.gateway.handler.InferenceGatewayHandler`), which costs each event at most 1 ms
of delay; a stream slower than one event per millisecond is relayed read by read.

Targets (reported under ``targets``): gateway c32 throughput >= 0.6x the router's; added p50 at
c1 <= 0.5 ms over direct; the stream <= 1.1x its direct time.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

from relax_bench._gateway_proc import ROLE
from relax_bench._null_upstream import ready_line
from relax_core import DEFAULT_STREAM_COALESCE_S, RelaxError, free_port

__all__ = ["format_result", "run"]

_BODY = '{"text":"What is six times seven?","sampling_params":{"max_new_tokens":16}}'


@contextlib.contextmanager
def _process(
    args: list[str], what: str, timeout: float = 30.0, *, stop_timeout: float = 10.0
) -> Iterator[dict[str, Any]]:
    """Start ``python -m …`` that prints one JSON line when ready (within ``timeout``); stop
    it by closing stdin, killing it if it has not exited ``stop_timeout`` seconds later."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        yield json.loads(ready_line(proc, timeout, what))
    finally:
        if proc.stdin is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()
        try:
            proc.wait(timeout=stop_timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


@contextlib.contextmanager
def _router(worker: str, timeout: float = 60.0) -> Iterator[str]:
    """The real sglang-router in front of ``worker``; yields its URL once it forwards."""
    with tempfile.TemporaryFile() as errors:
        yield from _run_router(worker, timeout, errors)


def _run_router(worker: str, timeout: float, errors: Any) -> Iterator[str]:
    port, prom = free_port(), free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sglang_router.launch_router",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--worker-urls",
            worker,
            "--policy",
            "round_robin",
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(prom),
            "--log-level",
            "warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=errors,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                errors.seek(0)
                said = errors.read()[-600:].decode("utf-8", "replace").strip()
                raise RelaxError(
                    f"sglang-router exited with code {proc.returncode} before it served: "
                    f"{said or '(it printed nothing)'}"
                )
            try:
                req = urllib.request.Request(
                    url + "/generate",
                    data=_BODY.encode(),
                    headers={"Content-Type": "application/json"},
                )
                with urllib.request.urlopen(req, timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"sglang-router did not forward to {worker} within {timeout:.0f}s"
                )
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _wrk(url: str, concurrency: int, seconds: float, script: str) -> dict[str, float]:
    threads = 1 if concurrency == 1 else 2
    out = subprocess.run(
        [
            "wrk",
            f"-t{threads}",
            f"-c{concurrency}",
            f"-d{max(1, round(seconds))}s",
            "--latency",
            "-s",
            script,
            url,
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=seconds + 30,
    ).stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p50 = re.search(r"\s50%\s+([\d.]+)(us|ms|s)\b", out)
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if non2xx:
        raise RuntimeError(f"{url} answered {non2xx.group(1)} errors under load:\n{out}")
    assert p50 is not None, out
    return {"rps": rps, "p50_ms": float(p50.group(1)) * _UNITS[p50.group(2)]}


def _python_loadgen(url: str, concurrency: int, seconds: float) -> dict[str, float]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "relax_bench._loadgen",
            "--url",
            url,
            "--concurrency",
            str(concurrency),
            "--seconds",
            str(seconds),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=seconds + 60,
    ).stdout
    result: dict[str, float] = json.loads(out)
    if result["errors"]:
        raise RuntimeError(f"{url} answered {result['errors']} errors under load")
    return result


def _stream(url: str, repeat: int) -> list[float]:
    out = subprocess.run(
        [sys.executable, "-m", "relax_bench._loadgen", "--url", url, "--stream", str(repeat)],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    ).stdout
    result = json.loads(out)
    if result["bytes"] < 10_000 * 300:
        raise RuntimeError(f"{url} streamed only {result['bytes']} bytes")
    return list(result["seconds"])


def _threads(name: str) -> dict[str, int]:
    """Thread names and counts of the process named ``name`` (Linux ``/proc``; else empty)."""
    import glob

    for comm in glob.glob("/proc/[0-9]*/comm"):
        try:
            with open(comm) as f:
                if f.read().strip() != name:
                    continue
            names: dict[str, int] = {}
            for task in glob.glob(comm.replace("/comm", "/task/*/comm")):
                with open(task) as f:
                    thread = f.read().strip()
                names[thread] = names.get(thread, 0) + 1
            return names
        except OSError:
            continue
    return {}


def _check_router_installed() -> None:
    """:raises RelaxError: the sglang-router package (the router binary) is not installed."""
    try:
        import sglang_router  # noqa: F401  (only whether it is there)
    except ImportError:
        raise RelaxError(
            "this benchmark compares the gateway with the real sglang-router, which is not "
            "installed in this Python environment. Install it: pip install "
            "'sglang-router>=0.3.2,<0.4' (it also comes with relax-core's test extra: "
            "pip install -e '.[test]')"
        ) from None


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark once (``quick``: shorter phases); return the numbers and targets.

    :raises RelaxError: the sglang-router package is not installed (nothing is started).
    """
    _check_router_installed()
    rounds = 1 if quick else 3
    c1_seconds, c32_seconds = (1.0, 1.0) if quick else (2.0, 3.0)
    use_wrk = shutil.which("wrk") is not None and not os.environ.get("RELAX_BENCH_NO_WRK")
    cores = os.cpu_count() or 1
    workers = int(os.environ.get("RELAX_BENCH_GATEWAY_WORKERS") or cores)
    samples: dict[str, dict[str, list[float]]] = {
        "c1": {"direct": [], "gateway": [], "router": []},
        "c32": {"direct": [], "gateway": [], "gateway_1w": [], "router": []},
        "stream": {"direct": [], "gateway": [], "gateway_uncoalesced": []},
    }
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory())
        script = os.path.join(tmp, "post.lua")
        with open(script, "w") as f:
            f.write(
                'wrk.method = "POST"\n'
                f"wrk.body = '{_BODY}'\n"
                'wrk.headers["Content-Type"] = "application/json"\n'
            )
        upstream = stack.enter_context(
            _process(["relax_bench._gateway_upstream"], "the null engine")
        )
        engine = f"http://127.0.0.1:{upstream['port']}"
        gw = stack.enter_context(
            _process(
                [
                    "relax_bench._gateway_proc",
                    "--upstream",
                    engine,
                    "--workers",
                    str(workers),
                ],
                "the gateway",
                timeout=90.0,
            )
        )
        gw1 = stack.enter_context(
            _process(
                [
                    "relax_bench._gateway_proc",
                    "--upstream",
                    engine,
                    "--stream-coalesce",
                    "0",
                ],
                "the gateway",
            )
        )
        router = stack.enter_context(_router(engine))
        targets = {
            "direct": f"{engine}/generate",
            "gateway": f"http://127.0.0.1:{gw['port']}/{ROLE}/generate",
            "gateway_1w": f"http://127.0.0.1:{gw1['port']}/{ROLE}/generate",
            "router": router + "/generate",
        }

        def load(url: str, concurrency: int, seconds: float) -> dict[str, float]:
            if use_wrk:
                return _wrk(url, concurrency, seconds, script)
            return _python_loadgen(url, concurrency, seconds)

        for url in targets.values():  # warm every path (connections, caches)
            load(url, 4, 1.0)
        router_threads = _threads("sglang::router")
        for _ in range(rounds):
            for name in samples["c1"]:
                samples["c1"][name].append(load(targets[name], 1, c1_seconds)["p50_ms"])
            for name in samples["c32"]:
                samples["c32"][name].append(load(targets[name], 32, c32_seconds)["rps"])
        streams = {
            "direct": targets["direct"],
            "gateway": targets["gateway"],
            "gateway_uncoalesced": targets["gateway_1w"],
        }
        for url in streams.values():
            _stream(url, 1)  # warm-up
        for _ in range(rounds):
            for name, url in streams.items():
                samples["stream"][name].extend(_stream(url, 1))
    med = {k: {n: statistics.median(v) for n, v in d.items()} for k, d in samples.items()}
    c1, c32, st = med["c1"], med["c32"], med["stream"]
    result: dict[str, Any] = {
        "c1": {f"{n}_p50_ms": round(v, 4) for n, v in c1.items()},
        "c32": {f"{n}_rps": round(v, 1) for n, v in c32.items()},
        "stream": {f"{n}_s": round(v, 4) for n, v in st.items()},
        "load_generator": "wrk (2 threads)" if use_wrk else f"python-httptools ({cores} processes)",
        "rounds": rounds,
        "fairness": {
            "cores": cores,
            "gateway_workers": workers,
            "router_threads": router_threads,
            "compared": f"sglang-router with its default runtime (one tokio worker thread per "
            f"core) vs the gateway with {workers} worker process(es), on the same {cores} "
            "core(s), one after the other; gateway_1w: one gateway process, for scale (it "
            "relays streams with stream_coalesce=0: stream.gateway_uncoalesced_s)",
            "stream_coalesce_s": DEFAULT_STREAM_COALESCE_S,
        },
    }
    result["targets"] = {
        "gateway_vs_router_rps": round(c32["gateway"] / c32["router"], 3),
        "gateway_vs_router_rps_ok": c32["gateway"] >= 0.6 * c32["router"],
        "added_p50_ms": round(c1["gateway"] - c1["direct"], 4),
        "added_p50_ok": c1["gateway"] - c1["direct"] <= 0.5,
        "stream_ratio": round(st["gateway"] / st["direct"], 3),
        "stream_ok": st["gateway"] <= 1.1 * st["direct"],
    }
    return result


def format_result(result: dict[str, Any]) -> str:
    """A short table of the numbers and whether each target was met."""
    c1, c32, st, t = result["c1"], result["c32"], result["stream"], result["targets"]
    lines = [
        f"load generator: {result['load_generator']}, {result['rounds']} round(s), medians",
        f"compared: {result['fairness']['compared']}",
        f"{'':10}{'direct':>12}{'gateway':>12}{'router':>12}",
        f"{'c1 p50 ms':10}{c1['direct_p50_ms']:>12.3f}{c1['gateway_p50_ms']:>12.3f}"
        f"{c1['router_p50_ms']:>12.3f}",
        f"{'c32 rps':10}{c32['direct_rps']:>12.0f}{c32['gateway_rps']:>12.0f}"
        f"{c32['router_rps']:>12.0f}   (gateway with 1 worker: {c32['gateway_1w_rps']:.0f})",
        f"{'stream s':10}{st['direct_s']:>12.3f}{st['gateway_s']:>12.3f}"
        f"{'':12}   (gateway relaying every read at once: {st['gateway_uncoalesced_s']:.3f})",
        f"gateway/router rps {t['gateway_vs_router_rps']:.2f} (target >= 0.6: "
        f"{'met' if t['gateway_vs_router_rps_ok'] else 'MISSED'})",
        f"added p50 {t['added_p50_ms']:.3f} ms (target <= 0.5: "
        f"{'met' if t['added_p50_ok'] else 'MISSED'})",
        f"stream ratio {t['stream_ratio']:.2f} (target <= 1.1: "
        f"{'met' if t['stream_ok'] else 'MISSED'})",
    ]
    return "\n".join(lines)
