"""``[[run.stages]]`` in a real ``relax run``: two genrm models score one deferred step, each in
a lease of its own; a third-party role (the ``prm`` test plugin) scores every committed batch
through its own stage; an evaluation stage reports held-out rewards that are never committed;
every stage's field reaches the trainer's batch.

One run (tiny hf models on CPU, a defer layout on two declared GPUs — the planner places a
role's models side by side in its phase, so each judge has a bundle of its own —, the
``record-fields`` trainer of the test plugin, which reads each committed batch and reports its
fields) serves every test of the module.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest

from tests.support import run as support
from tests.support.jobs import colocated, defer, job_text, tiny, tiny_policy, tiny_run

JOB = job_text(
    # Each bundle reserves half a CPU, so the sync reward adapters' Ray tasks (one CPU each)
    # find one of the machine's two.
    **colocated(2, cpus_per_bundle=0.5),
    placement=defer("genrm", "prm"),
    models={
        "rollout.policy": tiny_policy(),
        "genrm.judge-a": tiny("judge"),
        "genrm.judge-b": tiny("judge"),
        "prm.steps": tiny("math"),
    },
    run=tiny_run(
        stages=[
            {
                "stage": "reward",
                "name": "judge-a",
                "role": "genrm",
                "models": ["judge-a"],
                "rewards": [{"adapter": "genrm-judge", "key": "judge-a"}],
            },
            {
                "stage": "reward",
                "name": "judge-b",
                "role": "genrm",
                "models": ["judge-b"],
                "rewards": [
                    {"adapter": "genrm-judge", "key": "judge-b", "weight": 0.5},
                    {"adapter": "digits"},
                ],
            },
            {"stage": "prm", "role": "prm", "max_steps": 4},
            {
                # Held-out prompts whose rewards are known whatever the policy answers: the
                # test plugin's adapter gives 0.5 to a prompt marked constant (x 2), and no
                # answer matches a label that is not a number: each sample's reward is 1.0.
                "stage": "eval",
                "dataset": "held-out.jsonl",
                "every": 1,
                "prompts": 3,
                "rewards": [
                    {"adapter": "constant-or-checksum", "weight": 2.0},
                    {"adapter": "exact-match"},
                ],
            },
        ]
    ),
)


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = support.make_models(tmp_path_factory.mktemp("stages"))
    job = root / "job.toml"
    job.write_text(JOB)
    (root / "held-out.jsonl").write_text(
        "".join(
            json.dumps({"prompt": f"What is {n} + {n}?", "label": "not a number",
                        "metadata": {"constant": True}}) + "\n"
            for n in range(3)
        )
    )  # fmt: skip
    dumps = root / "samples"
    with support.relax_run(job, "--json", "--dump-samples", str(dumps)) as run:
        code = run.wait(timeout=600)
        rows = run.json_rows()
        out = "\n".join(run.out.lines + run.err.lines)
        summary = rows[-1] if rows else None
        left = support.left_running(run, summary)
    assert code == 0, out
    assert left == [], left
    batches = {
        int(path.stem.split("-")[1]): [json.loads(line) for line in path.read_text().splitlines()]
        for path in dumps.glob("batch-*.jsonl")
    }
    yield {
        "steps": [r for r in rows if "step" in r and "event" not in r],
        "events": [r for r in rows if r.get("event") == "phase"],
        "batches": batches,
    }


@pytest.mark.ray
@pytest.mark.slow
def test_two_genrm_models_score_one_deferred_step_each_in_its_own_lease(
    ran: dict[str, Any],
) -> None:
    for step in ran["steps"]:
        n = step["step"]
        # Each judge stage took the genrm lease, in the listed order, and gave it back.
        order = [
            e["phase"]
            for e in ran["events"]
            if e["step"] == n
            and e["state"] == "begin"
            and e["phase"].startswith(("genrm", "judge"))
        ]
        assert order == [
            "genrm.onload", "judge-a", "genrm.offload", "genrm.onload", "judge-b", "genrm.offload",
        ], order  # fmt: skip
        assert step["stages"]["judge-a"]["judge-a.scored"] == 4
        assert step["stages"]["judge-b"]["judge-b.scored"] == 4
    for samples in ran["batches"].values():
        for s in samples:
            rewards = s["fields"]["rewards"]
            assert set(rewards) == {"judge-a", "judge-b", "digits"}
            expected = rewards["judge-a"] + 0.5 * rewards["judge-b"] + rewards["digits"]
            assert s["fields"]["reward"] == pytest.approx(expected)


@pytest.mark.ray
@pytest.mark.slow
def test_the_prm_role_scores_every_step_of_every_committed_sample(ran: dict[str, Any]) -> None:
    from relax_prm.stage import steps_of

    assert sorted(ran["batches"]) == [0, 1]
    for samples in ran["batches"].values():
        assert len(samples) == 4
        for s in samples:
            scores = s["fields"]["prm_scores"]
            assert len(scores) == len(steps_of(s["response"], 4))
            assert all(0.0 < v <= 1.0 for v in scores)
    assert all(step["stages"]["prm"]["samples"] == 4 for step in ran["steps"])


@pytest.mark.ray
@pytest.mark.slow
def test_every_stage_field_reaches_the_trainers_batch(ran: dict[str, Any]) -> None:
    for step in ran["steps"]:
        assert step["train"]["fields"] == ["prm_scores", "reward", "rewards"]
        assert step["fields"] == {"prm_scores": 4, "reward": 4, "rewards": 4}


@pytest.mark.ray
@pytest.mark.slow
def test_an_eval_stage_reports_held_out_rewards_it_never_commits(ran: dict[str, Any]) -> None:
    for step in ran["steps"]:
        report = step["stages"]["eval"]
        assert report["samples"] == 3 and report["scored"] == 3
        # The weighted sum of the eval's own adapters over its own samples, exactly.
        assert report["reward_mean"] == 1.0 and report["reward_std"] == 0.0, report
        assert step["samples"] == 4 and step["generated_groups"] == 3
    # The eval stage generated with the policy of its step: rollout's lease taken back once.
    onloads = [e for e in ran["events"] if e["phase"] == "rollout.onload" and e["state"] == "begin"]
    assert [e["step"] for e in onloads] == [0, 1, 1]
    # Only the step's own groups were committed; the eval's (b{n}-p2 … p4) never were.
    for n, samples in ran["batches"].items():
        assert {s["group_id"] for s in samples} == {f"b{n}-p0", f"b{n}-p1"}
