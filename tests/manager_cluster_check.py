"""A two-node logical replica on a real multi-node ``ray.cluster_utils.Cluster``.

Run by ``tests/test_manager_multinode.py`` in its own process: a Cluster cannot share a
process with the suite's local Ray. Prints one JSON line with what it observed; every process,
actor and placement group it made is gone before it exits (checked here, reported in the JSON).

The engine is the lightweight multi-node SGLang-protocol server of
``relax_core.bench._sim_engine`` (followers join the head over TCP at ``dist_init_addr``): the
``hf`` backend has no follower mode yet.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from typing import Any


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _wait(predicate: Any, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def main() -> int:
    import ray
    import ray._private.state as ray_state
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group

    from relax_core.bench.manager import SIM_BACKEND
    from relax_core.builtins import STATIC
    from relax_core.engine_spec import InferenceEngineSpec
    from relax_core.manager import InferenceManager, ManagerTimeouts, ModelLaunch, ReplicaPlacement

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "num_gpus": 0})
    for _ in range(2):
        cluster.add_node(num_cpus=1, num_gpus=1)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    out: dict[str, Any] = {}
    try:
        group = placement_group([{"GPU": 1.0, "CPU": 0.01}] * 2, strategy="STRICT_SPREAD")
        ray.get(group.ready(), timeout=60)
        manager = InferenceManager(
            "math",
            spec=InferenceEngineSpec(role="teacher", weight_source=STATIC),
            backend=SIM_BACKEND,
            launch=ModelLaunch(model_path="sim", nodes_per_replica=2),
            placement=ReplicaPlacement(group, [[[0], [1]]], ray_gpu_fraction=1.0, owned=True),
            timeouts=ManagerTimeouts(start=60.0, health=5.0, shutdown=5.0, rpc_margin=3.0),
        )
        out["start"] = {k: str(v) for k, v in manager.start().outcomes.items()}
        workers = manager.workers("math/replica-0")
        out["worker_nodes"] = [w.node_id for w in workers]
        out["bundle_nodes"] = [
            ray.util.placement_group_table(group)["bundles_to_node_id"][b] for b in (0, 1)
        ]
        out["published"] = [e.engine_id for e in manager.model_view().engines]
        pids = manager.engine_pids()["math/replica-0"]
        seen = set(pids)
        actor_ids = {w.actor._actor_id.hex() for w in workers}
        os.kill(pids[1], signal.SIGKILL)  # the follower, on the other node
        _wait(lambda: not _alive(pids[1]), 10)
        report = manager.health_check(recover=False)
        verdict = report.by_engine["math/replica-0"]
        out["health"] = {"healthy": verdict.healthy, "state": verdict.state}
        out["published_after_death"] = [
            (e.engine_id, str(e.state), e.direct_eligible) for e in manager.model_view().engines
        ]
        recovered = manager.recover()
        out["recover"] = {k: str(v) for k, v in recovered.outcomes.items()}
        new = manager.engine_pids()["math/replica-0"]
        seen |= set(new)
        out["new_pids_alive"] = [_alive(p) for p in new]
        out["rebuilt_generation"] = manager.model_view().engines[0].generation
        actor_ids |= {w.actor._actor_id.hex() for w in manager.workers("math/replica-0")}
        manager.shutdown()
        out["engines_left"] = not _wait(lambda: not any(_alive(p) for p in seen), 20)
        out["actors_left"] = not _wait(
            lambda: all(
                a["State"] == "DEAD"
                for a in ray_state.actors().values()
                if a["ActorID"] in actor_ids
            ),
            20,
        )
        out["group_state"] = ray.util.placement_group_table(group)["state"]
    finally:
        ray.shutdown()
        cluster.shutdown()
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
