"""``relax report``: the residency lanes drawn from a run's lease spans, the weight pushes and
each step's staleness beside them, the page written from a run directory (its charts inline
SVG, the data embedded, a few kilobytes), and a directory without a run refused.
The page of a real run, opened in a browser, is tests/run/test_tracking_run.py's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

from relax_report.data import pushes, residency_lanes, staleness
from relax_report.report import report_data, write_report

CONFIG = {
    "job": "j",
    "slices": {"rollout": "actor:0-0", "genrm": "actor:0-0", "cpu-role": "cpu-role:own"},
    "residency": {"slices": {"actor:0-0": {"demand": {"rollout": {"0": 2.0}, "genrm": None}}}},
}


def _span(step: int, name: str, start: float, seconds: float, lane: str = "leases") -> Any:
    return {"type": "span", "step": step, "name": name, "start": start, "seconds": seconds,
            "lane": lane, "failed": False, "interrupted": False}  # fmt: skip


SPANS = [
    _span(0, "generate", 100.0, 1.0, lane="batch"),
    _span(1, "weight_push", 104.5, 0.25, lane="push"),
    _span(0, "train", 104.5, 0.5, lane="trainer"),
    _span(0, "rollout.offload", 101.0, 0.5),
    _span(0, "genrm.onload", 101.5, 0.5),
    _span(0, "genrm.offload", 104.0, 0.5),
    _span(1, "rollout.onload", 105.0, 0.5),
]


def test_a_lane_per_role_of_each_shared_slice_holds_it_between_its_switches() -> None:
    summary = {"switching": {"switches": [
        {"step": 0, "role": "genrm", "direction": "onload", "weight_bytes": 7, "kv_cache_bytes": 3},
    ]}}  # fmt: skip
    lanes = residency_lanes(CONFIG, SPANS, summary)
    got = [(s["role"], s["kind"], s["start"], s["end"]) for s in lanes]
    assert got == [
        ("genrm", "onload", 1.5, 2.0),
        ("genrm", "held", 2.0, 4.0),
        ("genrm", "offload", 4.0, 4.5),
        # rollout's first switch is an offload: it held the slice from the run's start
        ("rollout", "held", 0.0, 1.0),
        ("rollout", "offload", 1.0, 1.5),
        ("rollout", "onload", 5.0, 5.5),
        ("rollout", "held", 5.5, 5.5),
    ]
    assert {s["slice"] for s in lanes} == {"actor:0-0"}  # a slice of one role has no lane
    assert (lanes[0]["weight_bytes"], lanes[0]["kv_cache_bytes"]) == (7, 3)
    assert lanes[2]["weight_bytes"] is None  # not measured
    assert lanes[3]["planned_gib"] == 2.0 and lanes[0]["planned_gib"] is None


def _run_dir(path: Path) -> Path:
    rows = [{"type": "config", "config": CONFIG}, *SPANS]
    for step in range(2):
        rows.append({"type": "metrics", "step": step,
                     "metrics": {"reward/mean": 0.1 * step, "time/genrm": 1.0,
                                 "async/staleness/0": 2}})  # fmt: skip
        rows.append({"type": "samples", "step": step,
                     "samples": [{"id": f"s{step}", "prompt": "</script><b>x</b>"}]})  # fmt: skip
    rows.append({"type": "close", "summary": None})
    path.mkdir()
    (path / "run.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_the_weight_pushes_and_each_trained_steps_staleness_have_lanes_of_their_own() -> None:
    metrics = {
        0: {"async/staleness/0": 3, "async/staleness/1": 1},
        1: {"async/staleness/0": 4},  # step 1 has no train span: left out
    }
    assert pushes(SPANS) == [
        {"step": 1, "start": 4.5, "end": 4.75, "seconds": 0.25, "failed": False}
    ]
    assert staleness(metrics, SPANS) == [
        {"step": 0, "start": 4.5, "end": 5.0, "histogram": {"0": 3, "1": 1}, "max": 1}
    ]


def test_the_page_draws_svg_embeds_the_data_and_stays_small(tmp_path: Path) -> None:
    run_dir = _run_dir(tmp_path / "run")
    data = report_data(str(run_dir))
    assert data["series"]["reward/mean"] == [0.0, 0.1] and data["phases"] == {"genrm": [1.0, 1.0]}
    page = Path(write_report(str(run_dir))).read_text()
    assert "<script src=" not in page and "<link" not in page  # nothing to fetch
    # rewards, phases, residency: what the data has; each trace a group of the chart's SVG
    charts = re.findall(r'data-chart="([a-z-]+)" data-traces="(\d+)"', page)
    assert charts == [("rewards", "1"), ("phases", "1"), ("residency", "4")]
    residency = page.split('data-chart="residency"')[1]
    lanes = re.findall(r'<g class="trace" data-name="([^"]+)"', residency)
    assert lanes == ["actor:0-0 · genrm", "actor:0-0 · rollout", "weight pushes", "staleness"]
    assert len(page.encode()) < 50_000
    start = page.index('id="relax-report-data">') + len('id="relax-report-data">')
    embedded = json.loads(page[start : page.index("</script>", start)])
    assert embedded["series"] == data["series"]
    # A sample's text is escaped in the table and cannot end the data's script early.
    assert "&lt;/script&gt;&lt;b&gt;x&lt;/b&gt;" in page
    assert embedded["samples"][0]["prompt"] == "</script><b>x</b>"


def _relax(*args: str) -> subprocess.CompletedProcess[str]:
    """``relax ARGS`` as a user runs it: the command comes from the installed plugin."""
    relax = Path(sys.executable).with_name("relax")
    return subprocess.run([str(relax), *args], capture_output=True, text=True, timeout=300)


def test_relax_report_writes_the_page_and_refuses_a_directory_without_a_run(
    tmp_path: Path,
) -> None:
    run_dir = _run_dir(tmp_path / "run")
    done = _relax("report", str(run_dir), "-o", str(tmp_path / "page.html"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == str(tmp_path / "page.html")
    assert "<svg" in (tmp_path / "page.html").read_text()
    done = _relax("report", str(tmp_path))
    assert done.returncode == 2 and "no run.jsonl" in done.stderr
