"""Physical binding: probe records checked against the plan (pure), and real Ray groups.

The Ray tests use the session's local Ray with 8 declared GPUs (``ray_local``). The two-node
test needs ``ray.cluster_utils.Cluster``, which cannot start while that local Ray is
initialised in the same process, so it runs this file as a script in a subprocess of its own
(``python tests/test_binding.py cluster``); the script shuts its cluster down in a ``finally``
and the test kills the subprocess's whole process group in a finalizer if it outlives its
deadline.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from relax_core.config import parse_config
from relax_core.errors import PlacementError
from relax_core.placement import (
    BundleProbe,
    InferencePlacementPlan,
    bind_placement_group,
    bundle_order,
    plan_inference_placement,
    release_bound_pool,
    validate_bound_placement,
)
from tests.support.roles import builtin_roles


def make_plan(
    nodes: int, gpn: int, num_gpus: int, gpe: int, *, strategy: str = "PACK", role: str = "rollout"
) -> InferencePlacementPlan:
    """A decoupled plan with one model (``role``.policy) in a pool named after the role."""
    cfg = parse_config(
        {
            "cluster": {"num_nodes": nodes, "gpus_per_node": gpn},
            "placement": {"mode": "decoupled", "pg_strategy": strategy},
            "roles": {
                role: {
                    "models": {
                        "policy": {
                            "backend": "sglang",
                            "model_path": "/models/none",
                            "num_gpus": num_gpus,
                            "gpus_per_engine": gpe,
                            "tp": gpe,
                        }
                    }
                }
            },
        }
    )
    return plan_inference_placement(cfg, builtin_roles())


def probes(
    layout: Sequence[tuple[str, int | None]], indices: Sequence[int] | None = None
) -> list[BundleProbe]:
    """Probe records: bundle ``i`` (or ``indices[i]``) on node ``layout[i][0]``, GPU ``[1]``."""
    idx = list(indices) if indices is not None else list(range(len(layout)))
    return [
        BundleProbe(i, node, f"10.0.0.{ord(node[-1])}", gpu)
        for i, (node, gpu) in zip(idx, layout, strict=True)
    ]


TWO_NODES = [("node-a", g) for g in range(4)] + [("node-b", g) for g in range(4)]


def violations(
    plan: InferencePlacementPlan, pool: str, recs: list[BundleProbe], **kw: Any
) -> list[str]:
    with pytest.raises(PlacementError) as info:
        validate_bound_placement(plan, pool, recs, **kw)
    return list(info.value.violations)


def has(found: list[str], path: str, rule: str) -> str:
    hits = [v for v in found if v.startswith(f"{path}: [{rule}]")]
    assert hits, found
    return hits[0]


# -- pure validation ---------------------------------------------------------------------------


def test_a_cross_node_replica_binds_one_worker_per_node_with_its_gpus() -> None:
    plan = make_plan(2, 4, 8, 8)
    bound = validate_bound_placement(plan, "rollout", probes(TWO_NODES))
    (replica,) = bound.model("rollout", "policy").replicas
    assert [(w.node_id, w.gpu_ids, w.bundles) for w in replica] == [
        ("node-a", (0, 1, 2, 3), (0, 1, 2, 3)),
        ("node-b", (0, 1, 2, 3), (4, 5, 6, 7)),
    ]
    assert replica[0].node_ip == "10.0.0.97" and replica[1].base_gpu_id == 0
    assert bound.order == tuple(range(8)) and not bound.owned


def test_sorted_bundle_order_untangles_interleaved_nodes() -> None:
    layout = [("node-a", 0), ("node-b", 0), ("node-a", 1), ("node-b", 1)] * 2
    layout = [(n, g + (2 if i >= 4 else 0)) for i, (n, g) in enumerate(layout)]
    plan = make_plan(2, 4, 8, 4)
    recs = probes(layout)
    found = violations(plan, "rollout", recs)
    has(found, "roles.rollout.models.policy.replicas[0].workers[0]", "worker-spans-nodes")
    order = bundle_order(recs)
    assert order == (0, 2, 4, 6, 1, 3, 5, 7)
    bound = validate_bound_placement(plan, "rollout", recs, order=order)
    assert [w.bundles for (w,) in bound.model("rollout", "policy").replicas] == [
        (0, 2, 4, 6),
        (1, 3, 5, 7),
    ]


def test_rejects_a_bundle_reported_twice() -> None:
    recs = probes(TWO_NODES) + probes([("node-b", 3)], indices=[7])
    found = violations(make_plan(2, 4, 8, 8), "rollout", recs)
    has(found, "placement_group[rollout].bundle[7]", "duplicate-bundle")


def test_rejects_a_bundle_index_the_group_does_not_have() -> None:
    recs = probes(TWO_NODES) + probes([("node-b", 3)], indices=[8])
    msg = has(
        violations(make_plan(2, 4, 8, 8), "rollout", recs),
        "placement_group[rollout].bundle[8]",
        "unknown-bundle",
    )
    assert "bundles 0-7" in msg


def test_rejects_a_bundle_nobody_probed() -> None:
    found = violations(make_plan(2, 4, 8, 8), "rollout", probes(TWO_NODES)[:7])
    assert "[7]" in has(found, "placement_group[rollout]", "missing-bundle")


def test_rejects_a_slice_outside_a_smaller_borrowed_group() -> None:
    found = violations(make_plan(2, 4, 8, 4), "rollout", probes(TWO_NODES[:6]), bundle_count=6)
    msg = has(found, "roles.rollout.models.policy", "slice-range")
    assert "6 bundles" in msg


def test_rejects_two_bundles_on_one_physical_gpu() -> None:
    layout = [*TWO_NODES[:7], ("node-b", 2)]
    msg = has(
        violations(make_plan(2, 4, 8, 4), "rollout", probes(layout)),
        "placement_group[rollout].bundle[7]",
        "shared-gpu",
    )
    assert "bundles 6 and 7 are both on GPU 2 of node node-b" in msg


def test_rejects_a_worker_whose_gpus_span_nodes() -> None:
    layout = [("node-a", 0), ("node-b", 0)]
    found = violations(make_plan(1, 8, 2, 2), "rollout", probes(layout))
    msg = has(found, "roles.rollout.models.policy.replicas[0].workers[0]", "worker-spans-nodes")
    assert "node-a" in msg and "node-b" in msg


@pytest.mark.parametrize("gpus", [[0, 1, 2, 4], [3, 2, 1, 0]])
def test_rejects_local_gpu_ids_that_are_not_contiguous_and_increasing(gpus: list[int]) -> None:
    found = violations(make_plan(1, 8, 4, 4), "rollout", probes([("node-a", g) for g in gpus]))
    msg = has(found, "roles.rollout.models.policy.replicas[0].workers[0]", "gpu-ids")
    assert str(gpus) in msg


def test_rejects_a_cross_node_replica_that_uses_one_node_twice() -> None:
    layout = [("node-a", g) for g in range(8)]
    found = violations(make_plan(2, 4, 8, 8), "rollout", probes(layout))
    msg = has(found, "roles.rollout.models.policy.replicas[0]", "replica-reuses-node")
    assert "'node-a', 'node-a'" in msg


def test_rejects_a_bundle_without_a_gpu() -> None:
    found = violations(make_plan(1, 8, 2, 2), "rollout", probes([("node-a", 0), ("node-a", None)]))
    has(found, "placement_group[rollout].bundle[1]", "no-gpu")


def test_rejects_an_order_that_is_not_a_permutation() -> None:
    found = violations(
        make_plan(1, 8, 2, 2), "rollout", probes([("node-a", 0), ("node-a", 1)]), order=[0, 0]
    )
    has(found, "placement_group[rollout]", "bundle-order")


def test_every_binding_violation_is_reported_at_once() -> None:
    layout = [("node-a", 0), ("node-a", 0), ("node-b", 5), ("node-a", 2)]
    found = violations(make_plan(1, 8, 4, 2), "rollout", probes(layout))
    rules = {re.search(r": \[([a-z-]+)\]", v).group(1) for v in found}  # type: ignore[union-attr]
    assert rules == {"shared-gpu", "gpu-ids", "worker-spans-nodes"}


# -- real Ray: one node, 8 declared GPUs ------------------------------------------------------


def _pg_state(pg: Any) -> str:
    from ray.util.placement_group import placement_group_table

    return str(placement_group_table(pg)["state"])


@pytest.mark.ray
def test_an_owned_group_binds_the_split_plan_and_is_removed_on_release(ray_local: Any) -> None:
    cfg = parse_config(
        {
            "cluster": {"num_nodes": 1, "gpus_per_node": 8},
            "training": {"actor_gpus": 8, "colocate": True, "offload": True},
            "roles": {
                role: {
                    "models": {
                        "m": {"backend": "sglang", "model_path": "/x", "num_gpus": n, "tp": 2}
                    }
                }
                for role, n in (("rollout", 4), ("genrm", 2), ("teacher", 2))
            },
        }
    )
    plan = plan_inference_placement(cfg, builtin_roles())
    bound = bind_placement_group(plan, "actor", ready_timeout_s=30, probe_timeout_s=60)
    try:
        assert bound.owned and bound.placement_group is not None
        assert len({p.node_id for p in bound.probes}) == 1
        assert sorted(p.gpu_id for p in bound.probes) == list(range(8))
        judge = bound.model("genrm", "m").replicas[0][0]
        assert judge.gpu_ids[1] == judge.gpu_ids[0] + 1 and judge.logical == (4, 5)
    finally:
        assert release_bound_pool(bound) is True
    assert _pg_state(bound.placement_group) == "REMOVED"
    assert release_bound_pool(bound) is True  # idempotent


@pytest.fixture
def gpu_hole(ray_local: Any) -> Iterator[int]:
    """Hold one GPU strictly inside 0..7 (the middle of three held ones) with a one-bundle
    group, so a 7-bundle group gets a hole in its GPU ids. Yields the held id."""
    from ray.util.placement_group import placement_group, remove_placement_group

    from relax_core.placement import probe_placement_group

    blockers = [placement_group([{"GPU": 1.0, "CPU": 0.1}]) for _ in range(3)]
    try:
        held = {}
        for pg in blockers:
            assert pg.wait(timeout_seconds=30)
            held[probe_placement_group(pg, 1, timeout_s=60)[0].gpu_id] = pg
        middle = sorted(held)[1]  # type: ignore[type-var]
        for gpu, pg in held.items():
            if gpu != middle:
                remove_placement_group(pg)
        yield int(middle)  # type: ignore[arg-type]
    finally:
        for pg in blockers:
            remove_placement_group(pg)


@pytest.mark.ray
def test_an_owned_group_that_fails_binding_is_removed(gpu_hole: int) -> None:
    from ray.util.placement_group import placement_group_table

    plan = make_plan(1, 8, 7, 7)
    before = {pg_id for pg_id, row in placement_group_table().items() if row["state"] != "REMOVED"}
    with pytest.raises(PlacementError) as info:
        bind_placement_group(plan, "rollout", ready_timeout_s=30, probe_timeout_s=60)
    assert "roles.rollout.models.policy.replicas[0].workers[0]: [gpu-ids]" in str(info.value)
    expected = [g for g in range(8) if g != gpu_hole]
    assert f"got local GPU ids {expected}" in str(info.value)
    alive = {pg_id for pg_id, row in placement_group_table().items() if row["state"] != "REMOVED"}
    assert alive == before  # the group it created is gone; the blocker is untouched


@pytest.mark.ray
def test_a_ctrl_c_as_ray_hands_back_the_owned_group_removes_it(
    ray_local: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    import importlib

    ray_pg = importlib.import_module("ray.util.placement_group")  # the module, not the function
    real = ray_pg.placement_group
    created = []

    def create_then_ctrl_c(*args: Any, **kwargs: Any) -> Any:
        pg = real(*args, **kwargs)
        created.append(pg)
        signal.raise_signal(signal.SIGINT)  # lands before the caller holds the group
        return pg

    monkeypatch.setattr(ray_pg, "placement_group", create_then_ctrl_c)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            bind_placement_group(
                make_plan(1, 8, 2, 2), "rollout", ready_timeout_s=30, probe_timeout_s=60
            )
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(created) == 1 and _pg_state(created[0]) == "REMOVED"


@pytest.mark.ray
def test_a_borrowed_group_is_never_removed_when_binding_fails(ray_local: Any) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    # Two half-GPU bundles: Ray packs both onto one physical GPU — a real misconfiguration.
    pg = placement_group([{"GPU": 0.5, "CPU": 0.1}] * 2)
    try:
        with pytest.raises(PlacementError) as info:
            bind_placement_group(
                make_plan(1, 8, 2, 2, role="genrm"), "genrm", placement_group=pg, probe_timeout_s=60
            )
        assert "placement_group[genrm].bundle[1]: [shared-gpu]" in str(info.value)
        assert _pg_state(pg) == "CREATED"
    finally:
        remove_placement_group(pg)


@pytest.mark.ray
def test_a_borrowed_group_is_kept_on_release(ray_local: Any) -> None:
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([{"GPU": 1.0, "CPU": 0.1}] * 2)
    try:
        bound = bind_placement_group(
            make_plan(1, 8, 2, 2, role="genrm"), "genrm", placement_group=pg, probe_timeout_s=60
        )
        assert not bound.owned and bound.placement_group is pg
        assert release_bound_pool(bound) is False
        assert _pg_state(pg) == "CREATED"
    finally:
        remove_placement_group(pg)


# -- real Ray: two simulated nodes (subprocess) ------------------------------------------------


@pytest.fixture
def cluster_run() -> Iterator[subprocess.Popen[str]]:
    # As a module from the repository root, so that it imports tests.support like the tests do.
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.placement.test_binding", "cluster"],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.ray
@pytest.mark.slow
def test_two_simulated_nodes_are_told_apart_by_node_id(cluster_run: subprocess.Popen[str]) -> None:
    out, err = cluster_run.communicate(timeout=240)
    assert cluster_run.returncode == 0, err[-4000:]
    result = json.loads(out.strip().splitlines()[-1])
    head, follower = result["replica"]
    assert head["node_id"] != follower["node_id"]  # one replica, one worker per node
    assert head["node_ip"] == follower["node_ip"]  # simulated nodes share the loopback IP
    assert head["gpu_ids"] == [0, 1] and follower["gpu_ids"] == [0, 1]
    assert sorted(head["bundles"] + follower["bundles"]) == [0, 1, 2, 3]
    assert (
        "roles.rollout.models.policy.replicas[0].workers[0]: [worker-spans-nodes]"
        in result["spans_error"]
    )
    assert "[not-ready]" in result["strict_error"]
    assert result["groups_left"] == []


def _cluster_scenario() -> dict[str, Any]:
    """Two nodes of 2 GPUs: bind a 4-GPU replica across them, then two owned failures."""
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group_table

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 2})
    try:
        cluster.add_node(num_cpus=2, num_gpus=2)
        ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
        cluster.wait_for_nodes(timeout=60)
        result: dict[str, Any] = {}
        bound = bind_placement_group(
            make_plan(2, 2, 4, 4), "rollout", ready_timeout_s=60, probe_timeout_s=60
        )
        result["replica"] = [
            {
                "node_id": w.node_id,
                "node_ip": w.node_ip,
                "gpu_ids": list(w.gpu_ids),
                "bundles": list(w.bundles),
            }
            for w in bound.model("rollout", "policy").replicas[0]
        ]
        release_bound_pool(bound)
        # The plan believes in one 4-GPU node; the cluster has two 2-GPU nodes.
        try:
            bind_placement_group(
                make_plan(1, 4, 4, 4), "rollout", ready_timeout_s=60, probe_timeout_s=60
            )
        except PlacementError as exc:
            result["spans_error"] = str(exc)
        try:
            bind_placement_group(
                make_plan(1, 4, 4, 4, strategy="STRICT_PACK"), "rollout", ready_timeout_s=3
            )
        except PlacementError as exc:
            result["strict_error"] = str(exc)
        result["groups_left"] = [
            k for k, row in placement_group_table().items() if row["state"] != "REMOVED"
        ]
        return result
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__" and sys.argv[1:] == ["cluster"]:
    print(json.dumps(_cluster_scenario()), flush=True)
