"""A two-node logical replica on a real multi-node ``ray.cluster_utils.Cluster``.

Run by ``tests/manager/test_manager_multinode_cluster.py`` in its own process: a Cluster cannot
share a process with the suite's local Ray. Prints one JSON line with what it observed; every
process, actor and placement group it made is gone before it exits (checked here, reported in
the JSON).

The engines are real ``hf`` engines on a tiny model made here: the head (node rank 0) on one
node serves ``/generate``; the follower (node rank 1) on the other joins the head's gloo node
group at the ``dist_init_addr`` the manager hands out and mirrors every step.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import urllib.error
import urllib.request
from typing import Any

from tests.support.cluster import wait
from tests.support.serve import alive


def _http(method: str, url: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            text, status = resp.read().decode(), resp.status
    except urllib.error.HTTPError as exc:
        text, status = exc.read().decode(), exc.code
    try:
        return status, json.loads(text) if text else None
    except ValueError:
        return status, text


def _generate(url: str) -> tuple[int, Any]:
    sampling = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    return _http("POST", url + "/generate", {"text": "hello", "sampling_params": sampling})


def main() -> int:
    import ray
    import ray._private.state as ray_state
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group
    from relax_hf.tiny import make_tiny_model

    from relax_core.builtins import STATIC
    from relax_core.engine.spec import InferenceEngineSpec
    from relax_core.manager import InferenceManager, ManagerTimeouts, ModelLaunch, ReplicaPlacement
    from relax_core.plugins import PluginManager
    from relax_core.records import EngineOptions

    root = tempfile.mkdtemp(prefix="relax-cluster-check-")
    model = str(make_tiny_model(os.path.join(root, "model"), size="micro"))

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
            backend=PluginManager.create().engine_backend("hf"),
            launch=ModelLaunch(
                model_path=model,
                nodes_per_replica=2,
                served_model_name="math",
                options=EngineOptions(env={"OMP_NUM_THREADS": "1"}),
            ),
            placement=ReplicaPlacement(group, [[[0], [1]]], ray_gpu_fraction=1.0, owned=True),
            timeouts=ManagerTimeouts(start=120.0, health=10.0, shutdown=10.0, rpc_margin=3.0),
        )
        out["start"] = {k: str(v) for k, v in manager.start().outcomes.items()}
        workers = manager.workers("math/replica-0")
        out["worker_nodes"] = [w.node_id for w in workers]
        out["bundle_nodes"] = [
            ray.util.placement_group_table(group)["bundles_to_node_id"][b] for b in (0, 1)
        ]
        out["published"] = [e.engine_id for e in manager.model_view().engines]
        url = manager.model_view().engines[0].base_url
        status, body = _generate(url)
        out["generate"] = {
            "status": status,
            "completion_tokens": body["meta_info"]["completion_tokens"] if status == 200 else None,
        }
        nodes = _http("GET", url + "/server_info")[1]["nodes"]
        out["head_followers"] = [f["pid"] for f in nodes["followers"]]
        out["diverged_tokens"] = nodes["diverged_tokens"]
        pids = manager.engine_pids()["math/replica-0"]
        out["follower_pid"] = pids[1]
        seen = set(pids)
        actor_ids = {w.actor._actor_id.hex() for w in workers}
        os.kill(pids[1], signal.SIGKILL)  # the follower, on the other node
        wait(lambda: not alive(pids[1]), 10)
        wait(lambda: _http("GET", url + "/health_generate")[0] != 200, 30)
        out["head_health_generate_after_death"] = _http("GET", url + "/health_generate")[0]
        # The follower's death fails the replica (its worker sees its process gone); across two
        # simulated nodes of one busy machine that can take a round more to be seen, so up to
        # the manager's unhealthy_after rounds are allowed (the in-process multi-node test
        # checks the first round).
        for _ in range(3):
            report = manager.health_check(recover=False)
            verdict = report.by_engine["math/replica-0"]
            if verdict.state == "FAILED":
                break
        out["health"] = {"healthy": verdict.healthy, "state": verdict.state}
        out["health_report"] = [verdict.action, list(verdict.problems)]
        out["published_after_death"] = [
            (e.engine_id, str(e.state), e.direct_eligible) for e in manager.model_view().engines
        ]
        recovered = manager.recover()
        out["recover"] = {k: str(v) for k, v in recovered.outcomes.items()}
        new = manager.engine_pids()["math/replica-0"]
        seen |= set(new)
        out["new_pids_alive"] = [alive(p) for p in new]
        out["rebuilt_generation"] = manager.model_view().engines[0].generation
        out["generate_after_recover"] = _generate(manager.model_view().engines[0].base_url)[0]
        actor_ids |= {w.actor._actor_id.hex() for w in manager.workers("math/replica-0")}
        manager.shutdown()
        out["engines_left"] = not wait(lambda: not any(alive(p) for p in seen), 20)
        out["actors_left"] = not wait(
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
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
