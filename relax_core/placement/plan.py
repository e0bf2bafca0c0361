"""The placement plan: immutable records the planner returns, round-tripping through JSON."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import attrs

from relax_core.errors import ConfigProblem

#: The phase of a placement that stays resident through every inference phase.
PHASE_RESIDENT = "resident"


@attrs.frozen
class Violation(ConfigProblem):
    """One broken placement rule (a ``ConfigProblem`` of its own type)."""


class Violations(list[Violation]):
    """Violations being collected, :meth:`add` one at a time."""

    def add(self, path: str, rule: str, message: str) -> None:
        """Collect one violation."""
        self.append(Violation(path, rule, message))


def phases_conflict(a: str, b: str) -> bool:
    """Whether placements in phases ``a`` and ``b`` are on their GPUs at the same time."""
    return a == b or PHASE_RESIDENT in (a, b)


@attrs.frozen
class Pool:
    """A set of GPU bundles that becomes one Ray placement group. Bundle ``i`` sits on pool-local
    node ``i // gpus_per_node``, packed onto cluster node ``nodes[i // gpus_per_node]``;
    ``training``: its training roles, each reserving ``training_ray_gpu_fraction`` of a bundle."""

    name: str
    size: int
    gpus_per_node: int
    training: tuple[str, ...] = ()
    inference: bool = True
    nodes: tuple[int, ...] = ()
    cpus_per_bundle: float = 1.0
    strategy: str = "PACK"
    training_ray_gpu_fraction: float = 0.0

    @property
    def shared(self) -> bool:
        """Training and inference both use this pool."""
        return bool(self.training) and self.inference

    def bundle_specs(self) -> tuple[dict[str, float], ...]:
        """The Ray placement-group bundles: one GPU (and ``cpus_per_bundle`` CPUs) each."""
        spec = {"GPU": 1.0, "CPU": float(self.cpus_per_bundle)}
        return tuple(dict(spec) for _ in range(self.size))

    def local_node(self, bundle: int) -> int:
        """The pool-local node of ``bundle``."""
        return bundle // self.gpus_per_node if self.gpus_per_node else 0


@attrs.frozen
class ModelPlacement:
    """Where one model of one role runs: ``replicas[i]`` the bundles of engine ``i``;
    ``workers[i]`` those split by pool-local node, head first (one engine worker each, on its
    first bundle). A ``cpu`` model has no pool and one empty tuple per engine."""

    role: str
    model: str
    path: str
    pool: str | None
    bundle_start: int | None
    num_gpus: int
    gpus_per_engine: int
    tp: int
    pp: int
    phase: str
    device: str = "cuda"
    ray_gpu_fraction: float = 0.0
    replicas: tuple[tuple[int, ...], ...] = ()
    workers: tuple[tuple[tuple[int, ...], ...], ...] = ()

    @property
    def bundle_end(self) -> int:
        """One past the last bundle of the slice."""
        return (self.bundle_start or 0) + self.num_gpus

    @property
    def num_engines(self) -> int:
        """Logical replicas."""
        return len(self.replicas)

    @property
    def nodes_per_engine(self) -> int:
        """Pool-local nodes each replica spans (1 unless the engine is cross-node)."""
        return len(self.workers[0]) if self.workers else 0

    @property
    def key(self) -> str:
        """``role.model``."""
        return f"{self.role}.{self.model}"


@attrs.frozen
class MemoryItem:
    """One user of memory in a budget line, in GiB; ``kept``: another's, kept resident while
    this one runs (training's, or the weights of a model that keeps them while it sleeps)."""

    label: str
    gib: float
    kept: bool = False


class _ItemTotal:
    __slots__ = ()
    items: tuple[MemoryItem, ...]

    @property
    def total_gib(self) -> float:
        """The sum of every item (per GPU in a :class:`MemoryBudget`, per node in a host one)."""
        return sum(i.gib for i in self.items)


@attrs.frozen
class MemoryBudget(_ItemTotal):
    """The per-GPU memory budget of one placement over ``bundles`` of ``pool``: ``status``
    ``ok``, ``over`` (a violation was reported) or ``skipped`` (``note`` says why)."""

    role: str
    model: str
    pool: str | None
    phase: str
    bundles: tuple[int, int]
    status: str
    capacity_gib: float | None = None
    items: tuple[MemoryItem, ...] = ()
    note: str = ""


@attrs.frozen
class HostMemoryBudget(_ItemTotal):
    """Host memory of one or more cluster nodes that carry the same load."""

    nodes: tuple[int, ...]
    status: str
    capacity_gib: float | None = None
    items: tuple[MemoryItem, ...] = ()
    note: str = ""


def _tuples(value: Any) -> Any:
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _build(cls: type[Any], data: Mapping[str, Any]) -> Any:
    names = {f.name for f in attrs.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in names:
            continue
        if key in _NESTED:
            kwargs[key] = tuple(_build(_NESTED[key], v) for v in value)
        else:
            kwargs[key] = _tuples(value)
    return cls(**kwargs)


@attrs.frozen
class InferencePlacementPlan:
    """The whole placement of a job, computed before any actor, router or engine exists."""

    mode: str
    num_nodes: int
    gpus_per_node: int
    pools: tuple[Pool, ...]
    placements: tuple[ModelPlacement, ...]
    phases: tuple[str, ...] = (PHASE_RESIDENT,)
    memory: tuple[MemoryBudget, ...] = ()
    host_memory: tuple[HostMemoryBudget, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def total_gpus(self) -> int:
        """GPUs the job reserves: the bundles of every pool."""
        return sum(p.size for p in self.pools)

    @property
    def cluster_gpus(self) -> int:
        """GPUs the cluster has."""
        return self.num_nodes * self.gpus_per_node

    def model_placement(self, role: str, model: str) -> ModelPlacement:
        """The placement of ``model`` of ``role``; :class:`KeyError` naming the known ones."""
        for p in self.placements:
            if p.role == role and p.model == model:
                return p
        known = ", ".join(p.key for p in self.placements)
        raise KeyError(f"the plan has no model {role}.{model}; it has: {known}")

    def pool(self, name: str) -> Pool:
        """The pool called ``name``; :class:`KeyError` naming the known ones."""
        for p in self.pools:
            if p.name == name:
                return p
        raise KeyError(f"the plan has no pool {name!r}; pools: {[p.name for p in self.pools]}")

    def bundle_specs(self, pool: str) -> tuple[dict[str, float], ...]:
        """The placement-group bundle specs of ``pool``."""
        return self.pool(pool).bundle_specs()

    def placements_in(self, pool: str) -> tuple[ModelPlacement, ...]:
        """The placements whose slices lie in ``pool``, by phase (in run order), then start."""
        rank = {phase: i for i, phase in enumerate(self.phases)}
        found = [p for p in self.placements if p.pool == pool]
        return tuple(
            sorted(found, key=lambda p: (rank.get(p.phase, 0), p.bundle_start or 0, p.role))
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``total_gpus`` and ``cluster_gpus`` included for readers)."""
        out: dict[str, Any] = json.loads(json.dumps(attrs.asdict(self)))
        out["total_gpus"] = self.total_gpus
        out["cluster_gpus"] = self.cluster_gpus
        out["placements"] = [
            {**d, "bundle_end": p.bundle_end, "num_engines": p.num_engines}
            for d, p in zip(out["placements"], self.placements, strict=True)
        ]
        return out

    def to_json(self, **kwargs: Any) -> str:
        """:meth:`to_dict` as JSON text."""
        return json.dumps(self.to_dict(), **kwargs)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> InferencePlacementPlan:
        """Rebuild a plan from :meth:`to_dict` output (derived keys are ignored)."""
        plan: InferencePlacementPlan = _build(cls, data)
        return plan


#: The fields :func:`_build` rebuilds as tuples of records.
_NESTED: dict[str, type[Any]] = {
    "pools": Pool,
    "placements": ModelPlacement,
    "memory": MemoryBudget,
    "host_memory": HostMemoryBudget,
    "items": MemoryItem,
}
