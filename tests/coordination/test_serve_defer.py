"""``relax serve`` honours the phases of a defer plan.

A deferred role starts, is put to SLEEPING (engine memory released, weights kept on the CPU)
and only then does the next phase start; the job is reported ready with the deferred roles
asleep, and a request to them does not wake them (only the coordinator does). The co-loading
bug — every role of a defer plan started at once on shared bundles — is checked on the real
engines: a monitor polls every engine's own ``/server_info`` while ``relax serve`` starts and
records which roles hold weights at the same moment.

The engines are hf on CPU, placed on declared GPUs (``device = "cuda"`` for the planner, the
engine itself told ``--device cpu``: this machine has no GPU).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
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

JOB = """\
[cluster]
num_nodes = 1
gpus_per_node = 1

[training]
actor_gpus = 1
colocate = true
offload = true

[placement]
mode = "defer"
defer_roles = ["genrm", "teacher"]

[roles.rollout.models.policy]
backend = "hf"
model_path = "{model}"
route_mode = "DIRECT"
extra_args = ["--device", "cpu"]

[roles.genrm.models.judge]
backend = "hf"
model_path = "{model}"
extra_args = ["--device", "cpu"]

[roles.teacher.models.math]
backend = "hf"
model_path = "{model}"
extra_args = ["--device", "cpu"]
"""


def test_start_order_puts_each_deferred_phase_to_sleep_before_the_next_starts() -> None:
    from relax_core.placement import plan_inference_placement

    config = loads_config(JOB.format(model="/models/none"))
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
    text = JOB.format(model="/models/none").replace('mode = "defer"', 'mode = "phased"')
    text = text.replace('defer_roles = ["genrm", "teacher"]', "")
    problems = [p for p in check_job(loads_config(text), pm) if "[serve-phases]" in p]
    assert problems, check_job(loads_config(text), pm)
    assert problems[0].startswith("roles.genrm.models.judge: [serve-phases] genrm.judge")
    assert "neither role is deferred" in problems[0]


# -- the real thing ---------------------------------------------------------------------------


def _get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as resp:
        return json.loads(resp.read())


class Residency:
    """Polls every engine of the test's model dir for which roles hold their weights."""

    def __init__(self, model_dir: Path) -> None:
        self.model_dir = str(model_dir)
        self.overlaps: list[set[str]] = []
        self.seen: set[str] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _engines(self) -> dict[int, tuple[str, int]]:
        out = {}
        for pid in support.mentioning(self.model_dir):
            argv = support.cmdline(pid).split()
            if "relax_hf" in argv and "--port" in argv and "--served-model-name" in argv:
                port = int(argv[argv.index("--port") + 1])
                out[pid] = (argv[argv.index("--served-model-name") + 1], port)
        return out

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            resident = set()
            for name, port in self._engines().values():
                with contextlib.suppress(OSError, ValueError):
                    info = _get(f"http://127.0.0.1:{port}/server_info", timeout=2)
                    self.seen.add(name)
                    if info["resident"]["weights"]:
                        resident.add(name)
            if len(resident) > 1:
                self.overlaps.append(resident)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return support.make_tiny_model(tmp_path_factory.mktemp("serve-defer") / "model")


@contextlib.contextmanager
def serve(config: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], support.Lines]]:
    with open(config.with_suffix(".stderr"), "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relax_core", "serve", str(config), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    assert proc.stdout is not None
    lines = support.Lines(proc.stdout)
    try:
        yield proc, lines
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for pid in support.in_session(proc.pid) + support.mentioning(str(config.parent)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()


@pytest.mark.ray
@pytest.mark.slow
def test_serve_on_a_defer_layout_starts_phase_by_phase_and_reports_deferred_roles_asleep(
    model_dir: Path,
) -> None:
    config = model_dir.parent / "defer-job.toml"
    config.write_text(JOB.format(model=model_dir))
    args = ("--log-dir", str(model_dir.parent / "logs"), "--refresh", "0.5")
    residency = Residency(model_dir)
    residency.start()
    with serve(config, *args) as (proc, out):
        try:
            out.wait_for(r"relax serve: ready", timeout=300)
        finally:
            residency.stop()
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
        # No two roles' engines ever held their weights at once, while it started.
        assert residency.seen == {"judge", "math", "policy"}
        assert residency.overlaps == [], residency.overlaps[:3]

        for row in (
            r"policy/replica-0\s+READY",
            r"judge/replica-0\s+SLEEPING",
            r"math/replica-0\s+SLEEPING",
        ):
            out.wait_for(row, timeout=30)
        table = str(out)
        engines = {
            m.group(1): (m.group(2), m.group(3))
            for m in re.finditer(r"(\w+)/replica-0\s+(\w+)\s+gen 1\s+(http://[\d.:]+)", table)
        }
        assert {k: v[0] for k, v in engines.items()} == {
            "policy": "READY", "judge": "SLEEPING", "math": "SLEEPING",
        }  # fmt: skip
        for name, (_, url) in engines.items():
            memory = _get(f"{url}/server_info")["memory"]
            held = memory["resident_param_bytes"]
            if name == "policy":
                assert held == memory["param_bytes"] > 0
            else:
                assert held == 0 and memory["cpu_backup_bytes"] == memory["param_bytes"]

        # A request to a sleeping role is refused without a promise nothing would keep (relax
        # serve wakes no deferred role: no Retry-After, and the answer says what to do), and
        # does not wake it.
        genrm = out.wait_for(r"genrm\s+gateway\s+(http://[\d.:]+)/genrm/", timeout=5).group(1)
        req = urllib.request.Request(
            f"{genrm}/genrm/generate",
            data=json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": 1}}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=30)
        assert refused.value.code == 503 and refused.value.headers["Retry-After"] is None
        message = json.loads(refused.value.read())["error"]["message"]
        assert "SLEEPING and nothing will wake it" in message
        assert "leave the role out of placement.defer_roles" in message
        assert _get(f"{engines['judge'][1]}/server_info")["resident"]["weights"] is False

        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0, out.rest(10)
        assert out.rest(10).endswith("nothing left running")
    wait_for(lambda: not support.mentioning(str(model_dir)), timeout=30, what="every engine gone")
