"""docs/plugins.md's walkthrough, "Your first plugin: a reward adapter", executed as written.

The walkthrough's own code blocks are extracted — the files it shows (each block starting with a
``# <path>`` comment), its ``pip install``, its console session of ``relax rewards try`` and its
job file — and the package is built and installed into a directory of this test
(``tests.support.docs.install``), which the ``relax`` subprocesses find on ``PYTHONPATH`` through
real entry-point discovery.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest

from relax_core.config import loads_config
from relax_core.plugins import PluginManager
from relax_core.records import RewardSpec
from relax_core.run.config import parse_run_config
from tests.support import commands, docs
from tests.support import run as support

JOB = "job.toml"


def _walkthrough() -> str:
    return docs.section("plugins.md", "Your first plugin: a reward adapter")


def _blocks(lang: str) -> list[str]:
    """The walkthrough's fenced blocks of language ``lang``, in order."""
    return docs.blocks(_walkthrough(), lang)


def _files() -> dict[str, str]:
    """Every file the walkthrough shows: path (its block's ``# path`` first line) -> text."""
    return docs.files(_walkthrough())


def _commands(program: str) -> list[list[str]]:
    """The walkthrough's ``bash`` lines that run ``program``, split as the shell splits them."""
    return docs.commands(_walkthrough(), program)


def _relax(*args: str, site: Path) -> subprocess.CompletedProcess[str]:
    """``relax ARGS`` (the console script's module) with ``site`` first on ``PYTHONPATH``."""
    return commands.relax(*args, site=site)


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The walkthrough's distribution, written from the doc and installed as it says
    (``pip install ./DIR``) into a directory of its own."""
    return docs.install(_walkthrough(), tmp_path_factory.mktemp("walkthrough"), skip=(JOB,))[1]


def _project() -> dict[str, Any]:
    """The walkthrough's ``[project]`` table."""
    project: dict[str, Any] = tomllib.loads(_files()["pyproject.toml"])["project"]
    return project


def _adapter_name() -> str:
    """The adapter the walkthrough tries (``relax rewards try NAME``)."""
    (session,) = _blocks("console")
    names = {shlex.split(line)[4] for line in session.splitlines() if line.startswith("$ ")}
    (name,) = names
    return name


def _adapter(site: Path) -> RewardSpec:
    """The walkthrough's record, registered by its installed module, loaded from ``site``
    without putting it on sys.path."""
    (package,) = _project()["entry-points"]["relax"].values()
    spec = importlib.util.spec_from_file_location(
        f"walkthrough_{package}", site / package / "__init__.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    pm = PluginManager.create(entry_points=False, builtins=False, plugins=[("doc", module)])
    return pm.reward_adapter(_adapter_name())


def test_the_walkthrough_shows_a_pyproject_a_module_and_a_job_file() -> None:
    files = _files()
    assert set(files) == {"pyproject.toml", "relax_contains_answer/__init__.py", JOB}
    assert "build-backend" in tomllib.loads(files["pyproject.toml"])["build-system"]


def test_the_installed_walkthrough_plugin_is_listed_with_its_distribution(site: Path) -> None:
    out = _relax("plugins", "--json", site=site)
    assert out.returncode == 0, out.stderr
    rows = {(r["kind"], r["name"]): r for r in json.loads(out.stdout)["records"]}
    row = rows[("reward_adapters", _adapter_name())]
    assert row["distribution"] == _project()["name"]
    # Its entry point names the plugin (RELAX_DISABLE_PLUGINS takes that name).
    assert row["plugin"] in _project()["entry-points"]["relax"]  # type: ignore[operator]


def test_the_walkthrough_console_session_prints_what_the_doc_shows(site: Path) -> None:
    (session,) = _blocks("console")
    runs: list[tuple[list[str], list[str]]] = []
    for line in session.splitlines():
        if line.startswith("$ "):
            runs.append((shlex.split(line[2:]), []))
        else:
            runs[-1][1].append(line)
    assert len(runs) == 2
    for command, shown in runs:
        assert command[:3] == ["relax", "rewards", "try"]
        out = _relax(*command[1:], site=site)
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == shown, command


def test_the_walkthrough_adapter_scores_a_prompt_without_a_label_as_it_says(site: Path) -> None:
    spec = _adapter(site)
    assert spec.fn("It is 12.", None) == 0.0
    assert spec.supports_deferred and spec.mode == "sync"


def test_the_walkthrough_job_lists_the_adapter_in_its_run_table() -> None:
    job = _files()[JOB]
    (stage,) = parse_run_config(loads_config(job)).stages
    rewards = stage.options["rewards"]
    assert (stage.kind, rewards) == ("reward", [{"adapter": _adapter_name(), "weight": 1.0}])
    # The inline form the walkthrough gives as an equivalent says the same.
    (inline,) = re.findall(r"`(rewards = \[.*?\])` inside `\[run\]`", _walkthrough())
    head, _, tables = job.partition("\n[[run.rewards]]\n")
    (same,) = parse_run_config(loads_config(f"{head}{inline}\n")).stages
    assert same.options["rewards"] == rewards
    assert "adapter" in tables


@pytest.mark.ray
@pytest.mark.slow
def test_the_walkthrough_job_runs_a_step_rewarded_by_the_adapter(
    site: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    docs.write_job(_walkthrough(), tmp_path, JOB)
    (run_command,) = _commands("relax run")
    assert run_command == ["relax", "run", JOB]
    # relax run's driver, its Ray and the Ray workers that run the sync adapter all import it.
    monkeypatch.setenv("PYTHONPATH", docs.pythonpath(site))
    dumps = tmp_path / "samples"
    job = tmp_path / JOB
    with support.relax_run(job, "--steps", "1", "--json", "--dump-samples", str(dumps)) as run:
        assert run.wait(timeout=400) == 0, f"{run.out}\n{run.err}"
        rows = [row for row in run.json_rows() if "event" not in row]  # progress events aside
    *steps, summary = rows
    assert summary["steps_committed"] == 1 and len(steps) == 1
    (batch,) = dumps.glob("batch-*.jsonl")
    samples = [json.loads(line) for line in batch.read_text().splitlines()]
    assert len(samples) == steps[0]["samples"] == 16
    # Every sample was scored by the adapter, with what it returns for that response and label.
    fn = _adapter(site).fn
    for sample in samples:
        assert sample["fields"]["rewards"] == {
            _adapter_name(): fn(sample["response"], sample["label"])
        }
