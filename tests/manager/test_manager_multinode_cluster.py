"""A two-node hf replica on a real multi-node ``ray.cluster_utils.Cluster`` (in a subprocess: a
Cluster cannot share a process with the suite's local Ray): head and follower on the two nodes
their bundles were placed on, only the head published, the follower's death failing the whole
replica, its rebuild, and nothing left. The same replica on bundles of the local Ray standing
in for nodes is ``tests/manager/test_manager_multinode.py``'s."""

from __future__ import annotations

import pytest

from tests.support import cluster

pytestmark = pytest.mark.ray


def test_a_two_node_hf_replica_on_a_real_multi_node_cluster() -> None:
    out = cluster.run_check("manager_cluster_check")
    assert out["start"] == {"math/replica-0": "done"}
    # Head and follower run on the two different nodes their bundles were placed on.
    assert out["worker_nodes"] == out["bundle_nodes"]
    assert len(set(out["worker_nodes"])) == 2
    assert out["published"] == ["math/replica-0"]
    generated = out["generate"]
    assert generated["status"] == 200 and generated["completion_tokens"] == 6
    assert out["head_followers"] == [out["follower_pid"]] and out["diverged_tokens"] == 0
    assert out["health"] == {"healthy": False, "state": "FAILED"}, out.get("health_report")
    assert out["head_health_generate_after_death"] == 503
    assert out["published_after_death"] == [["math/replica-0", "FAILED", False]]
    assert out["recover"] == {"math/replica-0": "done"}
    assert out["new_pids_alive"] == [True, True] and out["rebuilt_generation"] == 2
    assert out["generate_after_recover"] == 200
    assert out["engines_left"] is False and out["actors_left"] is False
    assert out["group_state"] == "REMOVED"
