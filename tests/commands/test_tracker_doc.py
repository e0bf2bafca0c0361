"""docs/plugins.md's "A tracker plugin" as written: the distribution built from the doc's own
files and installed, ``relax plugins`` listing it through real entry-point discovery, and the
``[run]`` table the section shows opening it beside the core's tensorboard tracker, which then
writes every step's metrics to the file the section promises."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.support import docs

TEXT = docs.section("plugins.md", "A tracker plugin")

#: In a process of its own (the installed plugin on its PYTHONPATH): the section's [run] table
#: checked and its trackers opened as relax run opens them, fed two steps, closed.
FEED = """
import sys
from relax_core import PluginManager, loads_config
from relax_core.run.config import parse_run_config
from relax_core.tracking import PhaseSpan, Trackers, tracker_problems

run_dir, table = sys.argv[1], sys.argv[2]
job = '[roles.rollout.models.p]\\nbackend = "hf"\\nmodel_path = "/m"\\n' + table
job += '\\nrewards = [{ adapter = "digits" }]\\n'
pm = PluginManager.create()
run = parse_run_config(loads_config(job))
assert tracker_problems(run.trackers, pm) == [], tracker_problems(run.trackers, pm)
trackers = Trackers.open(run.trackers, pm, run_dir=run_dir, job="doc", say=print, strict=True)
trackers.log_config({"job": "doc"})
for step in range(2):
    trackers.log_span(PhaseSpan(step, "generate", 1.0, 0.5))
    trackers.log_metrics(step, {"reward/mean": 0.5 + step, "tokens": 64.0})
    trackers.log_samples(step, [{"id": f"s{step}"}])
trackers.close({"steps_committed": 2})
print("opened", trackers.names)
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return docs.install(TEXT, tmp_path_factory.mktemp("tracker-doc"))


def _env(site: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": docs.pythonpath(site)}


def test_the_section_shows_a_distribution_with_its_entry_point() -> None:
    files = docs.files(TEXT)
    assert set(files) == {"pyproject.toml", "relax_csv_tracker/__init__.py"}
    project = tomllib.loads(files["pyproject.toml"])["project"]
    assert project["entry-points"]["relax"] == {"csv-tracker": "relax_csv_tracker"}


def test_relax_plugins_lists_the_tracker(installed: tuple[Path, Path]) -> None:
    _, site = installed
    out = subprocess.run(
        [sys.executable, "-m", "relax_core", "plugins"],
        env=_env(site), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = [line.split() for line in out.stdout.splitlines() if "relax-csv-tracker" in line]
    assert row[:3] == ["trackers", "csv", "relax-csv-tracker"]


def test_the_run_table_opens_it_and_every_steps_metrics_reach_its_file(
    installed: tuple[Path, Path], tmp_path: Path
) -> None:
    _, site = installed
    (table,) = [b for b in docs.blocks(TEXT, "toml") if b.startswith("[run]")]
    out = subprocess.run(
        [sys.executable, "-c", FEED, str(tmp_path), table],
        env=_env(site), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert "opened ['csv', 'tensorboard']" in out.stdout
    with (tmp_path / "metrics.csv").open() as f:
        rows = list(csv.reader(f))
    assert rows == [
        ["step", "metric", "value"],
        ["0", "reward/mean", "0.5"],
        ["0", "tokens", "64.0"],
        ["1", "reward/mean", "1.5"],
        ["1", "tokens", "64.0"],
    ]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
