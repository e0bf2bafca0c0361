"""``relax bench gateway`` without the router installed says what to install (and starts
nothing); the benchmark itself runs in ``nox -s bench``."""

from __future__ import annotations

import subprocess
import sys


def test_bench_gateway_without_the_router_says_what_to_install() -> None:
    # The router package made unimportable in a child process, as in an environment that
    # never installed it (uninstalling it here would break the other tests).
    script = (
        "import sys; sys.modules['sglang_router'] = None\n"
        "from relax_core.cli import main\n"
        "sys.exit(main(['bench', 'gateway', '--json']))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "sglang-router" in done.stderr and "pip install" in done.stderr
    assert "exited with code" not in done.stderr and done.stdout == ""
