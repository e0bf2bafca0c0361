"""Helpers of the ``relax run`` end-to-end tests: the CPU example job with its tiny models,
``relax run`` started as a user starts it (a session of its own, stdout and stderr read line by
line), and the check that nothing it started is left.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from relax_core.engine.process import SubprocessEngineProcess
from relax_core.testing import free_port
from tests.support import serve as support
from tests.support.jobs import toml_value

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "docs" / "examples" / "run-cpu.toml"
#: The same models in a split layout with asynchronous steps.
ASYNC_EXAMPLE = ROOT / "docs" / "examples" / "run-async-cpu.toml"
#: The example's models and their seeds (``tiny/<name>`` next to the job file).
MODELS = {"policy": 0, "judge": 1, "math": 2}


def make_models(directory: Path, size: str = "tiny") -> Path:
    """The example's three models under ``directory/tiny`` (``made_tiny_models``)."""
    models = {directory / "tiny" / name: (seed, size) for name, seed in MODELS.items()}
    support.made_tiny_models(models)
    return directory


def make_policy(directory: Path) -> Path:
    """One tiny policy, ``directory/tiny/policy`` (the model of the one-role jobs;
    ``made_tiny_models``)."""
    support.made_tiny_models({directory / "tiny" / "policy": (MODELS["policy"], "tiny")})
    return directory


def job_file(
    directory: Path, name: str = "job.toml", *, example: Path = EXAMPLE, **run: Any
) -> Path:
    """The example job (``example``: another example of the same models) in ``directory``
    (its models beside it), its ``[run]`` keys replaced or added from ``run`` (``None``:
    removed)."""
    text = example.read_text()
    head, _, table = text.partition("\n[run]\n")
    keys: dict[str, str] = {}
    current = None
    for line in table.splitlines():
        if line and not line.startswith((" ", "]", "#")) and "=" in line:
            current = line.split("=", 1)[0].strip()
            keys[current] = line
        elif current is not None:
            keys[current] += "\n" + line
    for key, value in run.items():
        if value is None:  # the key removed
            keys.pop(key, None)
            continue
        keys[key] = f"{key} = {toml_value(value)}"
    path = directory / name
    path.write_text(head + "\n[run]\n" + "\n".join(keys.values()) + "\n")
    return path


def start_run(config: Path, *args: str) -> subprocess.Popen[str]:
    """``python -m relax_core run CONFIG ARGS`` started in a session of its own (its Ray and
    engines in it), both streams piped."""
    return subprocess.Popen(
        [sys.executable, "-m", "relax_core", "run", str(config), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_run(proc: subprocess.Popen[str], directory: Path) -> None:
    """Whatever happened: the run's session and every process under its job's ``directory``
    (continued first, should one be stopped) are killed."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)
    for pid in support.in_session(proc.pid) + support.mentioning(str(directory)):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
            os.kill(pid, signal.SIGKILL)


def served_externally(job: Path, model: str, url: str) -> Path:
    """``job`` rewritten so that the model ``model`` (its ``[roles.R.models.<model>]`` table)
    is served by the engine at ``url`` (``external_urls``) instead of one the job starts."""
    lines, out, skipping = job.read_text().splitlines(), [], False
    for line in lines:
        if line.startswith("[roles.") and line.endswith(f".models.{model}]"):
            out += [line, f'external_urls = ["{url}"]']
            skipping = True
        elif skipping and (line.startswith("[") or not line.strip()):
            skipping = False
            out.append(line)
        elif not skipping:
            out.append(line)
    job.write_text("\n".join(out) + "\n")
    return job


def start_hf_engine(model_dir: Path, port: int | None = None) -> SubprocessEngineProcess:
    """A hf engine on loopback serving ``model_dir`` on CPU (one torch thread), started as
    someone else would start it (``relax-hf serve``), ready; on ``port`` (default: a free one).
    The caller kills it."""
    port = port or free_port()
    proc = SubprocessEngineProcess.start(
        [
            sys.executable, "-m", "relax_hf", "serve", "--model", str(model_dir),
            "--port", str(port), "--threads", "1",
        ],
        base_url=f"http://127.0.0.1:{port}",
        engine_id=f"external-{port}",
    )  # fmt: skip
    try:
        proc.wait_ready(180)
    except BaseException:
        proc.kill()
        raise
    return proc


class RunProcess:
    """``python -m relax_core run CONFIG ARGS`` in a session of its own, both streams read."""

    def __init__(self, config: Path, *args: str) -> None:
        self.config = config
        self.proc = start_run(config, *args)
        assert self.proc.stdout is not None and self.proc.stderr is not None
        self.out = support.Lines(self.proc.stdout)
        self.err = support.Lines(self.proc.stderr)

    def wait(self, timeout: float) -> int:
        """The exit status (the streams read to their end)."""
        code = self.proc.wait(timeout)
        self.out.rest(30)
        self.err.rest(30)
        return code

    def json_rows(self) -> list[dict[str, Any]]:
        """Every JSON object it printed on stdout."""
        return [json.loads(line) for line in self.out.lines if line.startswith("{")]

    def rows(self) -> list[dict[str, Any]]:
        """Its JSON objects on stdout but the progress events: step rows, failed steps, summary."""
        return [r for r in self.json_rows() if "event" not in r]

    def interrupt(self) -> None:
        """Ctrl-C, as a terminal sends it: SIGINT to the whole process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def kill_leftovers(self) -> None:
        """Whatever the test did: the run's session and every process under its directory."""
        kill_run(self.proc, self.config.parent)


@contextlib.contextmanager
def relax_run(config: Path, *args: str) -> Iterator[RunProcess]:
    """A :class:`RunProcess`; on the way out every process it left is killed."""
    run = RunProcess(config, *args)
    try:
        yield run
    finally:
        run.kill_leftovers()


def engine_pid(directory: Path, model: str) -> int:
    """The pid of the hf engine serving ``tiny/<model>`` under ``directory``."""
    path = str(directory / "tiny" / model)
    pids = [
        p
        for p in support.mentioning(path)
        if "relax_hf" in support.cmdline(p) and " serve " in support.cmdline(p)
    ]
    assert len(pids) == 1, (model, pids)
    return pids[0]


@dataclasses.dataclass
class KilledRun:
    """A ``relax run --json`` whose engine was killed mid-run (:func:`kill_engine_when`)."""

    run: RunProcess
    code: int
    rows: list[dict[str, Any]]
    left: list[int]
    killed: int


def kill_engine_when(root: Path, job: Path, line: str, model: str) -> KilledRun:
    """Run ``job`` with ``--json``; once stdout has a line matching ``line`` (within 300 s),
    SIGKILL the engine serving ``tiny/<model>`` under ``root``; wait for the run's end (400 s)
    and see what it left running."""
    with relax_run(job, "--json") as run:
        run.out.wait_for(line, timeout=300)
        killed = engine_pid(root, model)
        os.kill(killed, signal.SIGKILL)
        code = run.wait(timeout=400)
        rows = run.rows()
        left = left_running(run, rows[-1] if rows else None)
    return KilledRun(run, code, rows, left, killed)


def left_running(run: RunProcess, summary: Mapping[str, Any] | None) -> list[int]:
    """Processes of the run still alive: its session (Ray), its engines and routers."""
    pids = set(support.in_session(run.proc.pid)) | set(support.mentioning(str(run.config.parent)))
    if summary is not None:
        pids |= {p for p in summary["engine_pids"] + summary["router_pids"] if support.alive(p)}
    return sorted(pids)
