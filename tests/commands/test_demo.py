"""``relax demo`` (the README's main job) run as a user runs it, end to end: three tiny hf
models made on CPU, three roles served on a new local Ray, one answer per role through the
gateways, a clean shutdown with nothing left running."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys

import pytest

from relax_core.testing import wait_for
from tests.support import serve as support

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _engine_pids(out: str) -> list[int]:
    """The engine pids in the demo's status table."""
    return [int(p) for p in re.findall(r"replica-0\s+READY .* pid (\d+)$", out, re.M)]


def test_demo_answers_once_per_role_and_leaves_nothing_running() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "relax_core", "demo"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    out = err = ""
    try:
        out, err = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise
    finally:
        # Whatever happened: its Ray (its session) and the engines it reported are ended.
        engines = [p for p in _engine_pids(out) if "relax_hf" in support.cmdline(p)]
        for pid in support.in_session(proc.pid) + engines:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 0, out + err

    # What it started: a line per model, every engine READY, a gateway per role.
    for model in ("rollout.policy", "genrm.judge", "teacher.math"):
        assert re.search(rf"^  {model}: hf on cpu, 1 engine", out, re.M), out
        assert re.search(rf"\] {model}: READY$", out, re.M), out
    gateways = re.findall(r"^  (rollout|genrm|teacher)\s+http://127\.0\.0\.1:\d+/\1/$", out, re.M)
    assert sorted(gateways) == ["genrm", "rollout", "teacher"], out
    # The three answers, each through its gateway.
    assert re.search(r"rollout  POST /rollout/generate .*\n\s+→ (['\"]).*\1  \(8 tokens", out), out
    assert re.search(r"genrm    POST /genrm/generate .*→ model judge\n\s+→ response ['\"]", out), (
        out
    )
    match = re.search(r"→ input log-probs \[([-\w., ]+)\]; top-2 at the first scored .*\[\(", out)
    assert match and len(match.group(1).split(",")) == 4, out  # 5 ids from position 1
    # A clean shutdown: every engine it reported stopped, nothing left.
    engine_pids = _engine_pids(out)
    assert len(engine_pids) == 3, out
    assert "engines stopped (3 processes)" in out and "local Ray stopped" in out
    # Rollout on its default route: through its router, stopped with the rest.
    assert re.search(r"^  rollout\.policy: hf on cpu, .* route SGLANG_ROUTER \(", out, re.M), out
    assert re.search(
        r"policy\s+READY\s+SGLANG_ROUTER .* router http://127\.0\.0\.1:\d+$", out, re.M
    )
    assert "routers stopped (1)" in out
    assert re.search(r"relax demo: done in \d+s \(models .*\); nothing left running$", out)
    assert not any(support.alive(p) for p in engine_pids)
    wait_for(lambda: not support.in_session(proc.pid), timeout=30, what="demo's Ray gone")
