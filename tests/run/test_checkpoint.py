"""Checkpoints of ``relax run`` (``relax_core.run.checkpoint``) without engines: what one holds,
that a failed write keeps the previous one, the errors of a run directory that cannot be
resumed, the prompt source replayed to a checkpoint's position, and the one step driver started
at a checkpoint's step (the simulated job of ``test_one_driver``). ``test_resume_cli`` kills and
resumes a real run."""

from __future__ import annotations

import asyncio
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest
from relax_bench._steps_sim import SimJudge, SimRollout, Times

from relax_core import CheckpointError
from relax_core.run.checkpoint import (
    FILE,
    Checkpointer,
    Cursor,
    job_settings,
    read_checkpoint,
    settings_problems,
)
from relax_core.run.config import RunConfig
from relax_core.run.data import ArithmeticSource
from relax_core.run.driver import Finished
from relax_core.run.loop import drive
from relax_core.run.progress import Printer
from tests.support.sim_job import sim_ports

TIMES = Times(generate_s=0.01, score_s=0.01, train_s=0.01, push_s=0.0, groups=2)


class SavingTrainer:
    """Writes its step count to the directory it is given; ``fail``: its save raises."""

    def __init__(self) -> None:
        self.steps = 0
        self.fail = False

    async def save(self, directory: str) -> dict[str, Any]:
        if self.fail:
            raise RuntimeError("the disk is full")
        Path(directory, "state.json").write_text(json.dumps({"steps": self.steps}))
        return {"optimizer_steps": self.steps}


def _checkpointer(run_dir: Path, trainer: SavingTrainer, **kw: Any) -> Checkpointer:
    cursor = Cursor(ArithmeticSource(0))
    settings = {"run.seed": 0}
    return Checkpointer(
        str(run_dir), every=2, steps=5, trainer=trainer, cursor=cursor, job="j",
        job_file="job.toml", settings=settings, run_ids=lambda: {"jsonl": "abc"}, **kw,
    )  # fmt: skip


def test_a_checkpoint_is_written_every_n_steps_and_after_the_last_holding_what_a_resume_needs(
    tmp_path: Path,
) -> None:
    trainer = SavingTrainer()
    checkpoints = _checkpointer(tmp_path, trainer)

    async def steps() -> None:
        for step in range(5):
            checkpoints.cursor.mark(step)
            checkpoints.cursor.take(4)
            trainer.steps += 1
            await checkpoints.finished(Finished(step, True, (), str(step + 1)))

    asyncio.run(steps())
    assert [c.step for c in checkpoints.written] == [2, 4, 5]
    latest = read_checkpoint(str(tmp_path))
    assert latest == checkpoints.written[-1]
    assert (latest.step, latest.cursor, latest.weight_version) == (5, 20, "5")
    assert latest.trainer == {"optimizer_steps": 5} and dict(latest.trackers) == {"jsonl": "abc"}
    state = tmp_path / latest.trainer_dir / "state.json"
    assert json.loads(state.read_text()) == {"steps": 5}
    # only the latest state is kept
    assert os.listdir(tmp_path / "checkpoints") == ["step-5"]


def test_a_checkpoint_of_a_step_not_yet_begun_has_the_cursor_of_now_and_of_one_begun_its_start(
    tmp_path: Path,
) -> None:
    cursor = Cursor(ArithmeticSource(0))
    cursor.mark(0)
    cursor.take(4)
    assert cursor.at(1) == 4
    cursor.mark(1)  # step 1 began (async: generated ahead) before step 0's checkpoint
    cursor.take(4)
    assert cursor.at(1) == 4 and cursor.at(2) == 8


def test_a_failed_save_keeps_the_previous_checkpoint_the_latest_and_says_so(
    tmp_path: Path,
) -> None:
    trainer = SavingTrainer()
    checkpoints = _checkpointer(tmp_path, trainer)
    asyncio.run(checkpoints.write(2))
    trainer.fail = True
    with pytest.raises(CheckpointError, match=r"step 4 could not be written .*the disk is full"):
        asyncio.run(checkpoints.write(4))
    assert read_checkpoint(str(tmp_path)).step == 2


def test_a_checkpoint_file_cut_short_by_a_kill_is_never_read_the_renamed_one_is(
    tmp_path: Path,
) -> None:
    asyncio.run(_checkpointer(tmp_path, SavingTrainer()).write(2))
    (tmp_path / f"{FILE}.tmp").write_text('{"step": 4, "cur')  # killed mid-write
    (tmp_path / "checkpoints" / "step-4.tmp").mkdir()
    assert read_checkpoint(str(tmp_path)).step == 2


def test_resuming_a_directory_without_a_checkpoint_says_why_and_what_to_do(
    tmp_path: Path,
) -> None:
    with pytest.raises(CheckpointError, match=r"no such directory; --resume takes"):
        read_checkpoint(str(tmp_path / "nowhere"))
    (tmp_path / "run.jsonl").write_text("")
    with pytest.raises(CheckpointError, match=r"holds no checkpoint \(checkpoint.json\)"):
        read_checkpoint(str(tmp_path))
    (tmp_path / FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match=r"checkpoint.json cannot be read"):
        read_checkpoint(str(tmp_path))


def test_a_job_that_changed_what_a_resume_keeps_is_named_key_by_key() -> None:
    before = job_settings(RunConfig(seed=0), generation_model="policy", model_path="/m")
    checkpoint = asyncio.run(_saved(before))
    later = RunConfig(seed=1, steps=9, request_timeout=5.0)  # steps and deadlines may change
    now = job_settings(later, generation_model="policy", model_path="/m")
    problems = settings_problems(checkpoint, now, run_dir="runs/a", job_file="job.toml")
    assert len(problems) == 1
    assert problems[0].startswith("run.seed: the run in runs/a had 0, job.toml now has 1;")


async def _saved(settings: dict[str, Any]) -> Any:
    from relax_core.run.checkpoint import Checkpoint

    return Checkpoint(step=1, steps=3, cursor=4, weight_version="1", trainer_dir="t",
                      settings=settings)  # fmt: skip


def test_a_source_replayed_to_a_cursor_hands_out_what_the_uninterrupted_one_did() -> None:
    uninterrupted = ArithmeticSource(7)
    uninterrupted.take(12)
    resumed = Cursor.resumed(ArithmeticSource(7), 12)
    assert resumed.take(8) == uninterrupted.take(8)
    assert resumed.taken == 20


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("defer", [False, True], ids=["split", "defer"])
def test_the_driver_started_at_a_checkpoints_step_runs_the_steps_after_it(
    mode: str, defer: bool
) -> None:
    rollout = SimRollout(TIMES)
    rollout.pushed("2")  # the resume's push before the first generation
    run = RunConfig(mode=mode, prompts_per_step=TIMES.groups, samples_per_prompt=2,
                    operation_timeout=30.0)  # fmt: skip
    ports = sim_ports(
        "resumed", run, times=TIMES, rollout=rollout, stages=[SimJudge(TIMES)], defer=defer
    )
    trained: list[int] = []

    async def on_trained(step: int) -> None:
        trained.append(step)

    printer = Printer(json_lines=True, out=io.StringIO(), err=io.StringIO(), tty=False)
    summary = asyncio.run(
        drive(ports, printer, steps=5, initial_version="2", first_step=2, on_trained=on_trained)
    )
    assert summary.failure is None
    assert [r["step"] for r in summary.committed] == [2, 3, 4] == trained
    assert summary.row()["first_step"] == 2
    assert summary.weight_versions == ["2", "3", "4", "5"]
    if mode == "sync":  # step N generated with the weights trained on batch N - 1
        assert [r["weight_version"] for r in summary.committed] == ["2", "3", "4"]


def _failing_run(
    run_dir: Path, fail_at: dict[int, int], *, steps: int, first_step: int = 0,
    failed_before: tuple[int, ...] = (), max_failed_steps: int = 2, version: str = "0",
) -> tuple[Any, Checkpointer]:  # fmt: skip
    """The simulated sync job of ``steps`` steps from ``first_step`` (rollout given weights
    ``version`` first, as a resume pushes them), whose generation fails at the steps of
    ``fail_at``, a checkpoint after every step (as ``relax run`` wires it)."""
    rollout = SimRollout(TIMES, fail_at=fail_at)
    rollout.pushed(version)
    run = RunConfig(prompts_per_step=TIMES.groups, samples_per_prompt=2, operation_timeout=30.0,
                    max_failed_steps=max_failed_steps)  # fmt: skip
    ports = sim_ports("failing", run, times=TIMES, rollout=rollout, stages=[SimJudge(TIMES)])
    checkpoints = Checkpointer(
        str(run_dir), every=1, steps=steps, trainer=SavingTrainer(),
        cursor=Cursor(ArithmeticSource(0)), job="j", job_file="job.toml", settings={},
    )  # fmt: skip
    printer = Printer(json_lines=True, out=io.StringIO(), err=io.StringIO(), tty=False)
    summary = asyncio.run(
        drive(
            ports,
            printer,
            steps=steps,
            initial_version=version,
            first_step=first_step,
            on_finished=checkpoints.finished,
            failed_before=failed_before,
        )
    )
    return summary, checkpoints


def test_a_checkpoint_counts_failed_steps_gone_past_as_finished_and_keeps_them(
    tmp_path: Path,
) -> None:
    summary, checkpoints = _failing_run(tmp_path, {1: 0, 2: 0}, steps=4)
    assert [r["step"] for r in summary.committed] == [0, 3]
    assert summary.row()["failed_steps"] == [1, 2]
    # a checkpoint after every step, the failed ones too: a resume goes on after them
    written = [(c.step, c.failed_steps, c.weight_version) for c in checkpoints.written]
    assert written == [(1, (), "1"), (2, (1,), "1"), (3, (1, 2), "1"), (4, (1, 2), "4")]
    saved = read_checkpoint(str(tmp_path))
    assert saved.step == 4 and saved.failed_steps == (1, 2)


def test_a_resumed_run_goes_on_after_the_failed_steps_and_keeps_their_count(
    tmp_path: Path,
) -> None:
    _failing_run(tmp_path, {1: 0, 2: 0}, steps=3)
    saved = read_checkpoint(str(tmp_path))
    assert (saved.step, saved.failed_steps, saved.weight_version) == (3, (1, 2), "1")
    # resumed at step 3 (not 1): two failures of max_failed_steps = 2 are spent, so the next
    # one ends the run
    resumed = {"first_step": saved.step, "failed_before": saved.failed_steps,
               "version": saved.weight_version}  # fmt: skip
    summary, _ = _failing_run(tmp_path, {3: 0}, steps=5, **resumed)
    assert summary.committed == [] and summary.failure is not None
    assert summary.failure.step == 3 and "generation failed" in summary.failure.error
    summary, checkpoints = _failing_run(tmp_path, {}, steps=5, **resumed)
    assert [r["step"] for r in summary.committed] == [3, 4]
    # the weights the resume pushed are the trainer's (version 1: steps 1 and 2 trained
    # nothing), and the versions go on as in a run that never stopped
    assert summary.weight_versions[:3] == ["1", "4", "5"]
    assert checkpoints.written[-1].failed_steps == (1, 2)
