"""``relax plan`` and ``relax bench placement``, run as real processes; the documented examples."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from relax_core.config import load_config
from relax_core.placement import plan_inference_placement
from tests.support import commands
from tests.support.jobs import job_text, sglang
from tests.support.roles import builtin_roles

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((ROOT / "docs" / "examples").glob("placement-*.toml"))


def relax(*args: str) -> subprocess.CompletedProcess[str]:
    return commands.relax(*args, cwd=ROOT)


def _bad(**judge: int) -> str:
    """A split job breaking five placement rules (``judge``: more keys of its judge)."""
    return job_text(
        cluster={"num_nodes": 1, "gpus_per_node": 8},
        training={"actor_gpus": 8, "colocate": True},
        placement={"mode": "split"},
        models={
            "rollout.policy": sglang("/models/policy", num_gpus=6, gpus_per_engine=4, tp=4),
            "genrm.judge": sglang(
                "/models/judge", num_gpus=2, gpus_per_engine=2, bundle_start=7, **judge
            ),
        },
    )


def test_relax_plan_prints_the_bundle_map_and_exits_zero() -> None:
    done = relax("plan", str(ROOT / "docs/examples/placement-split-8gpu.toml"))
    assert done.returncode == 0, done.stderr
    lines = [line.rstrip() for line in done.stdout.splitlines()]
    assert "bundle:  0 1 2 3 4 5 6 7" in lines
    assert "Rollout: R R R R . . . ." in lines
    assert "GenRM:   . . . . G G . ." in lines
    assert "Teacher: . . . . . . T T" in lines
    assert "memory per GPU (GiB):" in lines
    assert any(
        line.startswith("  genrm.judge [actor 4-5, resident]: 51.0 of 80 (ok)") for line in lines
    )


def test_relax_plan_json_lists_placements_and_memory() -> None:
    done = relax("plan", str(ROOT / "docs/examples/placement-defer-8gpu.toml"), "--json")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert (out["mode"], out["total_gpus"]) == ("defer", 8)
    rows = {(p["role"], p["model"]): p for p in out["placements"]}
    assert {
        k: (p["pool"], p["bundle_start"], p["num_gpus"], p["phase"]) for k, p in rows.items()
    } == {
        ("rollout", "policy"): ("actor", 0, 8, "generation"),
        ("genrm", "judge"): ("actor", 0, 8, "genrm"),
        ("teacher", "math"): ("actor", 0, 8, "teacher"),
    }
    assert rows["genrm", "judge"]["gpus_per_engine"] == 4
    assert {m["status"] for m in out["memory"]} == {"skipped"}


def test_relax_plan_prints_every_violation_on_stderr_and_exits_two(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(_bad(tp=3))
    done = relax("plan", str(path))
    assert done.returncode == 2 and done.stdout == ""
    assert "rejected: 5 problem(s)" in done.stderr
    for expected in (
        "roles.rollout.models.policy.num_gpus: [divisibility]",
        "roles.genrm.models.judge.tp: [tp-pp]",
        "training.offload: [offload-required]",
        "roles.genrm.models.judge.bundle_start: [pool-bounds]",
        "roles.genrm.models.judge.bundle_start: [node-boundary]",
    ):
        assert expected in done.stderr


def test_relax_plan_reports_config_problems_with_their_key_paths(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text(_bad(tpp=3))
    done = relax("plan", str(path), "--json")
    assert done.returncode == 2
    assert "roles.genrm.models.judge.tpp: [unknown-key]" in done.stderr
    assert json.loads(done.stdout)["violations"][0]["path"] == "roles.genrm.models.judge.tpp"


def test_relax_plan_checks_the_run_table_as_relax_run_does(tmp_path: Path) -> None:
    # A plan that places fine, but a [run] table relax run would refuse: every problem at once.
    path = tmp_path / "job.toml"
    path.write_text(
        (ROOT / "docs/examples/placement-split-8gpu.toml").read_text()
        + "\n[run]\nsteps = 0\nstepz = 3\n"
    )
    done = relax("plan", str(path), "--json")
    assert done.returncode == 2, done.stdout
    paths = [row["path"] for row in json.loads(done.stdout)["violations"]]
    assert paths == ["run.stepz", "run.rewards", "run.steps"], paths
    assert "run.steps: [range] must be >= 1, got 0" in done.stderr


RUN_EXAMPLES = sorted((ROOT / "docs" / "examples").glob("run-*.toml"))


@pytest.mark.parametrize("example", RUN_EXAMPLES, ids=[p.name for p in RUN_EXAMPLES])
def test_relax_plan_accepts_every_documented_run_example_whole(example: Path) -> None:
    done = relax("plan", str(example))
    assert done.returncode == 0, done.stderr


def test_relax_plan_reads_a_relative_model_path_next_to_the_job_file(tmp_path: Path) -> None:
    # The budget reads the model's config.json: from the job file's directory, not the cwd.
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "hidden_size": 256,
                "intermediate_size": 512,
                "num_hidden_layers": 4,
                "num_attention_heads": 4,
                "num_key_value_heads": 2,
                "vocab_size": 1000,
                "torch_dtype": "bfloat16",
            }
        )
    )
    job = tmp_path / "job.toml"
    job.write_text(
        "[cluster]\nnum_nodes = 1\ngpus_per_node = 1\ngpu_memory_gib = 80\n"
        '[roles.rollout.models.policy]\nbackend = "sglang"\nmodel_path = "policy"\n'
        "num_gpus = 1\n"
    )
    done = relax("plan", str(job), "--json")  # run from the repository root, not tmp_path
    assert done.returncode == 0, done.stderr
    (memory,) = json.loads(done.stdout)["memory"]
    assert memory["status"] == "ok", memory
    assert memory["items"], memory


@pytest.mark.parametrize("example", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_every_documented_placement_example_is_accepted(example: Path) -> None:
    plan = plan_inference_placement(load_config(example), builtin_roles())
    assert plan.total_gpus <= plan.cluster_gpus


def test_planning_never_imports_ray() -> None:
    script = (
        "import sys\n"
        "from relax_core.config import load_config\n"
        "from relax_core.placement import plan_inference_placement\n"
        "from relax_core.plugins import PluginManager\n"
        "import relax_genrm, relax_rollout, relax_teacher\n"
        f"cfg = load_config({str(ROOT / 'docs/examples/placement-split-8gpu.toml')!r})\n"
        "roles = [('rollout', relax_rollout), ('genrm', relax_genrm), ('teacher', relax_teacher)]\n"
        "pm = PluginManager.create(entry_points=False, plugins=roles)\n"
        "before = set(sys.modules)\n"
        "plan_inference_placement(cfg, pm)\n"
        "print(sorted(m for m in set(sys.modules) - before if m.split('.')[0] == 'ray'))\n"
    )
    done = commands.python(script)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_relax_bench_placement_reports_time_budget_and_baseline_ratio() -> None:
    done = relax("bench", "placement", "--json", "--quick")
    assert done.returncode == 0, done.stderr
    out: dict[str, Any] = json.loads(done.stdout)
    assert (out["nodes"], out["gpus"], out["roles"], out["budget_ms"]) == (512, 4096, 3, 50.0)
    assert set(out["plan_ms"]) == {"split", "defer", "decoupled"}
    assert out["baseline_parse_ms"] > 0
    assert out["ratio_plan_to_parse"] == pytest.approx(
        out["plan_ms_worst"] / out["baseline_parse_ms"], rel=0.05
    )
    assert out["within_budget"] == (out["plan_ms_worst"] <= out["budget_ms"])
