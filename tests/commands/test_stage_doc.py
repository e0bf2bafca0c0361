"""docs/plugins.md's "A stage plugin", executed as written: its distribution built from the
doc's own files and installed, its own test run, ``relax plugins`` listing it, and one step of
its job in ``relax run``: the stage's field is on every committed sample and reaches the
trainer's batch, with no change to the core."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import docs
from tests.support import run as support

TEXT = docs.section("plugins.md", "A stage plugin")
JOB = "job.toml"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return docs.install(TEXT, tmp_path_factory.mktemp("stage-doc"), skip=(JOB,))


def test_the_section_shows_a_distribution_its_test_and_a_job() -> None:
    assert set(docs.files(TEXT)) == {
        "pyproject.toml", "relax_length_penalty/__init__.py", "tests/test_length_penalty.py", JOB,
    }  # fmt: skip


def test_the_distribution_s_own_test_passes(installed: tuple[Path, Path]) -> None:
    docs.own_tests_pass(*installed)


def test_relax_plugins_lists_the_stage_kind(installed: tuple[Path, Path]) -> None:
    row = docs.plugins_row(installed[1], "length-penalty")
    assert row[:3] == ["stages", "length-penalty", "relax-length-penalty"]


@pytest.mark.ray
@pytest.mark.slow
def test_its_job_runs_and_the_field_reaches_the_trainers_batch(
    installed: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, site = installed
    docs.job_command(TEXT, tmp_path, JOB)
    monkeypatch.setenv("PYTHONPATH", docs.pythonpath(site))
    dumps = tmp_path / "samples"
    with support.relax_run(
        tmp_path / JOB, "--steps", "1", "--json", "--dump-samples", str(dumps)
    ) as run:
        assert run.wait(timeout=400) == 0, f"{run.out}\n{run.err}"
        rows = [row for row in run.json_rows() if "event" not in row]
    step, summary = rows
    assert summary["steps_committed"] == 1
    assert "length_penalty" in step["train"]["fields"]
    assert step["fields"]["length_penalty"] == step["samples"] == 16
    assert step["stages"]["length-penalty"] == {"samples": 16}
    (batch,) = dumps.glob("batch-*.jsonl")
    for line in batch.read_text().splitlines():
        sample = json.loads(line)
        expected = -0.02 * len(sample["response_ids"])
        assert sample["fields"]["length_penalty"] == pytest.approx(expected)
