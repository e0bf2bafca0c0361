"""The one job runtime: ``relax serve`` and ``relax run`` start phases, put deferred roles to
sleep and tear down through the same :class:`~relax_core.jobs.JobRuntime`, so every line about
it comes from one place.

The runtime's phases and teardown order are driven with fake model handles (a
:class:`~relax_core.jobs.ModelHandle` is all it needs of a model); the placement plan is the
real, pure planner's. The "one runtime" claim itself is checked with both commands run for real
(``relax_core.commands.serve.run`` and ``relax_core.commands.run.run``) on the session's local
Ray, with real managers and the test plugin's simulated engines, whose start fails for real.
"""

from __future__ import annotations

import argparse
import gc
import re
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_core import PluginManager, loads_config
from relax_core.errors import LifecycleError
from relax_core.jobs import JobRuntime, Stop
from relax_core.manager import LifecycleResult, Outcome, ReplicaResult, UnconfirmedWorker
from tests.support.jobs import colocated, defer, hf, job_text, sim

#: A defer layout on one declared GPU (as tests/coordination/test_serve_defer.py's).
DEFER_JOB = job_text(
    **colocated(1),
    placement=defer("genrm", "teacher"),
    models={
        "rollout.policy": hf("/models/none", route_mode="DIRECT"),
        "genrm.judge": hf("/models/none"),
        "teacher.math": hf("/models/none"),
    },
)


def _result(
    operation: str, model: str, state: str, error: str | None = None, tags: tuple[str, ...] = ()
) -> LifecycleResult:
    outcome = Outcome.FAILED if error else Outcome.DONE
    replica = ReplicaResult(f"{model}/replica-0", outcome, state, tags, error=error)
    return LifecycleResult(operation, model, (replica,))


class FakeModel:
    """A model handle that records what the runtime asked of it (``calls``, shared)."""

    def __init__(
        self,
        role: str,
        model_id: str,
        calls: list[str],
        *,
        sleeps: bool = True,
        unconfirmed: list[UnconfirmedWorker] | None = None,
        offload_tags: tuple[str, ...] = ("weights", "kv_cache", "cuda_graph"),
    ) -> None:
        self._role, self._model_id = role, model_id
        self.calls = calls
        self.sleeps = sleeps
        self.offload_tags = offload_tags  # what its offload releases (its spec's)
        self.unconfirmed = unconfirmed or []

    @property
    def role(self) -> str:
        return self._role

    @property
    def model_id(self) -> str:
        return self._model_id

    @property
    def key(self) -> str:
        return f"{self._role}.{self._model_id}"

    def start(self) -> LifecycleResult:
        self.calls.append(f"start {self.key}")
        return _result("start", self._model_id, "READY")

    def offload(self) -> LifecycleResult:
        self.calls.append(f"offload {self.key}")
        state = "SLEEPING" if self.sleeps else "READY"
        return _result("offload", self._model_id, state, tags=self.offload_tags)

    def shutdown(self) -> None:
        self.calls.append(f"shutdown {self.key}")

    def engine_pids(self) -> dict[str, list[int | None]]:
        return {}

    def router_pids(self) -> list[int]:
        return []

    def unconfirmed_workers(self) -> list[UnconfirmedWorker]:
        return self.unconfirmed

    def close(self) -> None:
        self.calls.append(f"close {self.key}")


def _defer_runtime(calls: list[str], **fakes: Any) -> tuple[JobRuntime, Any]:
    config = loads_config(DEFER_JOB)
    runtime = JobRuntime()
    runtime.plan_for(config, PluginManager.create())
    for role, model in (("rollout", "policy"), ("genrm", "judge"), ("teacher", "math")):
        runtime.add(FakeModel(role, model, calls, **fakes.get(role, {})))
    return runtime, config


def test_each_deferred_phase_is_started_and_put_to_sleep_before_the_next_then_the_rest_awake() -> (
    None
):
    calls: list[str] = []
    # The teacher keeps its weights while it sleeps (offload_weights = false).
    runtime, config = _defer_runtime(calls, teacher={"offload_tags": ("kv_cache", "cuda_graph")})
    said: list[str] = []
    try:
        runtime.start(config, said.append, sleep_note="nobody wakes it")
        # What the start made (and all before it) stays out of full garbage collections ...
        assert gc.get_freeze_count() > 0
    finally:
        runtime.teardown(lambda _line: None)
    assert gc.get_freeze_count() == 0  # ... until the teardown
    assert calls[:5] == [
        "start genrm.judge",
        "offload genrm.judge",
        "start teacher.math",
        "offload teacher.math",
        "start rollout.policy",
    ]
    lines = [re.sub(r"^  \[ *[\d.]+s\] ", "", line) for line in said]
    assert lines == [
        "starting genrm.judge (deferred, put to sleep once started)",
        "genrm.judge: READY",
        "genrm.judge: SLEEPING (deferred: engine memory released, weights kept on the CPU; "
        "nobody wakes it)",
        "starting teacher.math (deferred, put to sleep once started)",
        "teacher.math: READY",
        "teacher.math: SLEEPING (deferred: KV cache released, weights kept on the GPU; "
        "nobody wakes it)",
        "starting rollout.policy (awake)",
        "rollout.policy: READY",
    ]


def test_a_deferred_model_that_does_not_sleep_stops_the_start_before_the_next_phase() -> None:
    calls: list[str] = []
    runtime, config = _defer_runtime(calls, genrm={"sleeps": False})
    with pytest.raises(LifecycleError, match=r"genrm\.judge could not be put to sleep"):
        runtime.start(config, lambda _line: None, sleep_note="-")
    assert calls == ["start genrm.judge", "offload genrm.judge"]


def test_teardown_stops_the_parts_then_every_model_then_the_rest_and_is_idempotent() -> None:
    calls: list[str] = []
    runtime, _ = _defer_runtime(calls)
    said: list[str] = []
    first = [Stop("teacher gateway", lambda: calls.append("gateway"), kind="gateways")]
    then = [Stop("registry", lambda: calls.append("registry"))]
    assert runtime.teardown(said.append, first=first, then=then) == []
    assert calls[0] == "gateway" and calls[-1] == "registry"
    assert sorted(calls[1:-1]) == sorted(
        f"{what} {key}"
        for key in ("rollout.policy", "genrm.judge", "teacher.math")
        for what in ("shutdown", "close")
    )
    assert [re.sub(r"^  \[ *[\d.]+s\] ", "", line) for line in said] == [
        "gateways stopped (1)",
        "managers stopped (3)",
        "engines stopped (0 processes)",
    ]
    assert runtime.teardown(said.append) == [] and len(said) == 3


def test_a_part_that_fails_to_stop_is_a_problem_and_everything_else_still_stops() -> None:
    calls: list[str] = []
    runtime, _ = _defer_runtime(calls)

    def broken() -> None:
        raise OSError("socket gone")

    problems = runtime.teardown(lambda _line: None, first=[Stop("genrm gateway", broken)])
    assert problems == ["genrm gateway: OSError: socket gone"]
    assert sum(c.startswith("shutdown ") for c in calls) == 3


# -- both commands, one teardown -----------------------------------------------------------

#: Two models on the test plugin's simulated engine (real engine processes, no model), started
#: in one phase: the judge's engine starts; the policy's is given an option it does not know and
#: exits at once. Both commands really start the job (Ray actors, managers, engines), really
#: fail its start, and must stop the judge's engine: every start of a phase ends before the
#: start raises, so the judge's engine is always running (or its start failed, which the
#: assertions would show) when the teardown comes.
RUN_JOB = job_text(
    models={
        "rollout.policy": sim(
            "policy",
            device="cpu",
            route_mode="DIRECT",
            weight_source="ACTOR",
            extra_args=["--no-such-option"],
        ),
        "genrm.judge": sim("policy", device="cpu"),
    },
    run={"steps": 1, "trainer": "record-fields", "rewards": [{"adapter": "exact-match"}]},
)


@pytest.fixture
def job_file(tmp_path: Path) -> Path:
    model = tmp_path / "policy"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_text("{}")
    job = tmp_path / "job.toml"
    job.write_text(RUN_JOB)
    return job


@pytest.fixture
def teardowns(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[list[str]]]:
    """Every teardown of a JobRuntime, with what it said. A spy, not a fake: it calls the real
    teardown and only records its lines. The signal handlers the commands install are put back
    afterwards."""
    torn_down: list[list[str]] = []
    teardown = JobRuntime.teardown

    def spy(self: JobRuntime, say: Any, **parts: Any) -> list[str]:
        said: list[str] = []

        def both(line: str) -> None:
            said.append(line)
            say(line)

        problems = teardown(self, both, **parts)
        torn_down.append(said)
        return problems

    monkeypatch.setattr(JobRuntime, "teardown", spy)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield torn_down
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def _command(module: Any, *argv: str) -> int:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    code: int = module.run(parser.parse_args(list(argv)))
    return code


@pytest.mark.ray
@pytest.mark.slow
def test_relax_serve_and_relax_run_tear_down_through_the_one_job_runtime(
    ray_local: Any,
    job_file: Path,
    teardowns: list[list[str]],
    capsys: pytest.CaptureFixture[str],
    tmp_path: Path,
) -> None:
    import relax_core.commands.run as run_command
    import relax_core.commands.serve as serve_command

    logs = str(tmp_path / "logs")
    # Both commands find the session's Ray connected and run on it; neither stops it.
    assert _command(serve_command, str(job_file), "--log-dir", logs) == 1
    served = capsys.readouterr()
    assert _command(run_command, str(job_file), "--log-dir", logs) == 1
    ran = capsys.readouterr()

    # Each command tore its job down exactly once, through JobRuntime.teardown ...
    assert len(teardowns) == 2, teardowns
    serve_lines, run_lines = teardowns

    def unstamped(lines: list[str]) -> list[str]:
        return [re.sub(r"^  \[ *[\d.]+s\] ", "", line) for line in lines]

    # ... and said the same about it, in its own output.
    assert (
        unstamped(serve_lines)
        == unstamped(run_lines)
        == [
            "managers stopped (2)",
            "engines stopped (1 processes)",
        ]
    )
    assert all(line in served.out for line in serve_lines), served.out
    assert all(line in ran.out + ran.err for line in run_lines), ran.out + ran.err
    # Both failed for the one real reason: the engine process exited while it started.
    for out in (served, ran):
        assert "engines did not become READY" in out.err, out.err
        assert "--no-such-option" in out.err, out.err
