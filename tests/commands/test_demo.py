"""``relax demo`` (relax-hf's command, the README's main job: ``relax run`` on the embedded
default job) as a user runs it — its tiny models made, the job up, steps committed and printed
one line each with the progress of every phase before it — then Ctrl-C to its process group, as
a terminal sends it: a clean stop with nothing left running.

The embedded job is the CPU example file (checked here), so ``tests/run/test_run_cli.py``'s run
of ``relax run docs/examples/run-cpu.toml`` covers the demo's steps to their end.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from relax_hf import DEMO_JOB

from relax_core.run.progress import PHASE_LINE_SECONDS
from relax_core.testing import wait_for
from tests.support import serve as support

ROOT = Path(__file__).resolve().parents[2]


def test_the_embedded_job_is_the_cpu_example_file() -> None:
    assert (ROOT / "docs" / "examples" / "run-cpu.toml").read_text() == DEMO_JOB
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "demo", "--print-job"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout == DEMO_JOB


@pytest.mark.ray
@pytest.mark.slow
def test_demo_prints_each_step_then_ctrl_c_stops_it_with_nothing_left_running() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "relax_core", "demo", "--steps", "6"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    out = support.Lines(proc.stdout)
    root = ""
    try:
        root = out.wait_for(r"engine logs in (/\S+)/logs$", timeout=120).group(1)
        step1 = out.wait_for(r"^step 1  train_1  16 samples  reward ", timeout=300)
        os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C, as a terminal sends it
        code = proc.wait(timeout=180)
        text = out.rest(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        for pid in support.in_session(proc.pid) + (support.mentioning(root) if root else []):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert code == 130, text
    # It made its models, started the job phase by phase, and printed each committed step in
    # one line after the progress of its phases.
    assert "making three tiny models: policy, judge, math" in text
    for line in (
        r"starting genrm\.judge \(deferred, put to sleep once started\)",
        r"genrm\.judge: SLEEPING",
        r"starting rollout\.policy \(awake\)",
        r"trainer ready",
    ):
        assert re.search(line, text), (line, text)
    step0 = text.index("\nstep 0  train_0  16 samples")
    # A progress line for each phase that took real time (the judge's, seconds), none for
    # the others: the step's line counts them.
    lines = re.findall(r"^  · step 0 (\S+) ([\d.]+)s$", text[: step0 + 1], re.M)
    assert "genrm" in dict(lines) and all(float(s) >= PHASE_LINE_SECONDS for _, s in lines)
    assert re.search(r"\+ \d+ phases < 0\.05s\)$", text[step0:].splitlines()[1]), text
    assert re.search(r"weights 1 ", step1.string), step1.string
    # Ctrl-C: the step in flight stopped, then a clean stop, nothing left (its Ray, its
    # engines, its router), not a traceback on the way.
    assert "relax run: interrupted; shutting down" in text
    assert re.search(r"^relax run: 2 of 6 steps committed, interrupted in step 2; ", text, re.M)
    assert "Traceback" not in text and not re.search(r"FAILED$", text, re.M), text
    # The job runtime's teardown lines, the same relax serve prints.
    assert re.search(r"engines stopped \(3 processes\)$", text, re.M), text
    assert re.search(r"routers stopped \(1\)$", text, re.M), text
    assert "relax run: stopped; nothing left running" in text
    wait_for(lambda: not support.in_session(proc.pid), timeout=30, what="the demo's Ray gone")
    assert support.mentioning(root) == []
