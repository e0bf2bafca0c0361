"""The project's commands run as a user runs them, in a process of their own, output captured:
``relax ARGS`` (the console script's module) and ``python -c SCRIPT`` (what a fresh interpreter
imports or prints)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path


def relax(
    *args: str,
    cwd: Path | None = None,
    site: Path | None = None,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """``relax ARGS`` (``python -m relax_core``), with ``env`` over this process's environment
    and ``site`` (a directory distributions were installed into) first on ``PYTHONPATH``."""
    environ = {**os.environ, **(env or {})}
    if site is not None:
        environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(site), environ.get("PYTHONPATH")) if p
        )
    return subprocess.run(
        [sys.executable, "-m", "relax_core", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        env=environ,
    )


def python(script: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``python -c SCRIPT`` in a fresh interpreter of this environment."""
    return subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout
    )
