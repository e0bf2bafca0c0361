"""Trackers, the report and the metrics port on one real ``relax run``: the CPU example's three
steps (three tiny hf models on CPU, a defer layout on one declared GPU) with ``trackers =
["tensorboard", "jsonl", wandb (offline), mlflow (a file store in the run directory), the test
plugin's ``raises`` (it raises at step 1)]``, ``--report``, ``--measure``, ``--trace``,
``--dump-samples`` and ``--metrics-port``, run once for the module.

The run itself as a user runs it: three committed steps with every field, the weight version
moving, every committed sample in exactly one batch, the trace, the switch measurement, nothing
left running.

Every tracker is read back with its own library's reader and must hold every committed step's
numbers as the step's JSON line gives them; the tracker that raised is reported once and the run
goes on; the report page stays under 1.5 MB, opens in a real headless chromium, draws every
chart with no console error, and embeds the JSON lines' numbers; the metrics port, scraped while
step 1 runs, serves the phase histograms.
"""

from __future__ import annotations

import itertools
import json
import math
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from relax_report.report import CHARTS

from relax_core.testing import free_port
from tests.support import browser
from tests.support import run as support
from tests.support.wandb_log import offline_run

pytestmark = [pytest.mark.ray, pytest.mark.slow]

TRACKERS = [
    "tensorboard",
    "jsonl",
    {"tracker": "wandb", "mode": "offline", "project": "relax-test"},
    "mlflow",
    {"tracker": "raises", "step": 1},
]


class Run:
    """What the module's run left: its exit status, stdout's JSON rows, stderr, its run
    directory and the metrics page scraped while step 1 ran."""

    def __init__(
        self, code: int, rows: list[dict[str, Any]], err: str, run_dir: Path, scraped: str
    ):
        self.code, self.rows, self.err, self.run_dir, self.scraped = (
            code,
            rows,
            err,
            run_dir,
            scraped,
        )
        self.trace = run_dir.parent / "run.trace.json"
        self.steps = [r for r in rows if "event" not in r and "step" in r and "summary" not in r]
        self.summary = next(r for r in rows if r.get("summary"))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    root = support.make_models(tmp_path_factory.mktemp("tracking-run"))
    job = support.job_file(root, trackers=TRACKERS)
    run_dir, port = root / "run", free_port()
    args = ("--json", "--measure", "--report", "--run-dir", str(run_dir))
    args += ("--trace", str(root / "run.trace.json"), "--dump-samples", str(root / "samples"))
    with support.relax_run(job, *args, "--metrics-port", str(port)) as proc:
        proc.out.wait_for(r'"event": "phase", "step": 1, "phase": "genrm", "state": "begin"', 300)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
            scraped = answer.read().decode()
        code = proc.wait(timeout=300)
        left = support.left_running(proc, next(r for r in proc.json_rows() if r.get("summary")))
        assert left == [], left
        return Run(code, proc.json_rows(), "\n".join(proc.err.lines), run_dir, scraped)


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-6)


def _expected(row: dict[str, Any]) -> dict[str, float]:
    """What every tracker must hold for a step: a few of its numbers, as its JSON line has
    them."""
    out = {
        "reward/mean": row["reward_mean"],
        "reward/std": row["reward_std"],
        "teacher/kl": row["teacher_kl"],
        "tokens": row["tokens"],
        "response_length/mean": row["tokens"] / row["samples"],
        "parse_failures": row["parse_failures"],
        "time/genrm": row["phases"]["genrm"],
        "train/loss": row["train"]["loss"],
    }
    out.update({f"reward/{k}": v for k, v in row["reward_by_key"].items()})
    return out


def test_the_run_commits_its_steps_though_one_tracker_raised(run: Run) -> None:
    assert run.code == 0, run.err
    assert [r["step"] for r in run.steps] == [0, 1, 2] and run.summary["steps_committed"] == 3
    # Reported once, naming the tracker and the step; the run went on without it.
    lines = [line for line in run.err.splitlines() if "tracker 'raises'" in line]
    assert len(lines) == 1, lines
    assert "failed in log_metrics (step 1): RuntimeError" in lines[0]
    assert "the run goes on without it" in lines[0]
    heard = (run.run_dir / "raises.log").read_text().splitlines()
    assert "metrics 1" in heard and "metrics 2" not in heard and heard[-1] == "close"


def test_the_engine_logs_are_kept_in_the_run_directory(run: Run) -> None:
    logs = sorted(p.name for p in (run.run_dir / "engine-logs").rglob("*.log"))
    # One log per engine of the job's three roles, beside the run's other records.
    assert any(name.startswith("policy") for name in logs), logs
    assert any(name.startswith("judge") for name in logs), logs


def test_tensorboard_event_files_hold_every_steps_metrics(run: Run) -> None:
    from tensorboard.backend.event_processing import event_accumulator as ea

    acc = ea.EventAccumulator(
        str(run.run_dir / "tensorboard"), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0}
    )
    acc.Reload()
    for row in run.steps:
        for tag, value in _expected(row).items():
            found = {e.step: e.value for e in acc.Scalars(tag)}
            # TensorBoard keeps a scalar as a 32-bit float.
            assert math.isclose(found[row["step"]], value, rel_tol=1e-5, abs_tol=1e-6), tag
    assert {t.step for t in acc.Tensors("samples")} == {0, 1, 2}


def test_the_wandb_offline_run_holds_every_steps_metrics(run: Run) -> None:
    logged = offline_run(str(run.run_dir / "wandb"))
    for row in run.steps:
        history = logged["history"][row["step"]]
        for key, value in _expected(row).items():
            assert _close(history[key], value), key
        assert history["samples/_type"] == "table-file"
    assert logged["exit_code"] == 0 and logged["run"].display_name == run.summary["job"]
    assert logged["config"]["run"]["steps"] == 3


def test_the_mlflow_file_store_holds_every_steps_metrics(
    run: Run, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's file store, read back
    client = MlflowClient(tracking_uri=(run.run_dir / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("relax")
    assert experiment is not None
    (found,) = client.search_runs([experiment.experiment_id])
    assert found.info.status == "FINISHED" and found.info.run_name == run.summary["job"]
    assert found.data.params["run.steps"] == "3"
    for key in _expected(run.steps[0]):
        history = {m.step: m.value for m in client.get_metric_history(found.info.run_id, key)}
        for row in run.steps:
            assert _close(history[row["step"]], _expected(row)[key]), key


def test_the_metrics_port_served_the_phase_histograms_mid_run(run: Run) -> None:
    text = run.scraped
    # Step 0 had committed by then, step 1 was judging: its phases are counted, by name.
    assert 'relax_deferred_phase_seconds_count{phase="genrm"}' in text
    assert 'relax_deferred_phase_seconds_bucket{le="1.0",phase="generate"}' in text
    assert "relax_run_steps_committed_total 1.0" in text


def _page_data(path: Path) -> dict[str, Any]:
    text = path.read_text()
    start = text.index('<script type="application/json" id="relax-report-data">')
    body = text[text.index(">", start) + 1 : text.index("</script>", start)]
    data: dict[str, Any] = json.loads(body)
    return data


def test_the_reports_data_is_the_runs_json_lines(run: Run) -> None:
    data = _page_data(run.run_dir / "report.html")
    assert data["steps"] == [0, 1, 2]
    for i, row in enumerate(run.steps):
        for key, value in _expected(row).items():
            if key.startswith("time/"):
                assert _close(data["phases"][key[5:]][i], value), key
            else:
                assert _close(data["series"][key][i], value), key
    # The residency lanes: the one shared slice, each role's every measured switch with its
    # bytes (the summary's switching report), and the roles holding it in turn.
    switches = [s for s in data["lanes"] if s["kind"] != "held"]
    measured = run.summary["switching"]["switches"]
    assert sorted((s["step"], s["role"], s["kind"]) for s in switches) == sorted(
        (s["step"], s["role"], s["direction"]) for s in measured
    )
    assert all(s["weight_bytes"] > 0 for s in switches)
    held = sorted((s["start"], s["end"], s["role"]) for s in data["lanes"] if s["kind"] == "held")
    assert {r for *_, r in held} == {"rollout", "genrm", "teacher"}
    assert all(a[1] <= b[0] + 1e-6 for a, b in itertools.pairwise(held)), held
    assert len(data["samples"]) == 3 * 4 and {s["step"] for s in data["samples"]} == {0, 1, 2}
    # Beside them, the weight pushes and what each step trained on, of which staleness.
    assert data["pushes"] and all(p["end"] >= p["start"] >= 0 for p in data["pushes"])
    assert [(s["step"], s["histogram"]) for s in data["staleness"]] == [
        (r["step"], r["async"]["staleness"]) for r in run.steps
    ]


def test_the_report_of_the_cpu_example_stays_under_one_and_a_half_megabytes(run: Run) -> None:
    assert (run.run_dir / "report.html").stat().st_size <= 1_500_000


@pytest.mark.skipif(
    browser.chromium() is None,
    reason="chromium is not installed: Debian's package (apt-get install chromium; .ci/run "
    "installs it) — playwright's own browser download is not a package registry's",
)
def test_the_report_renders_every_chart_in_a_real_browser_with_no_console_error(
    run: Run,
) -> None:
    seen = browser.open_page(
        run.run_dir / "report.html",
        """() => ({
          charts: [...document.querySelectorAll('div.chart')].map(d => ({
            name: d.dataset.chart,
            traces: Number(d.dataset.traces),
            // each trace or lane laid out by the browser, with a size on the page
            drawn: [...d.querySelectorAll('svg.chart-svg g.trace')].filter(g => {
              const box = g.getBBox(); return box.width > 0 && box.height > 0;
            }).length,
          })),
          rows: document.querySelectorAll('#samples tbody tr').length,
        })""",
    )
    assert seen["console_errors"] == [] and seen["page_errors"] == []
    assert seen["requests"] == []  # self-contained: nothing fetched
    charts = {c["name"]: c for c in seen["value"]["charts"]}
    # Every chart but the rollout's (a single-turn run reports nothing per sample).
    assert tuple(charts) == tuple(c for c in CHARTS if c != "trajectories")
    assert all(c["traces"] > 0 and c["drawn"] == c["traces"] for c in charts.values()), charts
    assert seen["value"]["rows"] == 12


def _committed(directory: Path) -> dict[int, list[dict[str, Any]]]:
    return {
        int(p.stem.split("-")[1]): [json.loads(line) for line in p.read_text().splitlines()]
        for p in sorted(directory.glob("batch-*.jsonl"))
    }


def _check_hops(s: dict[str, Any]) -> None:
    """A switch's hops: every one the run reports, each inside the one around it (1 ms given
    where the engine's clock meets the worker's)."""
    hops = s["hops"]
    deferred = s["role"] != "rollout"  # the coordinator switches it (rollout switches itself)
    inside = ["manager", "publish_begin", "heads", "publish_wait", "publish", "worker"]
    worker = ["drain", "engine_calls"] if s["direction"] == "offload" else ["engine_calls"]
    checks = ["generation_check", "generation_check_step"] if s["direction"] == "onload" else []
    engine = ["engine_op", "engine", *checks]
    outer = ["switch"] + (["coordinator"] if deferred else [])
    assert list(hops) == [*outer, *inside, *worker, *engine], hops
    assert hops["switch"] == s["seconds"] and hops["worker"] == s["worker_seconds"]
    chain = [*outer, "manager", "heads", "worker", "engine_calls"]
    assert all(hops[a] >= hops[b] > 0 for a, b in itertools.pairwise(chain)), hops
    check = hops.get("generation_check", 0.0)
    assert hops["engine_calls"] + 1e-3 >= hops["engine_op"] + check, hops
    assert check >= hops.get("generation_check_step", 0.0), hops
    assert hops["engine_op"] >= hops["engine"] > 0, hops
    assert hops["manager"] >= hops["heads"] + hops["publish_wait"] + hops["publish"], hops


def test_the_cpu_example_commits_three_scored_steps_moves_the_weights_and_leaves_nothing(
    run: Run,
) -> None:
    assert run.code == 0, run.err
    steps, summary, dumps, trace = run.steps, run.summary, run.run_dir.parent / "samples", run.trace

    # One object per committed step with the fields a user reads, then the summary.
    assert [r["step"] for r in steps] == [0, 1, 2] and [r["batch_id"] for r in steps] == [0, 1, 2]
    for r in steps:
        assert r["samples"] == 16 and r["groups"] == 4 and r["partition"] == f"train_{r['step']}"
        assert r["fields"] == dict.fromkeys(
            ("reward", "rewards", "teacher_logprobs", "teacher_topk_ids", "teacher_topk_logprobs"),
            16,
        )
        assert set(r["stages"]) == {"genrm", "teacher"} and r["dropped"]["groups"] == 0
        assert set(r["phases"]) >= {
            "generate", "rollout.offload", "genrm.onload", "genrm", "genrm.offload",
            "teacher.onload", "teacher", "teacher.offload", "sink_put", "commit", "train",
        }  # fmt: skip
        assert r["train"]["samples"] == 16 and r["train"]["optimizer_steps"] == r["step"] + 1
        # The trainer's policy is the engine's: its log-probs of the sampled tokens match.
        assert abs(r["train"]["ratio_mean"] - 1.0) < 1e-3, r["train"]
        assert r["teacher_kl"] is not None and r["parse_failures"] is not None
    assert summary["summary"] is True and summary["steps_committed"] == 3
    # Each step generated with the weights pushed after the one before it, and the last
    # step's weights were pushed too: the rollout weight version moved three times.
    assert summary["weight_versions"] == ["default", "1", "2", "3"]
    assert [r["weight_version"] for r in steps] == ["default", "1", "2"]
    assert all(r["pushed_before"]["weight_version"] == str(r["step"]) for r in steps[1:])

    # Every committed sample, read back from the finalizer's dumps: its reward and teacher
    # fields, in exactly one committed batch (counted by id).
    batches = _committed(dumps)
    assert sorted(batches) == [0, 1, 2]
    ids = [s["id"] for samples in batches.values() for s in samples]
    assert len(ids) == len(set(ids)) == 48
    for n, samples in batches.items():
        assert {s["weight_version"] for s in samples} == {steps[n]["weight_version"]}
        for s in samples:
            fields = s["fields"]
            assert isinstance(fields["reward"], float) and set(fields["rewards"]) == {
                "genrm-judge", "exact-match", "digits",
            }  # fmt: skip
            tokens = len(s["response_ids"])
            assert tokens >= 1 and len(s["rollout_logprobs"]) == tokens
            assert [len(row) for row in fields["teacher_topk_ids"]] == [4] * tokens
            assert len(fields["teacher_logprobs"]) == tokens

    # The Perfetto trace: every phase of every batch.
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert {e["args"]["batch"] for e in events} == {0, 1, 2}
    assert {e["name"] for e in events} >= {"generate", "weight_push", "genrm", "teacher", "commit"}

    # --measure: each of the 6 switches of a step (3 roles in, 3 out; step 0's rollout starts
    # awake) against a copy of its bytes measured in the same run; rollout's offloads free what
    # it held; the judge and the teacher keep their weights (offload_weights = false in the
    # example) and release, then resume, only their KV cache (and graphs).
    switching = summary["switching"]
    assert len(switching["switches"]) == 5 + 6 + 6
    for s in switching["switches"]:
        assert s["weight_bytes"] > 0 and s["copy_seconds"] > 0 and s["seconds"] > 0
        keeps = s["role"] != "rollout"
        if s["direction"] == "offload" and keeps:
            assert s["held_after"] == s["weight_bytes"] and s["freed_bytes"] > 0, s
        elif s["direction"] == "offload":
            assert s["freed_fraction"] >= 0.9, s
        # The engines' own share, from their memory log: a release or a resume per switch.
        ops = {op["op"] for op in s["engine_ops"]}
        assert ops == ({"release"} if s["direction"] == "offload" else {"resume"}), s
        moved = {tag for op in s["engine_ops"] for tag in op["detail"]} & {"weights", "kv_cache"}
        assert moved == ({"kv_cache"} if keeps else {"weights", "kv_cache"}), s
        assert 0 < s["engine_seconds"] <= s["seconds"], s
        assert s["engine_seconds"] <= s["worker_seconds"] <= s["manager_seconds"], s
        _check_hops(s)
    assert 0 < switching["share_of_step"] < 1
    # Each switch's start places it in the trace: rollout's onload for a step runs beside the
    # trainer's step on the batch before (share_of_step counts it all the same).
    train = {e["args"]["batch"]: (e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
             for e in events if e["name"] == "train"}  # fmt: skip
    onloads = [s for s in switching["switches"] if (s["role"], s["direction"]) ==
               ("rollout", "onload")]  # fmt: skip
    assert [s["step"] for s in onloads] == [1, 2]
    for s in onloads:
        began, ended = train[s["step"] - 1]
        assert began < s["started"] < ended, (s["started"], began, ended)
