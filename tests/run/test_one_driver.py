"""One step driver: a sync run is the async driver at ``max_staleness = 0``, and a run reports
its steps the same way in both modes.

The same simulated job (the real coordinator, deferred batch and sink; engines of fixed
per-phase times, :mod:`relax_core.bench._steps_sim`) runs through :func:`relax_core.run.loop.
drive` in both modes and both layouts: the rows have the same keys, ``--measure`` (the run
probe ``switching`` relax-bench registers) reports its switches, the final push gives rollout
the last weights, a sync step generates with the weights of the step before it. A failed sync
step commits nothing and lists its samples; SIGINT stops the step in flight. And only the
driver's module drives a step.
"""

from __future__ import annotations

import asyncio
import io
import os
import re
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from relax_bench._steps_sim import SimJudge, SimRollout, SimTrainer, Times

import relax_core
from relax_core.coordination import BatchState, Sample, StageContext, StageReport
from relax_core.plugins import PluginManager
from relax_core.run.loop import RunSummary, drive
from relax_core.run.progress import Printer
from tests.support.sim_job import sim_ports, sim_run

TIMES = Times(generate_s=0.02, score_s=0.02, train_s=0.02, push_s=0.0, groups=2)


class Trainer(SimTrainer):
    """The simulated trainer, with ``measure_copy`` for ``--measure``."""

    async def measure_copy(self, sizes: Sequence[int]) -> dict[int, dict[str, float]]:
        return {size: {"h2d": 0.001, "d2h": 0.001} for size in sizes}


class Interrupting(SimJudge):
    """A judge that sends this process SIGINT (Ctrl-C) while it scores step ``at``."""

    def __init__(self, times: Times, at: int) -> None:
        super().__init__(times)
        self.at = at

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        if ctx.batch_id == self.at:
            os.kill(os.getpid(), signal.SIGINT)
            await asyncio.sleep(30)
        return await super().run(samples, ctx)


def _run(
    mode: str,
    *,
    defer: bool,
    steps: int = 3,
    judge: SimJudge | None = None,
    dump_dir: Path | None = None,
    rollout: SimRollout | None = None,
    discards: bool | None = None,
    **options: Any,
) -> tuple[RunSummary, list[str], Any]:
    """The simulated job; ``options``: more ``[run]`` settings (by default the first failed
    step ends the run: ``max_failed_steps = 0``); ``discards``: as ``sim_ports``'."""
    rollout = rollout or SimRollout(TIMES)
    run = sim_run(TIMES, mode, **{"max_staleness": 1, **options})
    ports = sim_ports(
        f"one-driver-{mode}",
        run,
        times=TIMES,
        rollout=rollout,
        stages=[judge or SimJudge(TIMES)],
        defer=defer,
        trainer=Trainer,
        discards=discards,
    )
    out, err = io.StringIO(), io.StringIO()
    printer = Printer(json_lines=True, out=out, err=err, tty=False)
    summary = asyncio.run(
        drive(
            ports,
            printer,
            steps=steps,
            initial_version="0",
            measure=PluginManager.create().run_probe("switching"),
            dump_dir=None if dump_dir is None else str(dump_dir),
        )
    )
    return summary, [s.id for s in rollout.generated], ports.coordinator


@pytest.mark.parametrize("defer", [False, True], ids=["split", "defer"])
def test_sync_and_async_rows_have_the_same_keys_and_measure_works_in_both(defer: bool) -> None:
    runs = {mode: _run(mode, defer=defer)[0] for mode in ("sync", "async")}
    keys = {mode: [sorted(r) for r in s.committed] for mode, s in runs.items()}
    assert keys["sync"] == keys["async"] and len(keys["sync"]) == 3
    for mode, summary in runs.items():
        assert summary.failure is None and not summary.interrupted, mode
        # the final push: every trained step's weights reached rollout
        assert summary.weight_versions == ["0", "1", "2", "3"], mode
        assert summary.final_push is not None and summary.final_push["weight_version"] == "3"
        assert summary.switching is not None, mode
        switches = {(s["role"], s["direction"]) for s in summary.switching["switches"]}
        if defer:  # the judge's turns, and rollout's own offload and onload
            assert switches == {
                ("judge", "onload"), ("judge", "offload"),
                ("policy", "onload"), ("policy", "offload"),
            }, (mode, switches)  # fmt: skip
        else:  # a free rollout never switches; the judge is on GPUs of its own
            assert switches == set(), (mode, switches)
        assert sorted(summary.row()) == sorted(RunSummary("x", 1).row())
    for row in runs["sync"].committed:
        # staleness 0: step N generated with the weights trained on batch N - 1
        assert row["weight_version"] == str(row["step"])
        assert row["async"]["max_staleness_seen"] == 0 and row["async"]["streamed_stages"] == []
        assert {"generate", "judge", "commit", "train"} <= set(row["phases"])
        assert (row["pushed_before"] is None) == (row["step"] == 0)
        assert row["train"] == {"samples": 4, "loss": 0.0}  # the trainer's answer, as given


def test_a_failed_sync_step_commits_nothing_and_lists_its_samples(tmp_path: Path) -> None:
    summary, generated, coord = _run(
        "sync", defer=True, judge=SimJudge(TIMES, fail_at=1), dump_dir=tmp_path
    )
    assert [r["step"] for r in summary.committed] == [0]
    failure = summary.failure
    assert failure is not None and failure.step == 1 and not failure.interrupted
    assert failure.kind == "_Fault" and "the judge failed on step 1" in failure.error
    assert sorted(failure.sample_ids) == sorted(i for i in generated if i.startswith("b1-"))
    assert coord.batch_state(1) is BatchState.FAILED
    assert summary.final_push is None and summary.weight_versions == ["0"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch-0.jsonl", "failed-1.jsonl"]


@pytest.mark.parametrize("defer", [False, True], ids=["split", "defer"])
def test_a_failed_sync_generation_fails_its_batch(defer: bool) -> None:
    rollout = SimRollout(TIMES, fail_at={1: 1})
    summary, generated, coord = _run("sync", defer=defer, rollout=rollout)
    failure = summary.failure
    assert failure is not None and failure.step == 1 and failure.kind == "BatchFailedError"
    assert failure.error.startswith("BatchFailedError: batch 1 FAILED: generation failed: _Fault")
    assert failure.trainer.startswith("not asked")  # the trainer never saw batch 1
    assert sorted(failure.sample_ids) == sorted(i for i in generated if i.startswith("b1-"))
    assert coord.batch_state(1) is BatchState.FAILED


def test_sigint_cancels_the_sync_step_in_flight() -> None:
    summary, generated, coord = _run("sync", defer=True, judge=Interrupting(TIMES, at=1))
    assert summary.interrupted and summary.interrupted_step == 1
    failure = summary.failure
    assert failure is not None and failure.kind == "interrupted"
    assert failure.error == "interrupted during judge"
    assert sorted(failure.sample_ids) == sorted(i for i in generated if i.startswith("b1-"))
    assert coord.batch_state(1) is BatchState.FAILED
    assert summary.switching is None and summary.final_push is None


def test_only_the_driver_module_drives_a_step() -> None:
    """A second driver would open batches or build deferred batches itself: in the core and
    every distribution of the repository only ``run/driver.py`` does, besides the batch's own
    module, the testing helpers and the benchmark that times the batch machinery alone."""
    repo = Path(relax_core.__file__).parent.parent
    allowed = {
        "relax_core/run/driver.py",  # the one driver
        "relax_core/coordination/batch.py",  # DeferredBatch itself
        "relax_core/testing.py",  # a stage test's one batch, no step
        "plugins/relax-bench/relax_bench/defer.py",  # the coordinator's cost per batch, no step
    }
    places = [
        p
        for p in [*repo.glob("relax_core/**/*.py"), *repo.glob("plugins/*/*/**/*.py")]
        if "tests" not in p.relative_to(repo).parts
    ]
    drivers = sorted(
        str(p.relative_to(repo))
        for p in places
        if re.search(r"\bDeferredBatch\(|\.begin_batch\(", p.read_text())
    )
    assert set(drivers) <= allowed, sorted(set(drivers) - allowed)
    assert "relax_core/run/driver.py" in drivers
