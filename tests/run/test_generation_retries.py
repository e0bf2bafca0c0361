"""A group whose generation failed is regenerated as a whole, on the simulated job (the real
coordinator, deferred batch, sink and driver; the real :class:`~relax_core.run.generate.
StepProducer` and ``Generator`` over a simulated engine): the failed request is never sent again,
a new group of the same prompt is generated in its place (new ids, none of the failed attempt's
samples kept), after rollout was healed (its dead replicas rebuilt, the trainer's weights pushed
to them), counted in the step's ``retries`` (``generate``) and the trace; a 4xx is never
regenerated; past ``[run] generation_retries`` the step fails.

In a defer layout (rollout takes turns with the judge on one GPU) a rollout replica that died is
rebuilt the same way through a lease engine of its own (the real
:class:`~relax_core.coordination.leases.LeaseEngine`, as ``relax run`` wires it) over a
simulated manager handle: found during generation (its groups regenerated) or at its onload
(the onload sent once more), the weights pushed to it again, every step committed."""

from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path
from typing import Any, cast

import attrs
import pytest
from relax_bench._steps_sim import SimJudge, SimRollout

from relax_core import LifecycleResult, Outcome, ReplicaResult
from relax_core.client.client import InferenceClient
from relax_core.coordination import Sample
from relax_core.errors import (
    RequestNotReplayedError,
    UpstreamError,
    UpstreamStatusError,
    UpstreamUnreachableError,
)
from relax_core.run.config import RunConfig
from relax_core.run.data import Prompt
from relax_core.run.generate import Generator, StepProducer
from relax_core.run.loop import RunSummary, drive, role_recovery
from relax_core.run.progress import Printer
from relax_core.run.rollout import GroupRequest
from tests.run.test_one_driver import TIMES, Trainer
from tests.support.sim_job import sim_ports, sim_run


class Prompts:
    """A prompt source handing out ``q0``, ``q1``, … in order."""

    def __init__(self) -> None:
        self.taken = 0

    def take(self, n: int) -> list[Prompt]:
        out = [Prompt(f"q{self.taken + i}") for i in range(n)]
        self.taken += n
        return out


class FailingEngine(SimRollout):
    """The simulated policy engine behind the real producer: the generation of the groups in
    ``fail`` ((step, group index) -> the errors its attempts meet, in turn) raises them; every
    request the shape sends is listed in ``requests`` (group id, prompt)."""

    def __init__(self, fail: dict[tuple[int, int], list[UpstreamError]]) -> None:
        super().__init__(TIMES)
        self.fail = fail
        self.requests: list[tuple[str, str]] = []
        self.source = Prompts()
        self.run: RunConfig | None = None

    async def group(self, request: GroupRequest, client: InferenceClient) -> list[Sample]:
        self.requests.append((request.group_id, request.prompt.prompt))
        errors = self.fail.get((request.batch_id, request.index), [])
        if errors:
            raise errors.pop(0)
        samples = await SimRollout.group(self, request.batch_id, request.index)
        for s in samples:
            s.metadata["prompt"] = request.prompt.prompt
        return samples

    def producer(self) -> StepProducer:  # type: ignore[override]
        assert self.run is not None
        return StepProducer(Generator(cast(InferenceClient, None), self.run, self), self.source)


def _run(
    engine: FailingEngine, **options: Any
) -> tuple[RunSummary, list[str], dict[int, list[str]], list[str]]:
    """The simulated split job of 3 steps on ``engine``: its summary, the samples generated,
    the samples trained (step -> ids) and the roles the run asked to rebuild (each answers
    one replica rebuilt)."""
    run = sim_run(TIMES, options.pop("mode", "async"), **options)
    engine.run = run
    asked: list[str] = []

    async def recover(role: str) -> dict[str, list[str]]:
        asked.append(role)
        return {"rebuilt": [f"{role}.m"], "failed": []}

    ports = sim_ports(
        "regenerate", run, times=TIMES, rollout=engine, stages=[SimJudge(TIMES)], trainer=Trainer
    )
    ports = attrs.evolve(ports, recover=recover)
    printer = Printer(json_lines=True, out=io.StringIO(), err=io.StringIO(), tty=False)
    summary = asyncio.run(drive(ports, printer, steps=3, initial_version="0"))
    trained = {n: [s.id for s in samples] for n, samples, _ in ports.trainer.trained}
    return summary, [s.id for s in engine.generated], trained, asked


def _gone() -> UpstreamUnreachableError:
    return UpstreamUnreachableError(502, "engine 'policy/replica-0' could not be reached")


def _cut() -> RequestNotReplayedError:
    return RequestNotReplayedError(502, "the stream was cut", answer_started=True)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_group_whose_engine_died_is_regenerated_as_a_new_group_of_its_prompt(mode: str) -> None:
    engine = FailingEngine({(1, 1): [_cut()]})
    summary, generated, trained, asked = _run(engine, mode=mode)
    assert summary.failure is None and [r["step"] for r in summary.committed] == [0, 1, 2]
    rows = {r["step"]: r for r in summary.committed}
    assert rows[1]["retries"] == {"generate": 1}
    assert rows[1]["recoveries"] == {"policy": 1}  # healed once, between the two attempts
    assert rows[0]["retries"] == {} and rows[2]["retries"] == {}
    assert summary.row()["retries"] == {"generate": 1}
    assert asked == ["policy"]
    # the failed request was not sent again: group b1-p1 was asked once, and its prompt went
    # out again as a new group, b1-p2
    sent = [r for r in engine.requests if r[0].startswith("b1-")]
    assert sent.count(("b1-p1", "q3")) == 1 and ("b1-p2", "q3") in sent
    assert not any(i.startswith("b1-p1-") for i in generated)  # nothing of it kept
    assert sorted({i.rsplit("-", 1)[0] for i in trained[1]}) == ["b1-p0", "b1-p2"]
    assert len(generated) == len(set(generated))


def test_the_weights_are_pushed_to_the_rebuilt_replica_before_the_group_is_regenerated() -> None:
    engine = FailingEngine({(2, 0): [_gone()]})
    pushes: list[tuple[str, int]] = []
    original = SimRollout.pushed

    def pushed(self: SimRollout, version: str) -> None:
        pushes.append((version, len(engine.requests)))
        original(self, version)

    engine.pushed = pushed.__get__(engine)  # type: ignore[method-assign]
    summary, _, _, _ = _run(engine, mode="sync")
    assert [r["step"] for r in summary.committed] == [0, 1, 2]
    failed_at = engine.requests.index(("b2-p0", "q4"))
    again_at = engine.requests.index(("b2-p2", "q4"))
    # the weights of step 2 pushed again between the failure and the new group
    assert any(v == "2" and failed_at < n <= again_at for v, n in pushes), (pushes, failed_at)


def test_a_4xx_is_never_regenerated_and_fails_its_step() -> None:
    bad = UpstreamStatusError(400, "bad request", body=b"{}", url="http://e")
    engine = FailingEngine({(1, 0): [bad]})
    summary, _, _, asked = _run(engine, mode="sync", max_failed_steps=3)
    assert [r["step"] for r in summary.committed] == [0, 2]
    assert summary.row()["failed_steps"] == [1]
    assert [r[0] for r in engine.requests if r[1] == "q2"] == ["b1-p0"]
    assert summary.row()["retries"] == {} and asked == []


def test_a_group_failing_past_generation_retries_fails_its_step_and_says_so() -> None:
    engine = FailingEngine({(1, 0): [_gone()], (1, 2): [_gone()], (1, 3): [_gone()]})
    summary, generated, _, _ = _run(engine, mode="sync", max_failed_steps=3, generation_retries=2)
    assert [r["step"] for r in summary.committed] == [0, 2]
    (failed,) = summary.went_past
    assert "generated 3 times (2 regenerated" in failed.error, failed.error
    assert failed.row()["retries"] == {"generate": 2}
    assert not any(i.startswith(("b1-p0-", "b1-p2-", "b1-p3-")) for i in generated)


def test_generation_retries_0_fails_the_step_at_the_first_failure() -> None:
    engine = FailingEngine({(1, 0): [_gone()]})
    summary, _, _, asked = _run(engine, mode="sync", max_failed_steps=3, generation_retries=0)
    assert [r["step"] for r in summary.committed] == [0, 2]
    assert summary.row()["retries"] == {} and asked == ["policy"]  # the next step heals first
    assert [r[0] for r in engine.requests if r[1] == "q2"] == ["b1-p0"]


def test_a_regeneration_is_counted_on_the_trace(tmp_path: Path) -> None:
    engine = FailingEngine({(1, 1): [_gone()]})
    run = sim_run(TIMES)
    engine.run = run
    ports = sim_ports(
        "regenerate", run, times=TIMES, rollout=engine, stages=[SimJudge(TIMES)], trainer=Trainer
    )
    printer = Printer(json_lines=True, out=io.StringIO(), err=io.StringIO(), tty=False)
    trace = tmp_path / "trace.json"
    summary = asyncio.run(drive(ports, printer, steps=3, initial_version="0", trace=str(trace)))
    assert summary.failure is None
    events = json.loads(trace.read_text())["traceEvents"]
    counts = [e["args"] for e in events if e.get("ph") == "C" and e.get("name") == "retries"]
    assert {"generate": 1} in counts, counts


class DyingHandle:
    """The policy's manager handle in a defer layout, whose replica can die (:meth:`die`): an
    onload is then not confirmed (the replica FAILED) and ``failed()`` says so until
    ``recover()`` rebuilds it. ``die_after_offload``: the replica dies as it sleeps after the
    offload of that step's turn. ``events`` lists what happened, in order."""

    def __init__(self, events: list[str], *, die_after_offload: int | None = None) -> None:
        self.name = "policy"
        self.dead = False
        self.events = events
        self.offloads = 0
        self.die_after_offload = die_after_offload

    def die(self) -> None:
        self.dead = True
        self.events.append("died")

    def _result(self, op: str, state: str) -> LifecycleResult:
        outcome = Outcome.FAILED if self.dead else Outcome.DONE
        replica = ReplicaResult("policy/replica-0", outcome, "FAILED" if self.dead else state)
        return LifecycleResult(op, "policy", (replica,))

    async def onload(self) -> LifecycleResult:
        self.events.append("onload failed" if self.dead else "onload")
        return self._result("onload", "READY")

    async def offload(self) -> LifecycleResult:
        result = self._result("offload", "SLEEPING")
        self.events.append("offload")
        self.offloads += 1
        if self.offloads - 1 == self.die_after_offload:
            self.die()
        return result

    async def failed(self) -> bool:
        return self.dead

    async def check_health(self) -> None:
        return None

    async def recover(self) -> LifecycleResult:
        self.dead = False
        self.events.append("rebuilt")
        return self._result("recover", "READY")

    async def weight_version(self) -> str | None:
        return None


class DyingEngine(FailingEngine):
    """:class:`FailingEngine` whose failures kill ``handle``'s replica, and whose requests fail
    while it is dead; pushes are listed in ``handle.events``."""

    def __init__(self, handle: DyingHandle, fail: dict[tuple[int, int], list[UpstreamError]]):
        super().__init__(fail)
        self.handle = handle

    async def group(self, request: GroupRequest, client: InferenceClient) -> list[Sample]:
        key = (request.batch_id, request.index)
        if self.fail.get(key) and not self.handle.dead:
            self.handle.die()
        if self.handle.dead:
            self.requests.append((request.group_id, request.prompt.prompt))
            raise _gone()
        return await super().group(request, client)

    def pushed(self, version: str) -> None:
        self.handle.events.append(f"push {version}")
        super().pushed(version)


def _run_defer(handle: DyingHandle, engine: DyingEngine, mode: str) -> tuple[RunSummary, list[str]]:
    run = sim_run(TIMES, mode)
    engine.run = run
    ports = sim_ports(
        "defer", run, times=TIMES, rollout=engine, stages=[SimJudge(TIMES)], defer=True,
        trainer=Trainer,
    )  # fmt: skip
    # as relax run wires it: rollout rebuilt through a lease engine of its own
    recover = role_recovery(ports.coordinator, {"policy": [handle]}, timeout=30.0)
    ports = attrs.evolve(ports, rollout=handle, recover=recover)
    printer = Printer(json_lines=True, out=io.StringIO(), err=io.StringIO(), tty=False)
    summary = asyncio.run(drive(ports, printer, steps=3, initial_version="0"))
    return summary, [s.id for s in engine.generated]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_defer_a_rollout_replica_dead_during_generation_is_rebuilt_and_its_groups_regenerated(
    mode: str,
) -> None:
    events: list[str] = []
    handle = DyingHandle(events)
    engine = DyingEngine(handle, {(1, 1): [_gone()]})
    summary, generated = _run_defer(handle, engine, mode)
    assert summary.failure is None, summary.failure
    rows = {r["step"]: r for r in summary.committed}
    assert sorted(rows) == [0, 1, 2]
    assert rows[1]["recoveries"] == {"policy": 1}
    assert 1 <= rows[1]["retries"]["generate"] <= TIMES.groups
    # rebuilt while it was onloaded (its turn), the trainer's weights of then pushed to it
    # before any group was generated again (sync: those trained on step 0; async: maybe not
    # trained yet)
    died = events.index("died")
    pushed = "push 1" if mode == "sync" else events[died + 2]
    assert events[died + 1 : died + 3] == ["rebuilt", pushed] and pushed.startswith("push "), events
    assert not any(i.startswith("b1-p1-") for i in generated)
    assert len(generated) == len(set(generated))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_defer_a_rollout_replica_dead_at_its_onload_is_rebuilt_onloaded_and_given_the_weights(
    mode: str,
) -> None:
    events: list[str] = []
    handle = DyingHandle(events, die_after_offload=1)  # dies as it sleeps after step 1's turn
    engine = DyingEngine(handle, {})
    summary, _ = _run_defer(handle, engine, mode)
    assert summary.failure is None, summary.failure
    rows = {r["step"]: r for r in summary.committed}
    assert sorted(rows) == [0, 1, 2]
    assert rows[2]["recoveries"] == {"policy": 1} and rows[2]["retries"] == {}
    assert rows[0]["recoveries"] == {} and rows[1]["recoveries"] == {}
    failed = events.index("onload failed")
    # rebuilt, onloaded again, then given the trainer's weights of then (those of step 1 or,
    # once trained, of step 2: the training lane's push follows while rollout is awake)
    assert events[failed + 1 : failed + 3] == ["rebuilt", "onload"], events
    assert events[failed + 3] in ("push 1", "push 2"), events
