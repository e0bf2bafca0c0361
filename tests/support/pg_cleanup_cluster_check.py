"""An owned placement group whose removal the GCS really does not confirm, on a Ray cluster of
its own.

Run by ``tests/manager/test_manager_faults.py`` in its own process, as ``python -m
tests.support.pg_cleanup_cluster_check GCS_PID_FILE``: the GCS it stops must be one that no
other test (nor anything else on the machine) uses, so this process starts a
``ray.cluster_utils.Cluster`` (its own GCS, raylet and session directory) and stops that
cluster's ``gcs_server``, found by the pid the cluster reports for it (written to GCS_PID_FILE
first), never by name.

A one-replica manager of the test plugin's simulated engine runs on an owned placement group.
Its ``shutdown()`` stops the workers (that needs the GCS); at the moment it asks Ray to remove
the group, the GCS is stopped with SIGSTOP, so Ray's request cannot be answered and the
removal is not confirmed. The GCS is continued, and ``shutdown()`` is called again. Prints one
JSON line with what it observed; the GCS is continued and the cluster torn down whatever
happens (``finally``).

``RAY_gcs_server_request_timeout_seconds`` (set here, before Ray is imported) bounds how long
Ray's own synchronous GCS request waits, so the stopped GCS costs seconds, not Ray's default
minute; it stays far below the time after which Ray's processes give up on a silent GCS.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from typing import Any

from tests.support.cluster import wait

#: Seconds Ray's removal request waits for the stopped GCS before it raises.
GCS_REQUEST_TIMEOUT = 5


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().decode().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def main() -> int:
    # Ray reads its settings from RAY_<name> environment variables, in the name's own case.
    os.environ["RAY_gcs_server_request_timeout_seconds"] = str(GCS_REQUEST_TIMEOUT)  # noqa: SIM112
    import ray
    import ray.util
    from ray._private import ray_constants
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group

    from relax_core.builtins import STATIC
    from relax_core.engine.spec import InferenceEngineSpec
    from relax_core.errors import LifecycleError
    from relax_core.manager import InferenceManager, ManagerTimeouts, ModelLaunch, ReplicaPlacement
    from relax_core.plugins import PluginManager

    root = tempfile.mkdtemp(prefix="relax-pg-check-")
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "num_gpus": 1, "temp_dir": root},
    )
    (gcs,) = cluster.head_node.all_processes[ray_constants.PROCESS_TYPE_GCS_SERVER]
    gcs_pid = gcs.process.pid
    # Written first, so the caller can continue this GCS if it kills this process while the
    # GCS is stopped.
    with open(sys.argv[1], "w") as f:
        f.write(str(gcs_pid))
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    out: dict[str, Any] = {"gcs_pid": gcs_pid}
    stopped: list[float] = []
    removals: list[str] = []
    real_remove = ray.util.remove_placement_group
    try:
        group = placement_group([{"GPU": 1.0, "CPU": 0.01}], strategy="PACK")
        ray.get(group.ready(), timeout=60)
        manager = InferenceManager(
            "judge",
            spec=InferenceEngineSpec(role="genrm", weight_source=STATIC),
            backend=PluginManager.create().engine_backend("test-sim"),
            launch=ModelLaunch(model_path="sim", served_model_name="judge"),
            placement=ReplicaPlacement(group, [[[0]]], ray_gpu_fraction=1.0, owned=True),
            timeouts=ManagerTimeouts(start=120.0, health=10.0, shutdown=20.0, rpc_margin=3.0),
        )
        out["start"] = {k: str(v) for k, v in manager.start().outcomes.items()}
        engines = [p for pids in manager.engine_pids().values() for p in pids if p]

        def stop_the_gcs_then_remove(pg: Any) -> None:
            # Only the moment of the fault is chosen here: the workers are stopped by now (that
            # needs the GCS), and Ray's real removal meets the stopped GCS.
            removals.append(pg.id.hex())
            if not stopped:
                os.kill(gcs_pid, signal.SIGSTOP)
                stopped.append(time.monotonic())
                wait(lambda: _state(gcs_pid) == "T", 10, every=0.01)
                out["gcs_state_when_removing"] = _state(gcs_pid)
            real_remove(pg)

        ray.util.remove_placement_group = stop_the_gcs_then_remove
        try:
            manager.shutdown()
            out["first_shutdown"] = "returned"
        except LifecycleError as exc:
            out["first_shutdown"] = f"LifecycleError: {exc}"
        finally:
            os.kill(gcs_pid, signal.SIGCONT)
        out["removals_after_first"] = len(removals)
        out["engines_alive_after_first"] = [_state(p) not in ("Z", "X", "gone") for p in engines]
        try:
            manager.shutdown()
            out["second_shutdown"] = "returned"
        except LifecycleError as exc:
            out["second_shutdown"] = f"LifecycleError: {exc}"
        # The group the second shutdown() removed is the one the first left pending.
        out["removed_twice_the_same_group"] = removals == [group.id.hex()] * 2
        out["group_state"] = ray.util.placement_group_table(group)["state"]
    finally:
        if stopped:
            os.kill(gcs_pid, signal.SIGCONT)
        ray.util.remove_placement_group = real_remove
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    out["gcs_left"] = _state(gcs_pid) not in ("Z", "X", "gone")
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
