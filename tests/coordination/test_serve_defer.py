"""``relax serve`` honours the phases of a defer plan, and wakes its roles on demand.

A deferred role starts, is put to SLEEPING (its KV cache released; the example's judge and
teacher keep their weights, rollout's go) and only then does the next phase start; the job is
reported ready with the deferred roles asleep. Then a request to a sleeping role's gateway
wakes it, evicting the role it shares its GPU with, and an idle role goes back to sleep. That
no two roles ever hold their KV cache at once — while it starts, and under concurrent requests
for two roles — is checked on the real engines: a monitor reads every engine's own
``/server_info`` memory log (when each resume began, when each release freed the KV cache)
and the time each engine process started, and rebuilds when each engine held its KV cache.

The engines are hf on CPU, placed on declared GPUs (``device = "cuda"`` for the planner, the
engine itself told ``--device cpu``: this machine has no GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from relax_core.config import loads_config
from relax_core.jobs import check_job, start_order
from relax_core.placement import ModeResult, Slice
from relax_core.plugins import PluginManager, module_plugin
from relax_core.records import PlacementMode
from relax_core.testing import wait_for
from tests.support import serve as support
from tests.support.jobs import CPU, colocated, defer, hf, job_text


def _job(mode: str = "defer") -> str:
    """Three models on one declared GPU, the judge's and the teacher's roles deferred."""
    placement = defer("genrm", "teacher") if mode == "defer" else {"mode": mode}
    return job_text(
        **colocated(1),
        placement=placement,
        models={
            "rollout.policy": hf("/models/none", route_mode="DIRECT", extra_args=CPU),
            "genrm.judge": hf("/models/none", extra_args=CPU),
            "teacher.math": hf("/models/none", extra_args=CPU),
        },
    )


def test_start_order_puts_each_deferred_phase_to_sleep_before_the_next_starts() -> None:
    from relax_core.placement import plan_inference_placement

    config = loads_config(_job())
    plan = plan_inference_placement(config, PluginManager.create())
    assert plan.phases == ("generation", "genrm", "teacher")
    assert start_order(config, plan) == [
        (("genrm",), True),
        (("teacher",), True),
        (("rollout",), False),
    ]


def test_a_plan_whose_awake_phases_share_bundles_is_refused_before_anything_starts() -> None:
    def assign(ctx: Any) -> ModeResult:
        # A third party's mode: every model from bundle 0, each role in a phase of its own,
        # nothing deferred — relax serve would have to keep two phases awake on one GPU.
        slices = tuple(Slice(d.role, d.model, "actor", 0, phase=d.role) for d in ctx.demands)
        return ModeResult(slices, (), tuple(d.role for d in ctx.demands))

    mode = PlacementMode(name="phased", assign=assign, shares_training_pool=True)

    def modes(register: Any) -> None:
        register(mode)

    pm = PluginManager.create(
        plugins=[("phased", module_plugin("phased", relax_register_placement_modes=modes))]
    )
    text = _job(mode="phased")
    problems = [p for p in check_job(loads_config(text), pm) if "[serve-phases]" in p]
    assert problems, check_job(loads_config(text), pm)
    assert problems[0].startswith("roles.genrm.models.judge: [serve-phases] genrm.judge")
    assert "neither role is deferred" in problems[0]


# -- the real thing ---------------------------------------------------------------------------

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "run-cpu.toml"


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


def _post(url: str, body: dict[str, Any], timeout: float = 120.0) -> Any:
    req = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())


def _process_started(pid: int) -> float:
    """When process ``pid`` started (epoch seconds, to a clock tick), from /proc: before it
    loaded anything. Measured back from now through ``/proc/uptime`` (centiseconds), not from
    ``btime``, which /proc/stat gives in whole seconds (up to a second early)."""
    with open(f"/proc/{pid}/stat") as f:
        ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        now, uptime = time.time(), float(f.read().split()[0])
    return now - uptime + ticks / os.sysconf("SC_CLK_TCK")


class Residency:
    """Reads every engine of the job's model dir: its process start and its memory log, from
    which :meth:`intervals` rebuilds when it held its KV cache (conservatively: from the start
    of its process, or of a resume, to the end of a release)."""

    def __init__(self, root: Path) -> None:
        self.root = str(root)
        self.engines: dict[int, tuple[str, int]] = {}  # pid -> (model, port)
        self.started: dict[int, float] = {}
        self.log: dict[int, dict[tuple[str, float], dict[str, Any]]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _scan(self) -> None:
        for pid in support.mentioning(self.root):
            if pid in self.engines:
                continue
            argv = support.cmdline(pid).split()
            if "relax_hf" in argv and "--port" in argv and "--served-model-name" in argv:
                with contextlib.suppress(OSError):
                    self.started[pid] = _process_started(pid)
                    name = argv[argv.index("--served-model-name") + 1]
                    self.engines[pid] = (name, int(argv[argv.index("--port") + 1]))

    def poll(self) -> None:
        self._scan()
        for pid, (_, port) in list(self.engines.items()):
            with contextlib.suppress(OSError, ValueError):
                info = _get(f"http://127.0.0.1:{port}/server_info", timeout=2)
                entries = self.log.setdefault(pid, {})
                for entry in info["memory_log"]:
                    if "kv_cache" in entry["tags"]:
                        entries[(entry["op"], entry["started"])] = entry

    def _run(self) -> None:
        while not self._stop.wait(0.05):  # the log keeps 16 entries: far more than 50 ms holds
            self.poll()

    def intervals(self) -> list[tuple[str, float, float]]:
        """``(model, from, to)``: every span an engine may have held its KV cache."""
        spans = []
        for pid, (name, _) in self.engines.items():
            since: float | None = self.started[pid]
            for entry in sorted(self.log.get(pid, {}).values(), key=lambda e: e["at"]):
                if entry["op"] == "resume" and since is None:
                    since = entry["started"]
                elif entry["op"] == "release" and since is not None:
                    spans.append((name, since, entry["at"]))
                    since = None
            if since is not None:
                spans.append((name, since, float("inf")))
        return spans

    def overlaps(self) -> list[tuple[tuple[str, float, float], tuple[str, float, float]]]:
        """Spans of two different models that overlap in time."""
        spans = self.intervals()
        return [
            (a, b)
            for i, a in enumerate(spans)
            for b in spans[i + 1 :]
            if a[0] != b[0] and a[1] < b[2] and b[1] < a[2]
        ]

    def resident(self) -> set[str]:
        """The models holding their KV cache now, as their engines say."""
        held = set()
        for name, port in self.engines.values():
            with contextlib.suppress(OSError, ValueError):
                if _get(f"http://127.0.0.1:{port}/server_info", timeout=2)["resident"]["kv_cache"]:
                    held.add(name)
        return held

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(scope="module")
def example_job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """docs/examples/run-cpu.toml beside its three tiny models, made as its header says."""
    from relax_hf import make_tiny_model

    root = tmp_path_factory.mktemp("serve-defer")
    for name, seed in (("policy", 0), ("judge", 1), ("math", 2)):
        make_tiny_model(str(root / "tiny" / name), seed=seed, size="micro")
    job = root / "run-cpu.toml"
    shutil.copy(EXAMPLE, job)
    return job


@pytest.mark.ray
@pytest.mark.slow
def test_serve_of_the_example_defer_job_starts_phase_by_phase_and_wakes_roles_on_demand(
    example_job: Path,
) -> None:
    root = example_job.parent
    args = ("--log-dir", str(root / "logs"), "--refresh", "0.5")
    wake = ("--idle-seconds", "4", "--min-residency", "1", "--wake-timeout", "60")
    residency = Residency(root)
    residency.start()
    try:
        with support.serve(example_job, *args, *wake) as (proc, out, _):
            out.wait_for(r"relax serve: ready", timeout=300)
            text = str(out)
            # Phase by phase: each deferred role asleep before the next one starts.
            order = [
                text.index("starting genrm.judge (deferred"),
                text.index("genrm.judge: SLEEPING"),
                text.index("starting teacher.math (deferred"),
                text.index("teacher.math: SLEEPING"),
                text.index("starting rollout.policy (awake)"),
            ]
            assert order == sorted(order), text
            assert "a request to its gateway wakes it" in text
            assert re.search(r"residency: actor:0-0: one at a time: genrm, rollout, teacher", text)
            urls = {
                role: out.wait_for(rf"{role}\s+gateway\s+(http://[\d.:]+)/{role}/", 5).group(1)
                for role in ("rollout", "genrm", "teacher")
            }

            # Requests to all three roles succeed: each wakes its role (evicting the one
            # awake: no budget is known, so one role at a time).
            prefill = {
                "input_ids": [5, 6, 7, 8],
                "return_logprob": True,
                "logprob_start_len": 1,
                "sampling_params": {"max_new_tokens": 0},
            }
            judge = {
                "messages": [{"role": "user", "content": "2+2=4. Correct?"}],
                "sampling_params": {"max_new_tokens": 2},
            }
            generate = {"text": "hi", "sampling_params": {"max_new_tokens": 3, "ignore_eos": True}}
            taught = _post(f"{urls['teacher']}/teacher/generate", prefill)
            assert len(taught["meta_info"]["input_token_logprobs"]) == 3
            assert isinstance(_post(f"{urls['genrm']}/genrm/generate", judge)["response"], str)
            made = _post(f"{urls['rollout']}/rollout/generate", generate)
            assert made["meta_info"]["completion_tokens"] == 3
            out.wait_for(r"residency: rollout: AWAKE", timeout=10)
            # One role at a time: genrm sleeps now, and its legacy health body says so rather
            # than "healthy" beside healthy_engines 0 with no word why.
            # (The gateway reads the registry's snapshot, refreshed every half second.)
            deadline = time.monotonic() + 30
            legacy = _get(f"{urls['genrm']}/genrm/health?schema=1")
            while legacy["healthy_engines"] != 0 and time.monotonic() < deadline:
                time.sleep(0.2)
                legacy = _get(f"{urls['genrm']}/genrm/health?schema=1")
            assert legacy["status"] == "healthy" and legacy["healthy_engines"] == 0, legacy
            assert legacy["residency"] != "AWAKE" and "a request wakes them" in legacy["message"]

            # Concurrent requests for genrm and teacher: all answered, in batches (a woken
            # role stays a second at least), and never both resident.
            calls = [("teacher", prefill), ("genrm", judge)] * 4
            with ThreadPoolExecutor(len(calls)) as pool:
                answers = list(
                    pool.map(lambda c: _post(f"{urls[c[0]]}/{c[0]}/generate", c[1]), calls)
                )
            assert all("meta_info" in a or "response" in a for a in answers), answers
            health = _get(f"{urls['genrm']}/genrm/health?schema=2")
            assert health["residency"]["slice"] == "actor:0-0"
            waits = health["residency"]["wake_waits"]
            assert waits["count"] >= 1 and 0 < waits["p50_s"] <= waits["p99_s"] <= waits["max_s"]
            metrics = urllib.request.urlopen(f"{urls['teacher']}/metrics", timeout=5).read()
            wakes = re.search(rb'relax_wake_wakes_total\{role="teacher"\} (\d+)', metrics)
            assert wakes and int(wakes.group(1)) >= 1, metrics.decode()[:2000]
            status = subprocess.run(
                [sys.executable, "-m", "relax_core", "status", f"{urls['genrm']}/genrm"],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert re.search(r"residency\s+\w+ on actor:0-0 \(woken on demand", status.stdout)

            # After the idle time every role is asleep again, as its engine says.
            wait_for(lambda: not residency.resident(), timeout=60, what="every role asleep")
            out.wait_for(r"actor:0-0: genrm SLEEPING, rollout SLEEPING, teacher SLEEPING", 30)
            residency.poll()
            assert {name for name, _ in residency.engines.values()} == {"judge", "math", "policy"}
            spans = residency.intervals()
            for name in ("judge", "math", "policy"):  # loaded at start, and woken since
                assert sum(1 for s in spans if s[0] == name) >= 2, spans
            assert all(to < float("inf") for _, _, to in spans), spans
            assert residency.overlaps() == [], residency.overlaps()[:3]
            # Every role was woken and put back: its engine's log shows it.
            resumed = {
                residency.engines[pid][0]
                for pid, log in residency.log.items()
                if any(op == "resume" for op, _ in log)
            }
            assert resumed == {"judge", "math", "policy"}, residency.log

            os.killpg(proc.pid, signal.SIGINT)
            assert proc.wait(timeout=120) == 0, out.rest(10)
            assert out.rest(10).endswith("nothing left running")
    finally:
        residency.stop()
    wait_for(lambda: not support.mentioning(str(root)), timeout=30, what="every engine gone")
