"""The run's preflight asks each generation engine's backend for the features the job needs:
``docs/examples/run-agent-cpu.toml`` (a guided first turn: constrained decoding) on an install
without xgrammar is refused before Ray starts, at the option's key path, naming the extra to
install; with xgrammar the same job plans."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import run as support

EXAMPLE = support.ROOT / "docs" / "examples" / "run-agent-cpu.toml"

# One machine has one install: xgrammar cannot be uninstalled for one test, so the child
# process is made unable to find it (a mock of the install without the extra: None in
# sys.modules is what importlib's find_spec and import both read as "not there").
WITHOUT_XGRAMMAR = (
    "import runpy, sys; sys.modules['xgrammar'] = None; "
    "sys.argv = ['relax', *sys.argv[1:]]; runpy.run_module('relax_core', run_name='__main__')"
)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The example beside a tiny model of its own (relative model paths are the job file's)."""
    directory = tmp_path_factory.mktemp("agent-features")
    support.make_policy(directory)
    shutil.copy(EXAMPLE, directory / EXAMPLE.name)
    return directory / EXAMPLE.name


def _relax(*args: str, without_xgrammar: bool) -> subprocess.CompletedProcess[str]:
    head = ["-c", WITHOUT_XGRAMMAR] if without_xgrammar else ["-m", "relax_core"]
    return subprocess.run(
        [sys.executable, *head, *args], capture_output=True, text=True, timeout=300
    )


def test_without_xgrammar_the_agent_example_is_refused_before_ray_naming_the_extra(
    job: Path,
) -> None:
    done = _relax("run", str(job), "--steps", "1", without_xgrammar=True)
    out = done.stdout + done.stderr
    assert done.returncode == 2, out
    (line,) = [x.strip() for x in out.splitlines() if "[engine-feature]" in x]
    assert line.startswith("run.generation.env.guided_first_turn: [engine-feature]"), line
    assert "roles.rollout.models.policy" in line and "pip install 'relax-hf[grammar]'" in line
    assert "starting a new local Ray" not in out
    planned = _relax("plan", str(job), without_xgrammar=True)
    assert planned.returncode == 2 and "relax-hf[grammar]" in planned.stderr, planned.stderr


def test_with_xgrammar_the_agent_example_plans(job: Path) -> None:
    pytest.importorskip("xgrammar", reason="this install has no relax-hf[grammar]")
    done = _relax("plan", str(job), without_xgrammar=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[engine-feature]" not in done.stdout + done.stderr


def test_a_job_without_a_guided_turn_needs_no_grammar(job: Path) -> None:
    unguided = job.with_name("unguided.toml")
    unguided.write_text(job.read_text().replace("guided_first_turn = true", ""))
    done = _relax("plan", str(unguided), without_xgrammar=True)
    assert done.returncode == 0, done.stdout + done.stderr
