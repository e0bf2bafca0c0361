"""The README's pip route, for real: ``python3 -m nox -s install_route`` (not part of ``tests``).

In a new temporary directory: a fresh virtual environment, then the README's own pip-route
line run as written (``python3 -m venv .venv && . .venv/bin/activate && python3 -m pip install
-r requirements-local.txt && relax demo``, from the repository root, the venv placed in the
temp directory), then the agent example of the README (``relax run
docs/examples/run-agent-cpu.toml --steps 2 --json``). Each phase's wall time is printed and
written as JSON (``--json FILE``): the install, the demo, the agent example.

The agent example's guided first turn needs constrained decoding, which the pip route does not
install (``relax-hf[grammar]``): it must either run (the extra is there) or be refused before
Ray starts naming the extra (exit 2); anything else fails this check.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _readme_line() -> list[list[str]]:
    text = (ROOT / "README.md").read_text()
    (line,) = [ln for ln in text.splitlines() if "pip install -r requirements-local.txt" in ln]
    return [shlex.split(part) for part in line.split("&&")]


def _timed(what: str, argv: list[str], env: dict[str, str], times: dict[str, float]) -> str:
    print(f"install_route: {what}: {shlex.join(argv)}", flush=True)
    began = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    times[what] = round(time.monotonic() - began, 1)
    print(f"install_route: {what}: exit {done.returncode} in {times[what]} s", flush=True)
    if what != "agent example" and done.returncode != 0:
        sys.exit(f"install_route: {what} failed:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}")
    return f"{done.returncode}\n{done.stdout}\n{done.stderr}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="write the phases' times here")
    args = parser.parse_args(argv)
    commands = _readme_line()
    assert commands[0][:3] == ["python3", "-m", "venv"], commands
    assert commands[-1] == ["relax", "demo"], commands
    times: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="relax-install-route-") as tmp:
        venv = Path(tmp) / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
        env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        python = str(venv / "bin" / "python3")
        # The README's commands after the venv and its activation, each as written.
        for command in commands[2:]:
            if command[0] == "python3":
                command = [python, *command[1:]]
            what = "install" if "install" in command else "demo"
            _timed(what, command, env, times)
        out = _timed(
            "agent example",
            [str(venv / "bin" / "relax"), "run", "docs/examples/run-agent-cpu.toml", "--steps",
             "2", "--json"],
            env,
            times,
        )  # fmt: skip
        code = int(out.split("\n", 1)[0])
        if code == 2:
            assert "relax-hf[grammar]" in out, out[-4000:]
            assert "starting a new local Ray" not in out, out[-4000:]
            times["agent example refused"] = 1.0
        else:
            assert code == 0, out[-4000:]
    print("install_route: " + json.dumps(times), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(times, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
