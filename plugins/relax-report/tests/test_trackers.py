"""The plugin's two trackers written and read back (TensorBoard's own reader for the event
files, the jsonl lines, the report the jsonl tracker writes as it closes with its ``report``
option), registered through the real entry point."""

from __future__ import annotations

import json
import os
from pathlib import Path

from relax_report import JSONL, REPORT, TENSORBOARD
from relax_report.jsonl import JsonlTracker
from relax_report.tensorboard import TensorBoardTracker
from relax_report.tfevents import EventWriter, crc32c

from relax_core import PhaseSpan, PluginManager, TrackerContext


def test_the_installed_plugin_registers_both_trackers_and_relax_report(
    plugin_manager: PluginManager,
) -> None:
    registered = plugin_manager.registered("trackers")
    assert {n: registered[n].distribution for n in ("jsonl", "tensorboard")} == {
        "jsonl": "relax-report",
        "tensorboard": "relax-report",
    }
    assert registered["jsonl"].record is JSONL and registered["tensorboard"].record is TENSORBOARD
    assert plugin_manager.command("report") is REPORT


def test_the_core_registers_no_tracker(core_plugin_manager: PluginManager) -> None:
    assert dict(core_plugin_manager.registered("trackers")) == {}


def test_the_tensorboard_trackers_files_are_read_by_tensorboards_own_reader(
    tmp_path: Path,
) -> None:
    from tensorboard.backend.event_processing import event_accumulator as ea

    tracker = TensorBoardTracker(TrackerContext("tensorboard", str(tmp_path), "j"))
    tracker.log_config({"job": "j", "run": {"steps": 2}})
    for step in range(2):
        tracker.log_metrics(step, {"reward/mean": 0.25 * step, "time/genrm": 1.5 + step})
        tracker.log_samples(step, [{"id": f"s{step}", "prompt": "2 + 2 |", "response": "4"}])
    tracker.close(None)
    acc = ea.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [(0, 0.0), (1, 0.25)]
    assert [(e.step, e.value) for e in acc.Scalars("time/genrm")] == [(0, 1.5), (1, 2.5)]
    (text,) = [t for t in acc.Tensors("samples") if t.step == 1]
    assert "| s1 |" in text.tensor_proto.string_val[0].decode()
    assert '"steps": 2' in acc.Tensors("config")[0].tensor_proto.string_val[0].decode()


def test_the_event_files_frames_carry_crc32c() -> None:
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    assert crc32c(b"") == 0


def test_an_event_writer_is_closed_once(tmp_path: Path) -> None:
    writer = EventWriter(str(tmp_path))
    writer.scalars(0, {"x": 1.0})
    writer.close()
    writer.close()
    assert Path(writer.path).stat().st_size > 0


def test_the_jsonl_tracker_writes_every_call_as_a_line(tmp_path: Path) -> None:
    tracker = JsonlTracker(TrackerContext("jsonl", str(tmp_path), "j"))
    tracker.log_config({"job": "j"})
    tracker.log_span(PhaseSpan(0, "genrm.onload", 10.0, 0.25, lane="leases"))
    tracker.log_metrics(0, {"reward/mean": 0.5})
    tracker.log_samples(0, [{"id": "s0", "reward": float("nan")}])
    tracker.close({"summary": True})
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["type"] for r in rows] == ["config", "span", "metrics", "samples", "close"]
    assert rows[1]["lane"] == "leases" and rows[1]["seconds"] == 0.25
    assert rows[2]["metrics"] == {"reward/mean": 0.5}
    assert rows[3]["samples"] == [{"id": "s0", "reward": None}]  # JSON has no NaN


def test_the_jsonl_tracker_with_its_report_option_writes_the_page_as_it_closes(
    tmp_path: Path,
) -> None:
    tracker = JsonlTracker(TrackerContext("jsonl", str(tmp_path), "j", {"report": True}))
    tracker.log_config({"job": "j"})
    tracker.log_metrics(0, {"reward/mean": 0.5})
    assert not (tmp_path / "report.html").exists()
    tracker.close({"summary": True})
    page = (tmp_path / "report.html").read_text()
    assert 'id="relax-report-data"' in page


def test_a_resumed_tensorboard_tracker_continues_the_same_run_without_the_killed_steps(
    tmp_path: Path,
) -> None:
    from tensorboard.backend.event_processing import event_accumulator as ea

    killed = TensorBoardTracker(TrackerContext("tensorboard", str(tmp_path), "j"))
    killed.log_config({"job": "j"})
    for step in range(4):  # steps 0-1 checkpointed; 2-3 logged, then the run was killed
        killed.log_metrics(step, {"reward/mean": float(step)})
    killed.writer.close()
    context = TrackerContext(
        "tensorboard", str(tmp_path), "j", resume_step=2, resume_id=killed.run_id
    )
    resumed = TensorBoardTracker(context)
    resumed.log_config({"job": "j"})
    for step in range(2, 5):
        resumed.log_metrics(step, {"reward/mean": 10.0 + step})
    resumed.close(None)
    assert resumed.run_id == killed.run_id == "tensorboard"
    assert len(os.listdir(tmp_path / "tensorboard")) == 2  # one folder: one run
    acc = ea.EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={ea.TENSORS: 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("reward/mean")] == [
        (0, 0.0),
        (1, 1.0),
        (2, 12.0),
        (3, 13.0),
        (4, 14.0),
    ]
    assert len(acc.Tensors("config")) == 1


def test_a_resumed_jsonl_tracker_keeps_one_header_and_drops_the_killed_runs_later_steps(
    tmp_path: Path,
) -> None:
    killed = JsonlTracker(TrackerContext("jsonl", str(tmp_path), "j"))
    killed.log_config({"job": "j"})
    for step in range(3):  # steps 0-1 checkpointed; step 2 logged, then the run was killed
        killed.log_span(PhaseSpan(step, "generate", 10.0, 0.25))
        killed.log_metrics(step, {"reward/mean": float(step)})
    killed._file.close()
    with open(tmp_path / "run.jsonl", "a") as f:
        f.write('{"type": "span", "st')  # a line the kill cut short
    context = TrackerContext("jsonl", str(tmp_path), "j", resume_step=2, resume_id=killed.run_id)
    resumed = JsonlTracker(context)
    resumed.log_config({"job": "j"})
    for step in (2, 3):
        resumed.log_metrics(step, {"reward/mean": 10.0 + step})
    resumed.close({"summary": True})
    rows = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()]
    assert [r["type"] for r in rows].count("config") == 1
    assert rows[0]["run_id"] == killed.run_id == resumed.run_id
    assert [(r["step"], r["metrics"]["reward/mean"]) for r in rows if r["type"] == "metrics"] == [
        (0, 0.0),
        (1, 1.0),
        (2, 12.0),
        (3, 13.0),
    ]
    assert [r["type"] for r in rows][-1] == "close"
    assert {"type": "resume", "step": 2, "run_id": killed.run_id}.items() <= next(
        r for r in rows if r["type"] == "resume"
    ).items()
