"""A job's placement groups: one per pool, bound before any manager exists, released at
teardown except those a worker whose cleanup is not confirmed sits on."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from relax_core.config import JobConfig
from relax_core.errors import RelaxError
from relax_core.manager import ReplicaPlacement, UnconfirmedWorker


def bind_pools(plan: Any, *, out: list[Any] | None = None, detach: bool = False) -> dict[str, Any]:
    """Create and bind the placement group ``relax-<pool>`` of every pool of ``plan`` (each
    appended to ``out`` once it exists, a Ctrl-C held until it is; ``detach``: detached); pool
    name -> ``BoundPool``.
    :raises PlacementError: a pool's binding is invalid (its own group is removed)."""
    from relax_core.placement import bind_placement_group

    bound = {}
    for pool in sorted({p.pool for p in plan.placements if p.pool is not None}):
        bound[pool] = bind_placement_group(
            plan,
            pool,
            name=f"relax-{pool}",
            lifetime="detached" if detach else None,
            keep=None if out is None else out.append,
        )
    return bound


def replica_placements(
    config: JobConfig, plan: Any, bound: Mapping[str, Any]
) -> dict[str, dict[str, ReplicaPlacement]]:
    """Role -> model -> the :class:`~relax_core.manager.ReplicaPlacement` of each model on the
    bound pools (a CPU model's: unplaced). Pure."""
    out: dict[str, dict[str, ReplicaPlacement]] = {}
    for role in config.roles:
        for model in role.models:
            mp = plan.model_placement(role.name, model.name)
            if mp.pool is None:
                placement = ReplicaPlacement.unplaced(model.placement.num_engines)
            else:
                placement = ReplicaPlacement.from_bound(
                    bound[mp.pool],
                    role.name,
                    model.name,
                    ray_gpu_fraction=float(mp.ray_gpu_fraction) or 1.0,
                )
            out.setdefault(role.name, {})[model.name] = placement
    return out


def release_pools(
    bound: list[Any],
    unconfirmed: list[UnconfirmedWorker],
    *,
    kept: dict[str, str],
    problems: list[str],
) -> int:
    """Release every bound pool but those an ``unconfirmed`` worker sits on (its engine may
    still hold the GPUs): each kept one goes into ``kept`` (name -> why) and ``problems``
    (what an operator checks), as does a release that failed. Returns the groups released."""
    from relax_core.placement import release_bound_pool

    released = 0
    for pool in bound:
        on_it = [w for w in unconfirmed if w.placement_group_id == _group_hex(pool)]
        if on_it:
            name = f"relax-{pool.pool}"
            kept[name] = "; ".join(w.describe() for w in on_it)
            problems.append(_kept_message(name, pool, on_it))
            continue
        try:
            released += release_bound_pool(pool)
        except RelaxError as exc:
            problems.append(str(exc))
    return released


def _group_hex(bound: Any) -> str | None:
    group = bound.placement_group
    return group.id.hex() if group is not None else None


def _kept_message(name: str, bound: Any, workers: list[UnconfirmedWorker]) -> str:
    """What an operator reads about a placement group teardown kept."""
    pids = sorted({w.engine_pid for w in workers if w.engine_pid is not None})
    nodes = sorted({w.node_ip for w in workers if w.node_ip})
    check = f"engine process(es) {pids}" if pids else "the engine processes"
    return (
        f"placement group {name!r} (pool {bound.pool!r}, id {_group_hex(bound)}) was KEPT, not "
        f"released: {'; '.join(w.describe() for w in workers)}. Its GPUs may still be held by a "
        f"stray engine. Check on node(s) {', '.join(nodes) or '(unknown)'} that {check} and "
        "their process groups are gone and the GPUs are free (nvidia-smi); then remove the "
        f"group (ray.util.remove_placement_group(ray.util.get_placement_group({name!r}))), or "
        "stop the Ray cluster. A local Ray that the job started stops with it, which "
        "releases the group anyway: check before starting the next job on that machine"
    )
