"""Logical replicas that span nodes, with real hf engines: one worker slot per node, only the
head published, a killed follower fails the whole replica, partial cleanup retried by URL,
scale-out creating every slot — on a real local Ray (bundles standing in for nodes); the same
replica on a real multi-node ``ray.cluster_utils.Cluster`` is
``tests/manager/test_manager_multinode_cluster.py``'s (a module of its own, so that the two
workers of the default session run its cluster and this module's manager side by side).

Each replica is a head ``relax-hf serve`` process and a follower process (``--node-rank 1``)
that joins the head's gloo node group at the ``dist_init_addr`` the manager hands out and
mirrors every step; a head whose follower is gone answers 503 to ``/health_generate``.

One manager serves the module (starting two-node hf replicas is the slow part); the ``run``
fixture hands each test exactly one READY replica, building or removing replicas as needed.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from relax_core.builtins import STATIC
from relax_core.discovery.publisher import RegistryPublisher
from relax_core.discovery.schema import RoutingSpec
from relax_core.engine.spec import InferenceEngineSpec
from relax_core.manager import (
    InferenceManager,
    ManagerTimeouts,
    ModelLaunch,
    Outcome,
    ReplicaPlacement,
)
from relax_core.records import EngineOptions
from tests.support import manager as support

pytestmark = pytest.mark.ray

QUICK = ManagerTimeouts(
    start=120.0, offload=10.0, onload=20.0, drain=1.0, health=10.0, shutdown=10.0, rpc_margin=2.0
)
BUNDLES = 6


def two_node_manager(publisher: RegistryPublisher, group: Any) -> InferenceManager:
    return InferenceManager(
        "math",
        spec=InferenceEngineSpec(role="teacher", weight_source=STATIC),
        backend=support.plugins().engine_backend("hf"),
        launch=ModelLaunch(
            model_path=support.tiny_model(),
            nodes_per_replica=2,
            served_model_name="math",
            options=EngineOptions(env={"OMP_NUM_THREADS": "1"}),
        ),
        placement=ReplicaPlacement(group, [[[0], [1]]], ray_gpu_fraction=1.0, owned=True),
        publisher=publisher,
        timeouts=QUICK,
    )


@attrs.define
class Module:
    run: Any
    publisher: RegistryPublisher


@pytest.fixture(scope="module")
def module_manager(ray_local: Any) -> Iterator[Module]:
    publisher = RegistryPublisher("teacher", RoutingSpec(default_model="math"))
    group = support.placement_group(BUNDLES)
    with support.managed(two_node_manager(publisher, group)) as run:
        yield Module(run, publisher)


def free_bundles(manager: InferenceManager, count: int) -> list[int]:
    """Bundles no worker of the manager holds."""
    used = {w.bundle for e in manager.states() for w in manager.workers(e)}
    free = [b for b in range(BUNDLES) if b not in used]
    assert len(free) >= count, f"only bundles {free} are free"
    return free[:count]


@pytest.fixture
def run(module_manager: Module) -> Any:
    """The module's manager with exactly one replica, READY."""
    manager = module_manager.run.manager
    ready = [e for e, state in manager.states().items() if state == "READY"]
    extra = [e for e in manager.states() if e not in ready[:1]]
    if extra:  # scale-in by count takes FAILED replicas first, then the newest
        manager.scale_in(count=len(extra))
    if not ready:
        head, follower = free_bundles(manager, 2)
        assert manager.scale_out([[[head], [follower]]]).ok
    module_manager.run.track()
    assert list(manager.states().values()) == ["READY"]
    return module_manager.run


def only_replica(run: Any) -> str:
    (engine_id,) = run.manager.states()
    return str(engine_id)


def test_a_two_node_replica_has_one_slot_per_node_and_publishes_only_its_head(
    run: Any, module_manager: Module
) -> None:
    manager = run.manager
    engine_id = only_replica(run)
    workers = manager.workers(engine_id)
    assert [w.node_rank for w in workers] == [0, 1]
    assert len({w.bundle for w in workers}) == 2
    assert all(w.actor is not None and support.pid_alive(w.engine_pid) for w in workers)
    engines = module_manager.publisher.snapshot().models["math"].engines
    assert [e.engine_id for e in engines] == [engine_id]
    assert engines[0].direct_eligible
    status, body, _ = support.generate(engines[0].base_url, tokens=6)
    assert status == 200 and body["meta_info"]["completion_tokens"] == 6
    # The follower the head counts as its node 1 is the follower worker's engine process, and it
    # computed the same tokens as the head.
    status, info, _ = support.http("GET", engines[0].base_url + "/server_info")
    assert status == 200
    nodes = info["nodes"]
    assert [f["pid"] for f in nodes["followers"]] == [workers[1].engine_pid]
    assert nodes["healthy"] and nodes["tokens_synced"] >= 6 and nodes["diverged_tokens"] == 0


def test_scale_out_creates_a_slot_for_every_node_of_the_new_replica(
    run: Any, module_manager: Module
) -> None:
    manager = run.manager
    first = only_replica(run)
    head, follower = free_bundles(manager, 2)
    result = manager.scale_out([[[head], [follower]]])
    run.track()
    (new,) = result.outcomes
    assert result.outcomes == {new: Outcome.DONE}, [r.error for r in result.replicas]
    workers = manager.workers(new)
    assert [(w.node_rank, w.bundle) for w in workers] == [(0, head), (1, follower)]
    assert all(support.pid_alive(w.engine_pid) for w in workers)
    engines = {e.engine_id: e for e in module_manager.publisher.snapshot().models["math"].engines}
    assert sorted(engines) == sorted([first, new])
    assert support.generate(engines[new].base_url)[0] == 200
    with pytest.raises(ValueError, match="spans 2 node"):
        manager.scale_out([[[free_bundles(manager, 1)[0]]]])


def test_killing_the_follower_fails_the_whole_replica_and_it_is_rebuilt_as_a_whole(
    run: Any, module_manager: Module
) -> None:
    manager = run.manager
    engine_id = only_replica(run)
    url = module_manager.publisher.snapshot().models["math"].engines[0].base_url
    head, follower = manager.engine_pids()[engine_id]
    os.kill(follower, signal.SIGKILL)
    support.wait_for(lambda: not support.pid_alive(follower), timeout=10, what="follower dead")
    # The head itself notices: it refuses to generate without its follower.
    support.wait_for(
        lambda: support.http("GET", url + "/health_generate", timeout=30)[0] != 200,
        timeout=30,
        what="the head to report its lost follower",
    )
    # The head answers the manager's probe 503 naming node 1: FAILED at once. (Seen once in
    # CI: that probe's connection was reset instead, which counts as a failed probe, 1 of 3;
    # the next check meets the 503.)
    verdicts = []

    def failed() -> bool:
        verdicts.append(manager.health_check(recover=False).by_engine[engine_id])
        return verdicts[-1].state == "FAILED"

    support.wait_for(failed, timeout=30, what=f"{engine_id} FAILED by a health check")
    verdict = verdicts[-1]
    assert not verdict.healthy and len(verdicts) <= 2, verdicts
    assert any("node-1" in p for p in verdict.problems)
    engine = module_manager.publisher.snapshot().models["math"].engines[0]
    assert engine.state == "FAILED" and engine.base_url is None and not engine.direct_eligible
    generation = engine.generation

    assert manager.recover().outcomes == {engine_id: Outcome.DONE}
    run.track()
    new_head, new_follower = manager.engine_pids()[engine_id]
    assert not support.pid_alive(head)  # the healthy head was cleaned up with its replica
    assert support.pid_alive(new_head) and support.pid_alive(new_follower)
    engine = module_manager.publisher.snapshot().models["math"].engines[0]
    assert engine.state == "READY" and engine.generation == generation + 1
    assert support.generate(engine.base_url)[0] == 200


def test_partially_cleaned_replica_is_retried_by_its_current_url_after_a_recovery(
    run: Any, module_manager: Module
) -> None:
    import ray

    manager = run.manager
    engine_id = only_replica(run)
    publisher = module_manager.publisher
    # A recovery first moves the head to a new URL; the retry must use that one.
    old_url = publisher.snapshot().models["math"].engines[0].base_url
    os.kill(manager.engine_pids()[engine_id][0], signal.SIGKILL)
    manager.health_check()
    run.track()
    url = publisher.snapshot().models["math"].engines[0].base_url
    assert url and url != old_url
    follower = manager.workers(engine_id)[1]
    actor_pid = ray.get(follower.actor.actor_pid.remote())
    os.kill(actor_pid, signal.SIGSTOP)
    try:
        first = manager.scale_in(urls=[url])
        assert first.outcomes == {engine_id: Outcome.FAILED}
        head, follower = manager.workers(engine_id)
        assert head.actor is None and follower.actor is not None and follower.pending
    finally:
        os.kill(actor_pid, signal.SIGCONT)
    retry = manager.scale_in(urls=[url])
    assert retry.outcomes == {engine_id: Outcome.DONE}
    assert manager.states() == {}
    assert publisher.snapshot().models["math"].engines == ()


def test_a_backend_without_multi_node_support_is_refused(ray_local: Any) -> None:
    hf = support.plugins().engine_backend("hf")
    single = attrs.evolve(hf, name="single", multi_node=False)
    with pytest.raises(ValueError, match="does not support multi-node"):
        InferenceManager(
            "math",
            spec=InferenceEngineSpec(role="teacher", weight_source=STATIC),
            backend=single,
            launch=ModelLaunch(model_path="unused", nodes_per_replica=2, device="cuda"),
            placement=ReplicaPlacement(None, [[(), ()]]),
        )
