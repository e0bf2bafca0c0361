"""Physical binding: once a placement group is ready, probe where its bundles really are and
map the plan's logical bundles onto them (:func:`validate_bound_placement`, pure)."""

from __future__ import annotations

import itertools
import signal
import threading
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from relax_core.errors import LifecycleError, PlacementError
from relax_core.placement.plan import InferencePlacementPlan, Violations

#: The GPU share a probe task asks for: enough to be given the bundle's GPU id, small enough
#: to fit beside training actors that already hold part of a borrowed bundle.
PROBE_GPU_FRACTION = 0.01


@attrs.frozen
class BundleProbe:
    """What a probe saw on one bundle (``gpu_id`` ``None``: the bundle has no GPU)."""

    bundle_index: int
    node_id: str
    node_ip: str
    gpu_id: int | None


@attrs.frozen
class BoundWorker:
    """One engine worker's bundles: ``bundles`` physical (schedule on ``bundles[0]``),
    ``logical`` the plan's, ``gpu_ids`` the local GPU ids (contiguous, increasing)."""

    logical: tuple[int, ...]
    bundles: tuple[int, ...]
    node_id: str
    node_ip: str
    gpu_ids: tuple[int, ...]

    @property
    def base_gpu_id(self) -> int:
        """The first local GPU id (SGLang's ``base_gpu_id``)."""
        return self.gpu_ids[0]


@attrs.frozen
class BoundModel:
    """A model's replicas bound to real workers: ``replicas[i][k]`` is node ``k`` of replica
    ``i`` (``k = 0`` is the head, whose IP is the replica's ``dist_init_addr`` host)."""

    role: str
    model: str
    replicas: tuple[tuple[BoundWorker, ...], ...]


@attrs.frozen
class BoundPool:
    """A validated placement group for one pool: ``order[i]`` the physical bundle of logical
    bundle ``i``; ``owned``: :func:`release_bound_pool` removes the group."""

    pool: str
    owned: bool
    order: tuple[int, ...]
    probes: tuple[BundleProbe, ...]
    models: tuple[BoundModel, ...]
    placement_group: Any = attrs.field(default=None, eq=False, repr=False)

    def model(self, role: str, model: str) -> BoundModel:
        """The bound model; :class:`KeyError` naming the known ones."""
        for m in self.models:
            if m.role == role and m.model == model:
                return m
        known = [f"{m.role}.{m.model}" for m in self.models]
        raise KeyError(f"pool {self.pool!r} binds no model {role}.{model}; it binds {known}")


def bundle_order(probes: Sequence[BundleProbe]) -> tuple[int, ...]:
    """Logical → physical bundle order: nodes in order of their first bundle, then by GPU id."""
    first: dict[str, int] = {}
    for p in sorted(probes, key=lambda p: p.bundle_index):
        first.setdefault(p.node_id, p.bundle_index)
    ranked = sorted(
        probes,
        key=lambda p: (first[p.node_id], p.gpu_id if p.gpu_id is not None else -1, p.bundle_index),
    )
    return tuple(p.bundle_index for p in ranked)


def _check_probes(
    pool: str, probes: Sequence[BundleProbe], bundle_count: int, v: Violations
) -> dict[int, BundleProbe]:
    where = f"placement_group[{pool}]"
    by_index: dict[int, BundleProbe] = {}
    gpus: dict[tuple[str, int], int] = {}
    for p in probes:
        path = f"{where}.bundle[{p.bundle_index}]"
        if not 0 <= p.bundle_index < bundle_count:
            v.add(
                path,
                "unknown-bundle",
                f"a probe reports bundle {p.bundle_index} but the group has bundles "
                f"0-{bundle_count - 1}",
            )
            continue
        if p.bundle_index in by_index:
            v.add(
                path,
                "duplicate-bundle",
                f"bundle {p.bundle_index} was reported twice (nodes "
                f"{by_index[p.bundle_index].node_id} and {p.node_id})",
            )
            continue
        by_index[p.bundle_index] = p
        if p.gpu_id is None:
            v.add(
                path,
                "no-gpu",
                f"bundle {p.bundle_index} on node {p.node_id} ({p.node_ip}) has no GPU",
            )
            continue
        other = gpus.setdefault((p.node_id, p.gpu_id), p.bundle_index)
        if other != p.bundle_index:
            v.add(
                path,
                "shared-gpu",
                f"bundles {other} and {p.bundle_index} are both on GPU {p.gpu_id} of node "
                f"{p.node_id} ({p.node_ip}); each bundle needs a GPU of its own",
            )
    missing = sorted(set(range(bundle_count)) - set(by_index))
    if missing:
        v.add(where, "missing-bundle", f"no probe reported bundle(s) {missing}")
    return by_index


def validate_bound_placement(
    plan: InferencePlacementPlan,
    pool: str,
    probes: Sequence[BundleProbe],
    *,
    bundle_count: int | None = None,
    order: Sequence[int] | None = None,
) -> BoundPool:
    """Check the probes of ``pool``'s placement group against the plan (pure).

    :param bundle_count: bundles of the real group (default: the pool's size); a borrowed
        group may be larger than the pool, never smaller.
    :param order: logical → physical bundle indices (default: identity).
    :returns: the bound pool (``owned`` ``False``; :func:`bind_placement_group` sets it).
    :raises PlacementError: with every violation."""
    spec = plan.pool(pool)
    count = spec.size if bundle_count is None else bundle_count
    v = Violations()
    by_index = _check_probes(pool, probes, count, v)
    phys = tuple(order) if order is not None else tuple(range(count))
    if sorted(phys) != list(range(len(phys))) or len(phys) < min(count, spec.size):
        v.add(
            f"placement_group[{pool}]",
            "bundle-order",
            f"the bundle order {list(phys)[:16]} is not a permutation of the group's "
            f"{count} bundles",
        )
        phys = tuple(range(count))
    models = []
    for p in plan.placements_in(pool):
        if p.bundle_end > count:
            v.add(
                p.path,
                "slice-range",
                f"slice {p.bundle_start}-{p.bundle_end - 1} lies outside the placement "
                f"group's {count} bundles",
            )
            continue
        replicas = []
        for r, replica in enumerate(p.workers):
            bound = []
            for k, logical in enumerate(replica):
                found = [by_index.get(phys[b]) for b in logical]
                seen = [x for x in found if x is not None]
                if len(seen) != len(found):
                    continue  # reported as missing/unknown above
                where = f"{p.path}.replicas[{r}].workers[{k}]"
                nodes = sorted({x.node_id for x in seen})
                if len(nodes) > 1:
                    v.add(
                        where,
                        "worker-spans-nodes",
                        f"logical bundles {list(logical)} land on nodes {nodes}; one "
                        "worker's GPUs must be on one node",
                    )
                    continue
                ids = [x.gpu_id for x in seen]
                gpu_ids = [i for i in ids if i is not None]
                if len(gpu_ids) == len(ids) and any(
                    b != a + 1 for a, b in itertools.pairwise(gpu_ids)
                ):
                    v.add(
                        where,
                        "gpu-ids",
                        f"logical bundles {list(logical)} got local GPU ids {ids} on node "
                        f"{nodes[0]}; they must be contiguous and increasing",
                    )
                    continue
                bound.append(
                    BoundWorker(
                        tuple(logical),
                        tuple(phys[b] for b in logical),
                        seen[0].node_id,
                        seen[0].node_ip,
                        tuple(gpu_ids),
                    )
                )
            used = [w.node_id for w in bound]
            if len(set(used)) != len(used):
                v.add(
                    f"{p.path}.replicas[{r}]",
                    "replica-reuses-node",
                    f"the workers of replica {r} (bundles {list(p.replicas[r])}) use "
                    f"node(s) {used}; a cross-node replica needs a different node per worker",
                )
            replicas.append(tuple(bound))
        models.append(BoundModel(p.role, p.model, tuple(replicas)))
    if v:
        raise PlacementError([str(x) for x in v])
    ordered = tuple(sorted(probes, key=lambda p: p.bundle_index))
    return BoundPool(pool, False, phys, ordered, tuple(models))


def _probe() -> tuple[str, str, list[str]]:
    import ray

    ctx = ray.get_runtime_context()
    ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return ctx.get_node_id(), ip, [str(g) for g in ray.get_gpu_ids()]


def probe_placement_group(
    pg: Any, bundle_count: int, *, timeout_s: float = 60.0, pool: str = ""
) -> tuple[BundleProbe, ...]:
    """Run one probe task on every bundle of ``pg``; blocks up to ``timeout_s``.

    :raises PlacementError: a probe did not finish in time (its bundle's GPU may be fully
        reserved) or failed."""
    import ray
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    task = ray.remote(num_cpus=0, num_gpus=PROBE_GPU_FRACTION, max_retries=0)(_probe)
    refs = [
        task.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
        ).remote()
        for i in range(bundle_count)
    ]
    _, pending = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    if pending:
        for ref in pending:
            ray.cancel(ref, force=True)
        late = [i for i, ref in enumerate(refs) if ref in set(pending)]
        raise PlacementError(
            [
                f"placement_group[{pool}]: [probe-timeout] probes of bundle(s) {late} did not run "
                f"within {timeout_s:g}s; is each bundle's GPU already fully reserved?"
            ]
        )
    probes = []
    for i, ref in enumerate(refs):
        try:
            node_id, node_ip, gpu_ids = ray.get(ref)
        except ray.exceptions.RayError as exc:
            raise PlacementError(
                [f"placement_group[{pool}].bundle[{i}]: [probe-failed] {exc}"]
            ) from exc
        gpu = int(gpu_ids[0]) if gpu_ids and str(gpu_ids[0]).isdigit() else None
        probes.append(BundleProbe(i, node_id, node_ip, gpu))
    return tuple(probes)


class _HeldSignals:
    """SIGINT and SIGTERM held (recorded, not handled) from construction until
    :meth:`release`, which gives the handlers back and raises the first one held. Only the main
    thread runs signal handlers; elsewhere this does nothing."""

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self._previous: dict[int, Any] = {}
        self._pending: int | None = None
        self.hold()

    def hold(self) -> None:
        if threading.current_thread() is not threading.main_thread() or self._previous:
            return
        for sig in self._SIGNALS:
            self._previous[sig] = signal.signal(sig, self._record)

    def release(self) -> None:
        previous, self._previous = self._previous, {}
        for sig, handler in previous.items():
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        pending, self._pending = self._pending, None
        if pending is not None:
            signal.raise_signal(pending)

    def _record(self, signum: int, frame: Any) -> None:
        if self._pending is None:
            self._pending = signum


def _remove(pg: Any, error: BaseException) -> None:
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(pg)
    except Exception as exc:
        raise LifecycleError(
            f"binding failed ({error}) and removing the owned placement group {pg.id.hex()} "
            f"failed too: {exc}; remove it by hand (ray.util.remove_placement_group)"
        ) from error


def bind_placement_group(
    plan: InferencePlacementPlan,
    pool: str,
    *,
    placement_group: Any = None,
    order: str | Sequence[int] = "sorted",
    name: str = "",
    ready_timeout_s: float = 60.0,
    probe_timeout_s: float = 60.0,
    lifetime: str | None = None,
    keep: Callable[[BoundPool], object] | None = None,
) -> BoundPool:
    """Create (or borrow) ``pool``'s placement group, probe every bundle, validate the binding.

    :param placement_group: a group owned by someone else (the trainer's actor pool), never
        removed here; ``None``: create one from the plan and own it.
    :param order: ``"sorted"`` (:func:`bundle_order`), ``"identity"``, or an explicit logical →
        physical index list.
    :param lifetime: Ray's lifetime of a group created here (``"detached"``: it outlives the
        driver until removed).
    :param keep: called with the bound pool before it is returned (the caller's record of what
        to release). SIGINT and SIGTERM are held from the group's creation until the ``try``
        that removes it on failure, and around ``keep``: a Ctrl-C cannot leave an owned group
        that no one removes.
    :raises PlacementError: not ready in time, a probe failed, or the binding is invalid (an
        owned group is removed by then).
    :raises LifecycleError: the owned group could not be removed after a failure."""
    import ray
    from ray.util.placement_group import placement_group as create

    spec = plan.pool(pool)
    owned = placement_group is None
    held = _HeldSignals()
    try:
        pg = (
            create(list(spec.bundle_specs()), strategy=spec.strategy, name=name, lifetime=lifetime)
            if owned
            else placement_group
        )
    except BaseException:
        held.release()
        raise
    try:
        held.release()  # a signal that came while the group was created lands here
        if not pg.wait(timeout_seconds=ready_timeout_s):
            specs = spec.bundle_specs()
            free_gpus = ray.available_resources().get("GPU", 0)  # type: ignore[no-untyped-call]
            raise PlacementError(
                [
                    f"placement_group[{pool}]: [not-ready] {len(specs)} bundles of "
                    f"{specs[0] if specs else {}} were not reserved within {ready_timeout_s:g}s "
                    f"(strategy {spec.strategy}); the cluster has {free_gpus:g} GPUs free"
                ]
            )
        count = pg.bundle_count
        probes = probe_placement_group(pg, count, timeout_s=probe_timeout_s, pool=pool)
        if order == "sorted":
            phys: Sequence[int] | None = bundle_order(probes)
        elif order == "identity":
            phys = None
        elif isinstance(order, str):
            raise PlacementError(
                [
                    f"placement_group[{pool}]: [bundle-order] unknown order {order!r}; use "
                    "'sorted', 'identity' or a list"
                ]
            )
        else:
            phys = order
        bound = attrs.evolve(
            validate_bound_placement(plan, pool, probes, bundle_count=count, order=phys),
            owned=owned,
            placement_group=pg,
        )
        held.hold()
    except BaseException as exc:
        if owned:
            _remove(pg, exc)
        raise
    try:
        if keep is not None:
            keep(bound)
    finally:
        held.release()  # after the record: the caller's teardown releases the group
    return bound


def release_bound_pool(bound: BoundPool) -> bool:
    """Remove the group if this pool owns it; a borrowed group is left alone.

    :returns: whether a group was removed. Idempotent.
    :raises LifecycleError: removing an owned group failed (retry, or remove it by hand)."""
    if not bound.owned or bound.placement_group is None:
        return False
    from ray.util.placement_group import remove_placement_group

    try:
        remove_placement_group(bound.placement_group)
    except Exception as exc:
        raise LifecycleError(
            f"removing the placement group of pool {bound.pool!r} failed: {exc}"
        ) from exc
    return True
