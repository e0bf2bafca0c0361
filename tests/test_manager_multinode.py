"""Logical replicas that span nodes: one worker slot per node, only the head published,
follower death fails the whole replica, partial cleanup retried by URL, scale-out creating
every slot — on a real local Ray (two bundles standing in for two nodes) and on a real
multi-node ``ray.cluster_utils.Cluster`` (in a subprocess).

The engines are the lightweight multi-node SGLang-protocol servers of
``relax_core.bench._sim_engine``: real processes whose followers join the head over TCP at the
``dist_init_addr`` the manager hands out, and whose head stops generating when a follower
leaves. The ``hf`` backend has no follower mode (``nnodes`` > 1) yet.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from relax_core.bench.manager import SIM_BACKEND
from relax_core.builtins import STATIC
from relax_core.engine_spec import InferenceEngineSpec
from relax_core.manager import (
    InferenceManager,
    ManagerTimeouts,
    ModelLaunch,
    Outcome,
    ReplicaPlacement,
)
from relax_core.records import EngineBackend
from relax_core.registry import RegistryPublisher
from relax_core.schema import RoutingSpec


def _support() -> Any:
    spec = importlib.util.spec_from_file_location(
        "manager_support", Path(__file__).with_name("manager_support.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


support = _support()
pytestmark = pytest.mark.ray

QUICK = ManagerTimeouts(
    start=60.0, offload=5.0, onload=10.0, drain=1.0, health=5.0, shutdown=3.0, rpc_margin=1.0
)


def two_node_manager(publisher: RegistryPublisher, group: Any, replicas: int) -> InferenceManager:
    return InferenceManager(
        "math",
        spec=InferenceEngineSpec(role="teacher", weight_source=STATIC),
        backend=SIM_BACKEND,
        launch=ModelLaunch(model_path="sim", nodes_per_replica=2, served_model_name="math"),
        placement=ReplicaPlacement(
            group,
            [[[2 * i], [2 * i + 1]] for i in range(replicas)],
            ray_gpu_fraction=1.0,
            owned=True,
        ),
        publisher=publisher,
        timeouts=QUICK,
    )


@pytest.fixture
def publisher() -> RegistryPublisher:
    return RegistryPublisher("teacher", RoutingSpec(default_model="math"))


@pytest.fixture
def run(ray_local: Any, publisher: RegistryPublisher) -> Iterator[Any]:
    group = support.placement_group(6)
    with support.managed(two_node_manager(publisher, group, replicas=1)) as started:
        yield started


def test_a_two_node_replica_has_one_slot_per_node_and_publishes_only_its_head(
    run: Any, publisher: RegistryPublisher
) -> None:
    manager = run.manager
    workers = manager.workers("math/replica-0")
    assert [w.node_rank for w in workers] == [0, 1]
    assert [w.bundle for w in workers] == [0, 1]
    assert all(w.actor is not None and support.pid_alive(w.engine_pid) for w in workers)
    engines = publisher.snapshot().models["math"].engines
    assert [e.engine_id for e in engines] == ["math/replica-0"]
    assert engines[0].direct_eligible
    assert support.generate(engines[0].base_url)[0] == 200


def test_scale_out_creates_a_slot_for_every_node_of_the_new_replica(
    run: Any, publisher: RegistryPublisher
) -> None:
    manager = run.manager
    result = manager.scale_out([[[2], [3]]])
    run.track()
    assert result.outcomes == {"math/replica-1": Outcome.DONE}
    workers = manager.workers("math/replica-1")
    assert [(w.node_rank, w.bundle) for w in workers] == [(0, 2), (1, 3)]
    assert all(support.pid_alive(w.engine_pid) for w in workers)
    assert [e.engine_id for e in publisher.snapshot().models["math"].engines] == [
        "math/replica-0",
        "math/replica-1",
    ]
    with pytest.raises(ValueError, match="spans 2 node"):
        manager.scale_out([[[4]]])


def test_follower_death_fails_the_whole_replica_and_it_is_rebuilt_as_a_whole(
    run: Any, publisher: RegistryPublisher
) -> None:
    manager = run.manager
    head, follower = manager.engine_pids()["math/replica-0"]
    os.kill(follower, signal.SIGKILL)
    support.wait_for(lambda: not support.pid_alive(follower), timeout=10, what="follower dead")
    report = manager.health_check(recover=False)
    verdict = report.by_engine["math/replica-0"]
    assert not verdict.healthy and verdict.state == "FAILED"
    assert any("node-1" in p for p in verdict.problems)
    engine = publisher.snapshot().models["math"].engines[0]
    assert engine.state == "FAILED" and engine.base_url is None and not engine.direct_eligible

    assert manager.recover().outcomes == {"math/replica-0": Outcome.DONE}
    run.track()
    new_head, new_follower = manager.engine_pids()["math/replica-0"]
    assert not support.pid_alive(head)  # the healthy head was cleaned up with its replica
    assert support.pid_alive(new_head) and support.pid_alive(new_follower)
    assert publisher.snapshot().models["math"].engines[0].generation == 2


def test_partially_cleaned_replica_is_retried_by_its_current_url_after_a_recovery(
    run: Any, publisher: RegistryPublisher
) -> None:
    import ray

    manager = run.manager
    # A recovery first moves the head to a new URL; the retry must use that one.
    os.kill(manager.engine_pids()["math/replica-0"][0], signal.SIGKILL)
    manager.health_check()
    run.track()
    url = publisher.snapshot().models["math"].engines[0].base_url
    follower = manager.workers("math/replica-0")[1]
    actor_pid = ray.get(follower.actor.actor_pid.remote())
    os.kill(actor_pid, signal.SIGSTOP)
    try:
        first = manager.scale_in(urls=[url])
        assert first.outcomes == {"math/replica-0": Outcome.FAILED}
        head, follower = manager.workers("math/replica-0")
        assert head.actor is None and follower.actor is not None and follower.pending
    finally:
        os.kill(actor_pid, signal.SIGCONT)
    retry = manager.scale_in(urls=[url])
    assert retry.outcomes == {"math/replica-0": Outcome.DONE}
    assert manager.states() == {}
    assert publisher.snapshot().models["math"].engines == ()


def test_a_backend_without_multi_node_support_is_refused(ray_local: Any) -> None:
    single = EngineBackend(name="single", launch=SIM_BACKEND.launch, control_client=object)
    with pytest.raises(ValueError, match="does not support multi-node"):
        InferenceManager(
            "math",
            spec=InferenceEngineSpec(role="teacher", weight_source=STATIC),
            backend=single,
            launch=ModelLaunch(model_path="sim", nodes_per_replica=2, device="cuda"),
            placement=ReplicaPlacement(None, [[(), ()]]),
        )


def test_follower_death_on_a_real_multi_node_cluster() -> None:
    script = Path(__file__).with_name("manager_cluster_check.py")
    proc = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["start"] == {"math/replica-0": "done"}
    # Head and follower run on the two different nodes their bundles were placed on.
    assert out["worker_nodes"] == out["bundle_nodes"]
    assert len(set(out["worker_nodes"])) == 2
    assert out["published"] == ["math/replica-0"]
    assert out["health"] == {"healthy": False, "state": "FAILED"}
    assert out["published_after_death"] == [["math/replica-0", "FAILED", False]]
    assert out["recover"] == {"math/replica-0": "done"}
    assert out["new_pids_alive"] == [True, True] and out["rebuilt_generation"] == 2
    assert out["engines_left"] is False and out["actors_left"] is False
    assert out["group_state"] == "REMOVED"
