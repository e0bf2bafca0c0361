"""docs/plugins.md's "An environment plugin", executed as written: its distribution built from
the doc's own files and installed, its own test run, ``relax plugins`` listing it, and its job
in ``relax run`` with no change to the core: committed samples are multi-turn trajectories
whose hint tokens, and only those, carry loss mask 0."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import docs
from tests.support import run as support

TEXT = docs.section("plugins.md", "An environment plugin")
JOB = "job.toml"


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    return docs.install(TEXT, tmp_path_factory.mktemp("environment-doc"), skip=(JOB,))


def test_the_section_shows_a_distribution_its_test_and_a_job() -> None:
    assert set(docs.files(TEXT)) == {
        "pyproject.toml", "relax_second_chance/__init__.py", "tests/test_second_chance.py", JOB,
    }  # fmt: skip


def test_the_distribution_s_own_test_passes(installed: tuple[Path, Path]) -> None:
    docs.own_tests_pass(*installed)


def test_relax_plugins_lists_the_environment(installed: tuple[Path, Path]) -> None:
    row = docs.plugins_row(installed[1], "second-chance")
    assert row[:3] == ["environments", "second-chance", "relax-second-chance"]


@pytest.mark.ray
@pytest.mark.slow
def test_its_job_runs_and_commits_trajectories(
    installed: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, site = installed
    command = docs.job_command(TEXT, tmp_path, JOB)
    dumps = command[command.index("--dump-samples") + 1]
    monkeypatch.setenv("PYTHONPATH", docs.pythonpath(site))
    with support.relax_run(
        tmp_path / JOB, "--steps", "1", "--json", "--dump-samples", str(tmp_path / dumps)
    ) as run:
        assert run.wait(timeout=400) == 0, f"{run.out}\n{run.err}"
        rows = [row for row in run.json_rows() if "event" not in row]
    step, summary = rows
    assert summary["steps_committed"] == 1 and step["samples"] == 4
    (batch,) = (tmp_path / dumps).glob("batch-*.jsonl")
    two = 0
    for line in batch.read_text().splitlines():
        sample = json.loads(line)
        t = sample["metadata"]["trajectory"]
        assert t["environment"] == "second-chance" and t["turns"] in (1, 2)
        mask = sample["loss_mask"]
        policy = {i for a, b in t["turn_spans"] for i in range(a, b)}
        assert [i for i, m in enumerate(mask) if m] == sorted(policy)
        if t["turns"] == 2:
            two += 1
            assert t["messages"][2] == {"role": "user", "content": "Not quite. Try again."}
            a, b = t["turn_spans"][0][1], t["turn_spans"][1][0]
            assert b > a and set(mask[a:b]) == {0}  # the hint, between the turns
        assert sample["fields"]["reward"] == sum(r for r in t["turn_rewards"] if r is not None)
    assert two >= 1
