"""Checks on a Ray cluster of their own (a ``ray.cluster_utils.Cluster`` cannot share a process
with the suite's local Ray): a test runs one as ``python -m tests.support.NAME`` from the
repository's root and reads the one JSON line it prints last; and the wait those checks share."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def check_command(name: str, *args: str) -> list[str]:
    """The command line of the check ``tests/support/NAME.py`` with ``args``."""
    return [sys.executable, "-m", f"tests.support.{name}", *args]


def run_check(name: str, timeout: float = 280) -> dict[str, Any]:
    """Run the check ``name`` to its end (exit status 0, asserted) and return what it saw."""
    proc = subprocess.run(
        check_command(name), cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def wait(predicate: Callable[[], object], timeout: float, every: float = 0.05) -> bool:
    """Poll ``predicate`` every ``every`` seconds until it holds (True) or ``timeout`` seconds
    have passed (False)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(every)
    return True
