"""A role of ``relax run`` served by an engine the run does not start (``external_urls``): a
big teacher or judge already served elsewhere.

For real: the teacher's tiny hf engine is started by the test itself on a free loopback port,
as its owner would, and given to the job as the teacher's ``external_urls``; the run starts
the other engines, a new local Ray, the trainer. Its prefills go through the same client as any
other role's; it is never started, stopped nor sent weights. The refusals (an external model
for the role whose weights the trainer pushes, or one of a role taking turns on shared GPUs)
are checked before anything starts.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest

from relax_core.config import load_config
from relax_core.jobs import resolve_model_paths
from relax_core.plugins import PluginManager
from relax_core.run.config import parse_run_config
from relax_core.run.job import run_problems
from tests.support import run as support


def _weight_version(url: str) -> str:
    with urllib.request.urlopen(url + "/model_info", timeout=30) as resp:
        return str(json.loads(resp.read())["weight_version"])


# The contract is covered in the default session by tests/integration/test_external_engines.py
# (external heads published, probed, failed and back; never started, stopped nor sent weights)
# and the checks below; this is the whole CLI run with a real external teacher.
@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)  # an engine more than the run's own, started first
def test_a_teacher_served_by_external_urls_prefills_every_step_and_is_never_stopped_nor_pushed(
    root: Path, models: Path
) -> None:
    # The engine's model path is the session's directory, not the job's: nothing the run's
    # cleanup looks for (processes naming the job's directory) is this engine.
    engine = support.start_hf_engine(models / "tiny" / "math")
    try:
        url = str(engine.base_url)
        job = support.job_file(
            root, example=support.ASYNC_EXAMPLE, steps=2, prompts_per_step=2, samples_per_prompt=2,
            max_new_tokens=4,
        )  # fmt: skip
        support.served_externally(job, "math", url)
        with support.relax_run(job, "--json") as run:
            code = run.wait(timeout=600)
            rows = run.rows()
            left = support.left_running(run, rows[-1] if rows else None)
        assert code == 0, f"{run.out}\n{run.err}"
        assert left == []
        summary = rows[-1]
        steps = [r for r in rows if "reward_mean" in r]
        assert [r["step"] for r in steps] == [0, 1] and summary["steps_committed"] == 2
        # Every sample got the teacher's top-k from the external engine (the run started only
        # rollout's and genrm's: two engine processes).
        assert all(r["fields"]["teacher_topk_logprobs"] == 4 for r in steps), steps
        assert all(r["stages"]["teacher"]["requests"] == 4 for r in steps)
        assert len(summary["engine_pids"]) == 2
        assert f"teacher.math: external engines at {url}: not started" in str(run.err)
        # The trainer pushed weights to rollout only: the external engine keeps its own.
        assert summary["weight_versions"] == ["default", "1", "2"]
        assert engine.poll() is None, "the run stopped an engine it did not start"
        assert _weight_version(url) == "default"
    finally:
        engine.kill()


def _example(tmp_path: Path, text: str) -> list[str]:
    for name in ("policy", "judge", "math"):
        d = tmp_path / "tiny" / name
        d.mkdir(parents=True, exist_ok=True)
        for f in ("config.json", "tokenizer.json"):
            (d / f).write_text("{}")
    (tmp_path / "job.toml").write_text(text)
    config = resolve_model_paths(load_config(tmp_path / "job.toml"))
    return run_problems(config, parse_run_config(config), PluginManager.create())


def test_a_generation_model_served_by_external_urls_is_refused_naming_its_key(
    tmp_path: Path,
) -> None:
    job = support.job_file(tmp_path, example=support.ASYNC_EXAMPLE)
    support.served_externally(job, "policy", "http://127.0.0.1:9")
    joined = "\n".join(_example(tmp_path, job.read_text()))
    assert (
        "roles.rollout.models.policy.external_urls: [external] the rollout role generates the "
        "batch, and the trainer pushes its weights to those engines after every step"
    ) in joined


def test_an_external_model_of_a_role_taking_turns_on_shared_gpus_is_refused(
    tmp_path: Path,
) -> None:
    job = support.job_file(tmp_path)  # the defer layout: genrm and teacher take turns
    support.served_externally(job, "math", "http://127.0.0.1:9")
    joined = "\n".join(_example(tmp_path, job.read_text()))
    assert (
        "roles.teacher.models.math.external_urls: [external] role 'teacher' takes turns on "
        "shared GPUs (placement.defer_roles)"
    ) in joined


def test_an_external_teacher_of_a_split_layout_passes_every_check(tmp_path: Path) -> None:
    job = support.job_file(tmp_path, example=support.ASYNC_EXAMPLE)
    support.served_externally(job, "math", "http://127.0.0.1:9")
    assert _example(tmp_path, job.read_text()) == []
