"""The pure preflight planner: config in, :class:`InferencePlacementPlan` or every violation out
(the rules: docs/placement.md). It reads nothing but model ``config.json`` files."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from relax_core.config import ConfigReader, JobConfig, ModelConfig, hint
from relax_core.errors import PlacementError
from relax_core.placement.budget import budget_memory
from relax_core.placement.modes import Demand, ModeContext, ModeResult, engine_straddles
from relax_core.placement.plan import (
    PHASE_RESIDENT,
    InferencePlacementPlan,
    ModelPlacement,
    Pool,
    Violation,
    Violations,
    phases_conflict,
)
from relax_core.plugins import PluginManager, get_plugin_manager
from relax_core.records import PlacementMode, RoleSpec

#: Default Ray GPU share per bundle: training actor and engine worker in a shared pool.
SHARED_TRAINING_FRACTION = 0.4
SHARED_ENGINE_FRACTION = 0.2
_EPS = 1e-6


@attrs.frozen
class Preflight:
    """The outcome of a preflight: a plan (``None`` when rejected), every violation, notes."""

    plan: InferencePlacementPlan | None
    violations: tuple[Violation, ...]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        """No violation."""
        return not self.violations


def plan_inference_placement(
    config: JobConfig, plugin_manager: PluginManager | None = None
) -> InferencePlacementPlan:
    """Plan every inference model of ``config``; pure apart from reading model ``config.json``.

    :param plugin_manager: where placement modes, roles and weight sources come from (default:
        the process-wide :func:`~relax_core.plugins.get_plugin_manager`).
    :raises PlacementError: with every violation (``path: [rule] message``), not just the first."""
    result = preflight(config, plugin_manager)
    if result.plan is None:
        raise PlacementError([str(v) for v in result.violations])
    return result.plan


class _Planner:
    def __init__(self, config: JobConfig, pm: PluginManager) -> None:
        self.config = config
        self.pm = pm
        self.gpn = config.cluster.gpus_per_node
        self.violations = Violations()
        self.notes: list[str] = []
        self.role_specs: dict[str, RoleSpec] = {
            name: reg.record for name, reg in pm.registered("roles").items()
        }

    # -- per model and per role ------------------------------------------------------------

    def weight_source(self, m: ModelConfig) -> str:
        if m.weight_source is not None:
            return m.weight_source
        spec = self.role_specs.get(m.role)
        # An unknown role is a violation already; STATIC lets the memory checks run too.
        return spec.default_weight_source if spec is not None else "STATIC"

    def cpu_backup(self, m: ModelConfig) -> bool:
        """Whether ``m``'s engines keep a CPU copy of its weights (as its weight source says)."""
        ws = self.pm.registered("weight_sources").get(self.weight_source(m))
        asked = m.engine.weights_cpu_backup  # an unregistered source is a violation already
        return bool(asked) if ws is None else ws.record.cpu_backup(m.engine.offload_weights, asked)

    def keeps_graphs(self, m: ModelConfig) -> bool:
        """Whether ``m``'s backend keeps its CUDA graphs on the GPU while it sleeps."""
        found = self.pm.registered("engine_backends").get(m.backend or "")
        backend = found.record if found is not None else None
        if backend is None or backend.keeps_graphs is None:
            return False
        if not m.engine_device.startswith("cuda"):
            return False
        table, options = m.engine_table, backend.options
        read = ConfigReader().record(table, "", options) if table and options else None
        return bool(backend.keeps_graphs(read, m.engine.extra_args))

    def check_model(self, m: ModelConfig) -> bool:
        """Per-model rules; ``True`` when the model can be sliced."""
        p = m.path
        sources = self.pm.registered("weight_sources")
        if m.weight_source is not None and m.weight_source not in sources:
            self.violations.add(
                f"{p}.weight_source",
                "weight-source",
                f"{m.weight_source!r} is not a registered weight source (known: "
                f"{', '.join(sorted(sources))}); install the plugin that provides it",
            )
        spec = self.role_specs.get(m.role)
        if spec is not None and self.weight_source(m) not in spec.allowed_weight_sources:
            self.violations.add(
                f"{p}.weight_source",
                "weight-source",
                f"role {m.role!r} allows weight sources {sorted(spec.allowed_weight_sources)}, "
                f"not {self.weight_source(m)!r}",
            )
        if m.engine.weights_cpu_backup is False and self.cpu_backup(m):
            why = f"weight source {self.weight_source(m)!r} cannot bring back released weights"
            self.violations.add(
                f"{p}.weights_cpu_backup",
                "weight-source",
                f"{why}, so its models keep a CPU copy; remove weights_cpu_backup = false, or set "
                "offload_weights = false to keep them on the GPU while the model sleeps",
            )
        if m.device != "cuda":
            return False
        sliceable = True
        size, engine = m.placement, m.engine
        if size.tp * size.pp != size.gpus_per_engine:
            self.violations.add(
                f"{p}.tp",
                "tp-pp",
                f"tp {size.tp} x pp {size.pp} = {size.tp * size.pp}, but gpus_per_engine = "
                f"{size.gpus_per_engine}; an engine's GPUs are exactly its tp x pp ranks",
            )
        if size.num_gpus % size.gpus_per_engine:
            sliceable = False
            self.violations.add(
                f"{p}.num_gpus",
                "divisibility",
                f"num_gpus {size.num_gpus} is not a multiple of gpus_per_engine "
                f"{size.gpus_per_engine}; the model would get "
                f"{size.num_gpus / size.gpus_per_engine:g} engines",
            )
        if engine.dp > 1 and not engine.dp_attention:
            self.violations.add(
                f"{p}.dp",
                "dp-attention",
                f"dp = {engine.dp} needs dp_attention = true; for more replicas raise num_gpus",
            )
        elif engine.dp_attention and engine.dp < 2:
            self.violations.add(f"{p}.dp", "dp-attention", "dp_attention = true needs dp >= 2")
        elif engine.dp_attention and size.tp % engine.dp:
            self.violations.add(
                f"{p}.dp",
                "dp-attention",
                f"with dp_attention, tp {size.tp} must be divisible by dp {engine.dp}",
            )
        gpe = size.gpus_per_engine
        if self.gpn > 0 and gpe > self.gpn and gpe % self.gpn:
            sliceable = False
            self.violations.add(
                f"{p}.gpus_per_engine",
                "whole-nodes",
                f"an engine of {gpe} GPUs spans nodes of {self.gpn} GPUs "
                f"(cluster.gpus_per_node); a cross-node engine must use whole nodes, "
                f"a multiple of {self.gpn} GPUs",
            )
        return sliceable

    def check_roles(self) -> None:
        policies = self.pm.registered("routing_policies")
        for role in self.config.roles:
            gpu_models = [m for m in role.models if m.device == "cuda"]
            used = sum(m.placement.num_gpus for m in gpu_models)
            if role.num_gpus is not None and used != role.num_gpus:
                parts = " + ".join(f"{m.name} {m.placement.num_gpus}" for m in gpu_models) or "none"
                self.violations.add(
                    f"roles.{role.name}.num_gpus",
                    "role-budget",
                    f"role {role.name!r} has a budget of {role.num_gpus} GPUs but its models use "
                    f"{used} ({parts}); make them add up",
                )
            if role.policy is not None and role.policy not in policies:
                self.violations.add(
                    f"roles.{role.name}.policy",
                    "policy",
                    f"{role.policy!r} is not a registered routing policy (known: "
                    f"{', '.join(sorted(policies)) or 'none'})",
                )
            if role.name not in self.role_specs:
                known = sorted(self.role_specs)
                self.violations.add(
                    f"roles.{role.name}",
                    "unknown-role",
                    f"no installed plugin registers the role {role.name!r}{hint(role.name, known)}"
                    f" (registered: {', '.join(known) or 'none'}); install the role's plugin "
                    "or check RELAX_LOAD_PLUGINS / RELAX_DISABLE_PLUGINS",
                )

    def check_mode(self, mode: PlacementMode) -> None:
        t, placement = self.config.training, self.config.placement
        if t.colocate is not None and t.colocate != mode.shares_training_pool:
            shared = mode.shares_training_pool
            where = "places inference inside" if shared else "keeps inference out of"
            self.violations.add(
                "training.colocate",
                "colocate-mode",
                f"placement.mode = {mode.name!r} {where} the actor pool; set training.colocate "
                f"= {'true' if shared else 'false'} or pick another mode",
            )
        if mode.shares_training_pool and not t.offload:
            self.violations.add(
                "training.offload",
                "offload-required",
                f"placement.mode = {mode.name!r} shares the actor pool's GPUs with inference, "
                "so training must offload between phases; set training.offload = true",
            )
        if placement.defer_roles and not mode.supports_defer:
            self.violations.add(
                "placement.defer_roles",
                "defer-mode",
                f"placement.mode = {mode.name!r} does not run deferred phases; use mode = "
                "'defer' or drop defer_roles",
            )
        deferrable = sorted(name for name, spec in self.role_specs.items() if spec.deferrable)
        for i, role in enumerate(placement.defer_roles):
            spec = self.role_specs.get(role)
            if spec is not None and not spec.deferrable:  # unregistered: unknown-role says it
                self.violations.add(
                    f"placement.defer_roles[{i}]",
                    "defer-role",
                    f"role {role!r} cannot be deferred; only roles whose plugin makes them "
                    f"deferrable can be listed (installed: {', '.join(deferrable) or 'none'})",
                )

    # -- slices ----------------------------------------------------------------------------

    def demands(self, sliceable: dict[str, bool]) -> tuple[Demand, ...]:
        deferred = set(self.config.placement.defer_roles)
        generation = {name for name, spec in self.role_specs.items() if spec.generation_phase}
        return tuple(
            Demand(
                m.role,
                m.name,
                m.path,
                m.placement.num_gpus,
                m.placement.gpus_per_engine,
                m.placement.bundle_start,
                deferred=m.role in deferred,
                generation_phase=m.role in generation,
            )
            for m in self.config.models()
            if sliceable.get(m.path)
        )

    def pools(self, mode: PlacementMode, result: ModeResult) -> dict[str, Pool]:
        t, c = self.config.training, self.config.cluster
        bundles: dict[str, Any] = {
            "cpus_per_bundle": c.cpus_per_bundle,
            "strategy": self.config.placement.pg_strategy,
        }
        pools: dict[str, Pool] = {}
        for name, size in t.pools():
            shared = name == "actor" and mode.shares_training_pool
            default = SHARED_TRAINING_FRACTION if shared else 1.0
            pools[name] = Pool(
                name,
                size,
                self.gpn,
                training=(name,),
                inference=shared,
                training_ray_gpu_fraction=t.ray_gpu_fraction or default,
                **bundles,
            )
        for req in result.pools:
            if req.name in pools:
                self.violations.add(
                    "placement.mode",
                    "mode-error",
                    f"mode {mode.name!r} created pool {req.name!r} twice or over a training pool",
                )
                continue
            if req.size > 0:
                pools[req.name] = Pool(req.name, req.size, self.gpn, **bundles)
        return pools

    def placement(
        self, m: ModelConfig, pool: Pool | None, start: int | None, phase: str
    ) -> ModelPlacement:
        """``m`` on ``pool`` from bundle ``start`` (a CPU model: no pool, empty replicas)."""
        size = m.placement
        num_gpus, gpe, fraction = 0, 0, 0.0
        replicas: tuple[tuple[int, ...], ...] = ((),) * size.num_engines
        workers: tuple[tuple[tuple[int, ...], ...], ...] = ((),) * size.num_engines
        if pool is not None and start is not None:
            num_gpus, gpe = size.num_gpus, size.gpus_per_engine
            replicas = tuple(tuple(range(s, s + gpe)) for s in range(start, start + num_gpus, gpe))
            workers = tuple(_split_by_node(r, self.gpn) for r in replicas)
            fraction = size.ray_gpu_fraction or (SHARED_ENGINE_FRACTION if pool.shared else 1.0)
        return ModelPlacement(
            m.role,
            m.name,
            m.path,
            pool.name if pool is not None else None,
            start,
            num_gpus,
            gpe,
            size.tp,
            size.pp,
            phase,
            device=m.device,
            ray_gpu_fraction=fraction,
            replicas=replicas,
            workers=workers,
        )

    def check_slices(self, placements: Sequence[ModelPlacement], pools: dict[str, Pool]) -> None:
        t = self.config.training
        by_pool: dict[str, list[ModelPlacement]] = {}
        for p in placements:
            if p.pool is not None:
                by_pool.setdefault(p.pool, []).append(p)
        for name, group in by_pool.items():
            pool = pools[name]
            for p in group:
                start = p.bundle_start or 0
                if p.bundle_end > pool.size:
                    fixed = self.config.role(p.role).model(p.model).placement.bundle_start
                    where = "num_gpus" if fixed is None else "bundle_start"
                    owner = (
                        f"the actor pool's {pool.size} bundles (training.actor_gpus = "
                        f"{t.actor_gpus}); split and defer slices must lie inside the actor pool"
                        if pool.training
                        else f"pool {name!r} ({pool.size} bundles)"
                    )
                    self.violations.add(
                        f"{p.path}.{where}",
                        "pool-bounds",
                        f"slice {start}-{p.bundle_end - 1} ends past {owner}",
                    )
                if engine_straddles(start, p.num_gpus, p.gpus_per_engine, self.gpn):
                    self.violations.add(
                        f"{p.path}.bundle_start",
                        "node-boundary",
                        f"slice {start}-{p.bundle_end - 1} puts an engine of "
                        f"{p.gpus_per_engine} GPUs across a node boundary (nodes of {self.gpn} "
                        "bundles); an engine must sit inside one node, or start on a node "
                        "boundary and cover whole nodes",
                    )
            self._check_overlap(name, group)
            self._check_fractions(pool, group)

    def _check_overlap(self, pool: str, group: list[ModelPlacement]) -> None:
        ordered = sorted(group, key=lambda p: p.bundle_start or 0)
        for i, a in enumerate(ordered):
            for b in ordered[i + 1 :]:
                if (b.bundle_start or 0) >= a.bundle_end:
                    break
                if not phases_conflict(a.phase, b.phase):
                    continue
                lo, hi = b.bundle_start or 0, min(a.bundle_end, b.bundle_end)
                phase = a.phase if a.phase != PHASE_RESIDENT else b.phase
                self.violations.add(
                    f"{b.path}.bundle_start",
                    "co-residence",
                    f"bundles {lo}-{hi - 1} of pool {pool!r} are used by both {a.path} "
                    f"({a.bundle_start}-{a.bundle_end - 1}) and {b.path} ({b.bundle_start}-"
                    f"{b.bundle_end - 1}) in phase {phase!r}; same-phase co-residence is "
                    "not allowed: give them disjoint bundles (drop or change bundle_start); to "
                    "time-share GPUs list deferrable roles in placement.defer_roles with mode = "
                    "'defer'",
                )

    def _check_fractions(self, pool: Pool, group: list[ModelPlacement]) -> None:
        heads: dict[int, list[ModelPlacement]] = {}
        for p in group:
            for replica in p.workers:
                for worker in replica:
                    heads.setdefault(worker[0], []).append(p)
        base = pool.training_ray_gpu_fraction * len(pool.training)
        seen: set[tuple[str, ...]] = set()
        for bundle in sorted(heads):
            users = heads[bundle]
            total, key = base + sum(p.ray_gpu_fraction for p in users), tuple(p.key for p in users)
            if total <= 1 + _EPS or key in seen:
                continue
            seen.add(key)
            parts = [f"training {r} {pool.training_ray_gpu_fraction:g}" for r in pool.training]
            parts += [f"{p.path} {p.ray_gpu_fraction:g}" for p in users]
            self.violations.add(
                f"{users[-1].path}.ray_gpu_fraction",
                "ray-gpu-fraction",
                f"bundle {bundle} of pool {pool.name!r} would reserve {total:g} Ray GPUs "
                f"({' + '.join(parts)}) but a bundle holds 1 GPU; lower ray_gpu_fraction "
                "(training.ray_gpu_fraction for the actor)",
            )

    # -- the cluster -----------------------------------------------------------------------

    def pack(self, pools: dict[str, Pool]) -> dict[str, Pool]:
        """Check the GPU budget and pack each pool's nodes onto cluster nodes."""
        c = self.config.cluster
        total = sum(p.size for p in pools.values())
        if not pools:
            return pools
        if total > c.total_gpus:
            parts = ", ".join(f"{p.name} {p.size}" for p in pools.values())
            self.violations.add(
                "cluster",
                "gpu-budget",
                f"the job needs {total} GPUs (pools: {parts}) but the cluster has "
                f"{c.total_gpus} (cluster.num_nodes {c.num_nodes} x cluster.gpus_per_node "
                f"{c.gpus_per_node}); add nodes or lower num_gpus",
            )
            return pools
        free = [self.gpn] * c.num_nodes
        nodes: dict[str, list[int]] = {}
        cursor = 0
        for p in pools.values():
            nodes[p.name] = []
            for _ in range(p.size // self.gpn):
                while free[cursor] != self.gpn:
                    cursor += 1
                free[cursor] = 0
                nodes[p.name].append(cursor)
        pieces = sorted(
            ((p.size % self.gpn, p.name) for p in pools.values() if p.size % self.gpn),
            key=lambda x: -x[0],
        )
        for size, name in pieces:
            node = next((i for i, f in enumerate(free) if f >= size), None)
            if node is None:
                need = ", ".join(f"{n} {s}" for s, n in pieces)
                self.violations.add(
                    "cluster",
                    "node-fit",
                    f"the pools cannot be laid out on {c.num_nodes} nodes of {self.gpn} GPUs: "
                    f"no node has {size} free GPUs left for the rest of pool {name!r} (partial "
                    f"nodes needed: {need}); a pool's partial node stays on one node. Resize "
                    "the pools to whole nodes or add a node",
                )
                return pools
            free[node] -= size
            nodes[name].append(node)
        return {n: attrs.evolve(p, nodes=tuple(nodes[n])) for n, p in pools.items()}

    # -- the whole run ---------------------------------------------------------------------

    def run(self) -> Preflight:
        cfg = self.config
        modes = self.pm.registered("placement_modes")
        mode_name = cfg.placement.resolved_mode(cfg.training)
        mode: PlacementMode | None = modes[mode_name].record if mode_name in modes else None
        if mode is None:
            self.violations.add(
                "placement.mode",
                "unknown-mode",
                f"{mode_name!r} is not a registered placement mode{hint(mode_name, modes)} "
                f"(known: {', '.join(sorted(modes))})",
            )
        sliceable = {m.path: self.check_model(m) for m in cfg.models()}
        if self.gpn == 0 and any(m.device == "cuda" for m in cfg.models()):
            self.violations.add(
                "cluster.gpus_per_node",
                "gpu-budget",
                "GPU models are configured but cluster.gpus_per_node is 0; set it, or use "
                "device = 'cpu' models",
            )
            sliceable = {}
        self.check_roles()
        if mode is None:
            return Preflight(None, tuple(self.violations), tuple(self.notes))
        self.check_mode(mode)
        demands = self.demands(sliceable)
        actor = cfg.training.actor_gpus
        ctx = ModeContext(cfg, demands, self.gpn, "actor" if actor > 0 else None, actor)
        result = self._assign(mode, ctx)
        self.violations += result.violations
        pools = self.pools(mode, result)
        placements = self._placements(mode, result, demands, pools)
        self.check_slices(placements, pools)
        pools = self.pack(pools)
        memory, host, mem_violations, mem_notes = budget_memory(
            cfg,
            placements,
            pools,
            {f"{m.role}.{m.name}" for m in cfg.models() if self.cpu_backup(m)},
            {f"{m.role}.{m.name}" for m in cfg.models() if self.keeps_graphs(m)},
        )
        self.violations += mem_violations
        self.notes += mem_notes
        if self.violations:
            return Preflight(None, tuple(self.violations), tuple(self.notes))
        plan = InferencePlacementPlan(
            mode=mode.name,
            num_nodes=cfg.cluster.num_nodes,
            gpus_per_node=self.gpn,
            pools=tuple(pools.values()),
            placements=tuple(placements),
            phases=tuple(result.phases),
            memory=tuple(memory),
            host_memory=tuple(host),
            notes=tuple(self.notes),
        )
        return Preflight(plan, (), tuple(self.notes))

    def _assign(self, mode: PlacementMode, ctx: ModeContext) -> ModeResult:
        try:
            result = mode.assign(ctx)
        except Exception as exc:  # a third-party mode's bug must not look like a config error
            problem = f"failed: {type(exc).__name__}: {exc}"
        else:
            if isinstance(result, ModeResult):
                return result
            problem = f"returned {type(result).__name__}, not ModeResult"
        self.violations.add(
            "placement.mode", "mode-error", f"placement mode {mode.name!r} {problem}"
        )
        return ModeResult()

    def _placements(
        self,
        mode: PlacementMode,
        result: ModeResult,
        demands: Sequence[Demand],
        pools: dict[str, Pool],
    ) -> list[ModelPlacement]:
        cfg = self.config
        by_key = {(s.role, s.model): s for s in result.slices}
        out: list[ModelPlacement] = []
        for d in demands:
            s = by_key.get((d.role, d.model))
            if s is None or s.pool not in pools:
                if not result.violations:
                    self.violations.add(
                        d.path,
                        "mode-error",
                        f"placement mode {mode.name!r} gave no valid slice for this model",
                    )
                continue
            out.append(
                self.placement(
                    cfg.role(d.role).model(d.model), pools[s.pool], s.bundle_start, s.phase
                )
            )
        out += [
            self.placement(m, None, None, PHASE_RESIDENT)
            for m in cfg.models()
            if m.device != "cuda"
        ]
        return out


def _split_by_node(bundles: tuple[int, ...], gpn: int) -> tuple[tuple[int, ...], ...]:
    if gpn <= 0:
        return (bundles,)
    groups: list[list[int]] = []
    for b in bundles:
        if groups and groups[-1][-1] // gpn == b // gpn:
            groups[-1].append(b)
        else:
            groups.append([b])
    return tuple(tuple(g) for g in groups)


def preflight(config: JobConfig, plugin_manager: PluginManager | None = None) -> Preflight:
    """Like :func:`plan_inference_placement`, but returns the violations instead of raising."""
    return _Planner(config, plugin_manager or get_plugin_manager()).run()
