"""Real faults against the InferenceManager: kill -9 and SIGSTOP of engine processes, killed
worker actors, unconfirmed cleanups — on a real local Ray with real hf engines.

Every test checks, through its fixtures, that no engine process, worker actor or placement
group is left behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoutingSpec
from relax_core.errors import InferenceRecoveryRequired, LifecycleError
from relax_core.manager import ManagerTimeouts, Outcome
from tests.support import cluster
from tests.support import manager as support

pytestmark = pytest.mark.ray

#: Offload deadlines short enough for a SIGSTOPped engine to time out quickly.
QUICK = ManagerTimeouts(
    start=120.0, offload=3.0, onload=20.0, drain=2.0, update=30.0, health=5.0, shutdown=5.0,
    rpc_margin=3.0,
)  # fmt: skip


@pytest.fixture(scope="module")
def publisher() -> RegistryPublisher:
    return RegistryPublisher("genrm", RoutingSpec(default_model="judge"))


#: Failed probes in a row before a live replica is FAILED (2 rather than the default 3: every
#: probe of a stopped engine waits out the health deadline).
UNHEALTHY_AFTER = 2


@pytest.fixture(scope="module")
def run(ray_local: Any, publisher: RegistryPublisher) -> Iterator[Any]:
    manager = support.make_manager(
        replicas=2, publisher=publisher, timeouts=QUICK, unhealthy_after=UNHEALTHY_AFTER
    )
    with support.managed(manager) as started:
        yield started


@pytest.fixture
def manager(run: Any) -> Iterator[Any]:
    """The shared two-replica manager, all READY at the start of each test."""
    run.manager.recover()
    run.manager.onload()
    assert set(run.manager.states().values()) == {"READY"}
    run.track()
    yield run.manager
    for pid in run.track():
        support.signal_quietly(pid, signal.SIGCONT)


def engine(publisher: RegistryPublisher, engine_id: str) -> Any:
    model = publisher.snapshot().models["judge"]
    return next(e for e in model.engines if e.engine_id == engine_id)


def test_kill_9_during_generation_fails_the_replica_and_rebuilds_it_after_cleanup(
    manager: Any, publisher: RegistryPublisher
) -> None:
    before = engine(publisher, "judge/replica-0")
    pid = manager.engine_pids()["judge/replica-0"][0]
    answer: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: answer.update(r=support.generate(before.base_url, tokens=2000))
    )
    thread.start()
    support.wait_for(
        lambda: support.admission_inflight(manager, "judge/replica-0") == 1,
        timeout=20,
        what="a generation in flight",
    )
    os.kill(pid, signal.SIGKILL)
    thread.join(30)
    assert answer["r"][0] == 502  # the admission server reports the lost engine

    report = manager.health_check(recover=False)
    assert not report.by_engine["judge/replica-0"].healthy
    assert report.by_engine["judge/replica-1"].healthy
    failed = engine(publisher, "judge/replica-0")
    assert failed.state == "FAILED" and failed.base_url is None and not failed.direct_eligible
    assert publisher.snapshot().models["judge"].state == "READY"  # replica-1 still serves

    result = manager.recover()
    assert result.outcomes == {"judge/replica-0": Outcome.DONE}
    rebuilt = engine(publisher, "judge/replica-0")
    assert rebuilt.state == "READY" and rebuilt.direct_eligible
    assert rebuilt.generation == before.generation + 1
    assert rebuilt.base_url != before.base_url
    new_pid = manager.engine_pids()["judge/replica-0"][0]
    assert new_pid != pid and support.pid_alive(new_pid) and not support.pid_alive(pid)
    assert support.generate(rebuilt.base_url)[0] == 200


def test_sigstopped_engine_during_offload_times_out_to_failed_never_sleeping(
    manager: Any, publisher: RegistryPublisher
) -> None:
    pid = manager.engine_pids()["judge/replica-1"][0]
    os.kill(pid, signal.SIGSTOP)
    try:
        result = manager.offload()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert result.outcomes == {"judge/replica-0": Outcome.DONE, "judge/replica-1": Outcome.FAILED}
    assert manager.states() == {"judge/replica-0": "SLEEPING", "judge/replica-1": "FAILED"}
    stuck = engine(publisher, "judge/replica-1")
    assert stuck.state == "FAILED" and not stuck.direct_eligible
    assert not result.ok
    with pytest.raises(LifecycleError, match=r"judge/replica-1.*not known to be free"):
        result.raise_for_failures()
    # A FAILED replica is not freed by a repeated offload either.
    again = manager.offload()
    assert again.outcomes["judge/replica-1"] is Outcome.FAILED


def test_partially_failed_onload_keeps_the_confirmed_replica_ready(
    manager: Any, publisher: RegistryPublisher
) -> None:
    manager.offload()
    pid = manager.engine_pids()["judge/replica-0"][0]
    os.kill(pid, signal.SIGKILL)
    result = manager.onload()
    assert result.outcomes == {"judge/replica-0": Outcome.FAILED, "judge/replica-1": Outcome.DONE}
    assert manager.states() == {"judge/replica-0": "FAILED", "judge/replica-1": "READY"}
    eligible = [
        e.engine_id for e in publisher.snapshot().models["judge"].engines if e.direct_eligible
    ]
    assert eligible == ["judge/replica-1"]


def test_health_check_rebuilds_a_dead_engine_in_one_call(
    manager: Any, publisher: RegistryPublisher
) -> None:
    pid = manager.engine_pids()["judge/replica-1"][0]
    os.kill(pid, signal.SIGKILL)
    support.wait_for(lambda: not support.pid_alive(pid), timeout=10, what="engine dead")
    report = manager.health_check()
    verdict = report.by_engine["judge/replica-1"]
    assert not verdict.healthy and verdict.action == "rebuilt" and verdict.state == "READY"
    assert verdict.problems and all("judge/replica-1" in p for p in verdict.problems)
    assert engine(publisher, "judge/replica-1").generation >= 2


@contextlib.contextmanager
def _stopped(manager: Any, engine_id: str) -> Iterator[int]:
    """The engine's process stopped (SIGSTOP) for the block and continued after it: its pid."""
    pid = manager.engine_pids()[engine_id][0]
    os.kill(pid, signal.SIGSTOP)
    try:
        yield pid
    finally:
        os.kill(pid, signal.SIGCONT)


def test_an_engine_stopped_for_fewer_probes_than_the_limit_stays_ready_and_is_not_rebuilt(
    manager: Any, publisher: RegistryPublisher
) -> None:
    before = engine(publisher, "judge/replica-1")
    with _stopped(manager, "judge/replica-1") as pid:
        reports: list[Any] = []
        probing = threading.Thread(target=lambda: reports.append(manager.health_check()))
        probing.start()
        # The probes run without the manager's lock: a lifecycle call of the other replica
        # finishes while the stopped engine's probe is still waiting out its deadline.
        support.wait_for(
            lambda: manager._health_lock.locked(), timeout=10, what="a health round running"
        )
        off = manager.offload(engine_ids=["judge/replica-0"])
        assert off.outcomes == {"judge/replica-0": Outcome.DONE}, off
        assert probing.is_alive(), "the offload waited for the health probes"
        probing.join(60)
        (report,) = reports
    verdict = report.by_engine["judge/replica-1"]
    assert verdict.action == "suspect" and verdict.failed_probes == 1
    assert not verdict.healthy and verdict.state == "READY"
    assert "failed probe 1 of 2" in verdict.problems[0]
    # The replica offloaded during the round: its probe overlapped that change and is not held
    # against it.
    assert report.by_engine["judge/replica-0"].healthy
    # Still READY and routable, same process, same generation: nothing was rebuilt.
    assert manager.states()["judge/replica-1"] == "READY"
    assert engine(publisher, "judge/replica-1") == before
    assert manager.engine_pids()["judge/replica-1"] == [pid]
    assert support.generate(before.base_url)[0] == 200
    # The next round passes and the count starts over.
    manager.onload()
    again = manager.health_check()
    assert again.healthy and again.by_engine["judge/replica-1"].failed_probes == 0
    assert manager.engine_pids()["judge/replica-1"] == [pid]


def test_an_engine_stopped_for_the_probe_limit_becomes_failed_and_is_rebuilt(
    manager: Any, publisher: RegistryPublisher
) -> None:
    before = engine(publisher, "judge/replica-1")
    with _stopped(manager, "judge/replica-1") as pid:
        first = manager.health_check(recover=False)
        assert first.by_engine["judge/replica-1"].action == "suspect"
        assert manager.states()["judge/replica-1"] == "READY"
        second = manager.health_check(recover=False)
    verdict = second.by_engine["judge/replica-1"]
    assert verdict.action == "failed" and verdict.state == "FAILED"
    assert verdict.failed_probes == UNHEALTHY_AFTER
    assert "2 probes failed in a row" in verdict.problems[0]
    failed = engine(publisher, "judge/replica-1")
    assert failed.state == "FAILED" and failed.base_url is None and not failed.direct_eligible
    result = manager.recover()
    assert result.outcomes == {"judge/replica-1": Outcome.DONE}
    rebuilt = engine(publisher, "judge/replica-1")
    assert rebuilt.state == "READY" and rebuilt.generation == before.generation + 1
    assert manager.engine_pids()["judge/replica-1"] != [pid]
    support.wait_for(lambda: not support.pid_alive(pid), timeout=20, what="stopped engine gone")


@pytest.fixture
def solo(ray_local: Any) -> Iterator[Any]:
    """A one-replica manager of its own (these tests break it beyond repair)."""
    with support.managed(support.make_manager(replicas=1, timeouts=QUICK)) as started:
        yield started


def _kill_worker_actor(manager: Any, engine_id: str) -> None:
    """Kill the head worker's actor; return once its process and its engine are gone and Ray
    answers a call on the actor with its death (under load a call may first find it only
    unavailable, which confirms nothing: the manager then marks the replica FAILED without
    fencing it; and Ray may confirm the death while the process still runs for a moment,
    its control endpoint answering that the engine is gone: FAILED, not fenced, as well)."""
    import ray

    from relax_core.manager.fanout import is_terminal_actor_death

    pid = manager.engine_pids()[engine_id][0]
    actor = manager.workers(engine_id)[0].actor
    actor_pid = ray.get(actor.actor_pid.remote(), timeout=30)
    ray.kill(actor, no_restart=True)
    # The engine dies with its actor (process group + reaper).
    support.wait_for(lambda: not support.pid_alive(pid), timeout=10, what="engine killed")
    support.wait_for(
        lambda: not support.pid_alive(actor_pid), timeout=30, what="worker actor process gone"
    )

    def confirmed() -> bool:
        try:
            ray.get(actor.actor_pid.remote(), timeout=5)
        except Exception as exc:  # what Ray says of the actor now
            return is_terminal_actor_death(exc)
        return False

    support.wait_for(confirmed, timeout=60, what="Ray confirms the actor's death")


def test_killed_worker_actor_is_fenced_and_nothing_is_rebuilt(solo: Any) -> None:
    manager = solo.manager
    solo.track()
    group = solo.groups[0]
    _kill_worker_actor(manager, "judge/replica-0")
    # The engine died with its actor, but the manager cannot know that: it fences and refuses
    # to go on.
    with pytest.raises(InferenceRecoveryRequired, match="judge/replica-0") as info:
        manager.health_check()
    assert info.value.report.by_engine["judge/replica-0"].action == "fenced"
    # Cleaned as far as it can be (nothing else to stop), but the fenced worker stays pending.
    assert manager.states() == {"judge/replica-0": "STOPPING"}
    fenced = manager.workers("judge/replica-0")[0]
    assert fenced.fenced and "without confirmed cleanup" in fenced.pending
    for call in (manager.offload, manager.onload, manager.recover, manager.health_check):
        with pytest.raises(InferenceRecoveryRequired):
            call()
    # Nothing rebuilt: the manager holds only the dead actor, and no other is alive.
    assert support.actor_ids(manager) <= solo.actors
    assert support.alive_worker_actors(solo.actors | support.actor_ids(manager)) == []
    with pytest.raises(InferenceRecoveryRequired):
        manager.shutdown()
    assert support.group_state(group) == "CREATED"  # the placement group stays fenced
    # An operator confirms the node is clean; then the group can go.
    assert manager.confirm_external_cleanup() == ["judge/replica-0"]
    manager.shutdown()
    assert support.group_state(group) == "REMOVED"


def test_worker_actor_killed_before_an_offload_is_fenced_not_just_failed(solo: Any) -> None:
    manager = solo.manager
    solo.track()
    _kill_worker_actor(manager, "judge/replica-0")
    # The offload's HTTP request finds nobody at the private control endpoint; that alone
    # proves nothing, so the manager asks Ray, which confirms the actor's death: fenced.
    with pytest.raises(InferenceRecoveryRequired, match="judge/replica-0") as info:
        manager.offload()
    result = info.value.result
    assert result.outcomes == {"judge/replica-0": Outcome.FAILED}
    assert "fenced" in result.replicas[0].error
    assert manager.states() == {"judge/replica-0": "FAILED"}
    assert manager.workers("judge/replica-0")[0].fenced
    with pytest.raises(InferenceRecoveryRequired):
        manager.onload()


def test_unconfirmed_shutdown_stays_pending_and_is_retried(solo: Any) -> None:
    import ray

    manager = solo.manager
    group = solo.groups[0]
    actor_pid = ray.get(manager.workers("judge/replica-0")[0].actor.actor_pid.remote())
    os.kill(actor_pid, signal.SIGSTOP)
    try:
        with pytest.raises(LifecycleError, match=r"judge/replica-0.*shutdown\(\) again"):
            manager.shutdown()
        assert support.group_state(group) == "CREATED"
        assert manager.workers("judge/replica-0")[0].pending
    finally:
        os.kill(actor_pid, signal.SIGCONT)
    manager.shutdown()
    assert support.group_state(group) == "REMOVED"
    manager.shutdown()  # idempotent


@pytest.mark.slow
def test_unconfirmed_removal_of_an_owned_group_stays_pending_and_is_retried(
    tmp_path: Path,
) -> None:
    # A GCS that really does not answer: the check stops the gcs_server of a Ray cluster it
    # starts for itself (never the suite's) while the manager removes its owned group.
    gcs_pid_file = tmp_path / "gcs.pid"
    proc = subprocess.Popen(
        cluster.check_command("pg_cleanup_cluster_check", str(gcs_pid_file)),
        cwd=cluster.ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=280)
    finally:
        if proc.poll() is None:
            # Killed midway: continue the GCS it may have stopped, then stop the check and
            # the cluster it started (its own session).
            with contextlib.suppress(OSError, ValueError):
                os.kill(int(gcs_pid_file.read_text()), signal.SIGCONT)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr[-4000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["start"] == {"judge/replica-0": "done"}
    assert out["gcs_state_when_removing"] == "T"  # stopped
    # Not confirmed: shutdown() raised, naming the group, and kept it pending ...
    assert out["first_shutdown"].startswith("LifecycleError: model 'judge': removing its owned")
    assert out["first_shutdown"].endswith("they stay pending: call shutdown() again")
    assert out["removals_after_first"] == 1
    assert out["engines_alive_after_first"] == [False]  # the engines were stopped before
    # ... and the next shutdown() removed that same group, for real.
    assert out["second_shutdown"] == "returned"
    assert out["removed_twice_the_same_group"] is True
    assert out["group_state"] == "REMOVED"
    assert out["gcs_left"] is False
