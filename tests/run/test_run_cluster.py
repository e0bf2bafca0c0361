"""One step of ``relax run`` on a real two-node ``ray.cluster_utils.Cluster`` (in a subprocess:
a Cluster cannot share a process with the suite's local Ray): rollout on one node, genrm and
teacher deferred on the other node's declared GPU, the batch committed, trained on and the
weights pushed back across the nodes, nothing left."""

from __future__ import annotations

import pytest

from tests.support import cluster

# The parts are covered in the default session on real multi-node clusters:
# tests/manager/test_manager_multinode_cluster.py (a two-node hf replica, its recovery) and
# tests/placement/test_binding.py (nodes told apart); this is the whole run across two nodes.
pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.e2e]


def test_one_step_runs_with_rollout_on_one_node_and_the_deferred_roles_on_the_other() -> None:
    out = cluster.run_check("run_cluster_check")
    assert out["problems"] == [] and "error" not in out, out
    assert out["steps_committed"] == 1 and out["failure"] is None, out
    assert out["samples"] == [4] and out["fields"] == [
        dict.fromkeys(("reward", "rewards", "teacher_logprobs"), 4)
    ]
    # The first step's weights reached rollout on the other node: its version moved.
    assert out["weight_versions"] == ["default", "1"]
    nodes = out["worker_nodes"]
    assert nodes == out["bundle_nodes"], out  # every engine ran where its bundle was bound
    rollout, genrm, teacher = (nodes[k] for k in ("rollout.policy", "genrm.judge", "teacher.math"))
    assert genrm == teacher and rollout != genrm, nodes
    assert out["head"] not in {*rollout, *genrm}  # both on the GPU nodes, not the head
    # genrm and teacher share one defer slice; rollout's GPU is its own.
    slices = out["slices"]
    assert slices["genrm"] == slices["teacher"] != slices["rollout"]
    assert out["teardown_problems"] == [] and out["processes_left"] == []
    assert out["processes"] == 4  # three engines and the rollout router
