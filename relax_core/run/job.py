"""What ``relax run`` brings up on Ray, in order, and takes down again.

Everything is checked before anything starts (:func:`run_problems`: the job as ``relax serve``
checks it, the ``[run]`` table against the job, the defer preflight filled from the table).
Then :class:`RunJob`:

1. placement groups of the plan's pools, created and bound (as ``relax serve``);
2. one registry actor per role (:func:`~relax_core.discovery.actor.start_registry_actor`):
   every model of the role publishes into its one schema-2 snapshot;
3. one manager actor per model (:func:`~relax_core.manager.actor.start_manager_actor`,
   CPU-only, named ``relax-manager-<job>-<role>-<model>``), the router of an
   ``SGLANG_ROUTER`` model inside its actor; engines start phase by phase as in ``relax
   serve`` (each deferred phase started, then put to SLEEPING, before the next; then the
   others, awake);
4. the trainer actor (:func:`~relax_core.run.trainer.start_trainer`, on the training share
   of the pool it shares with inference), built while the engines start;
5. the coordinator actor (:func:`~relax_core.coordination.start_coordinator`: the defer
   slices of the plan, the deferred roles' manager actors) and the batch sink
   (:class:`~relax_core.coordination.RayBatchSink`, named ``relax-batches-<job>``).

:meth:`RunJob.teardown` stops it all (trainer, coordinator, sink, managers — engines and
routers with them —, registries, placement groups) and checks that every engine and router
process it saw is gone.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from relax_core.config import ConfigProblem, JobConfig, ModelConfig
from relax_core.coordination.preflight import DeferredWorkload, deferred_workload_problems
from relax_core.coordination.remote import NAMESPACE
from relax_core.coordination.slices import defer_slices
from relax_core.errors import LifecycleError, RelaxError
from relax_core.manager import ManagerTimeouts
from relax_core.plugins import PluginManager
from relax_core.run.config import RunConfig

__all__ = ["RunJob", "generation_role", "run_problems"]

Say = Callable[[str], None]


def generation_role(config: JobConfig, pm: PluginManager) -> str | None:
    """The configured role that generates the training batch (``generation_phase``), if one
    is; ``None`` when none or several are."""
    found = [r.name for r in config.roles if pm.role(r.name).generation_phase]
    return found[0] if len(found) == 1 else None


def run_problems(config: JobConfig, run: RunConfig, pm: PluginManager) -> list[str]:
    """Every reason ``relax run`` cannot run ``config`` with ``run``, as ``key.path: [rule]
    message`` lines; empty when it can. Pure: starts nothing.

    The job's own checks (:func:`relax_core.service.check_job`), then the ``[run]`` table
    against the job: one generation role with one local, updatable model; the reward and
    teacher roles configured; the reward adapters registered; the trainer importable; and, in
    a defer layout, :func:`~relax_core.coordination.deferred_workload_problems` filled from
    the table (the preflight's key paths are ``run.*``).
    """
    from relax_core.run.trainer import load_trainer_class
    from relax_core.service import check_job

    problems = list(check_job(config, pm))
    if problems:
        return problems
    out: list[ConfigProblem] = []
    roles = set(config.role_names)
    gen = generation_role(config, pm)
    if gen is None:
        out.append(
            ConfigProblem(
                "roles",
                "generation-role",
                "relax run needs exactly one configured role that generates the batch (a role "
                "whose RoleSpec has generation_phase, like rollout); configured: "
                f"{', '.join(config.role_names) or 'none'}",
            )
        )
    else:
        out += _generation_problems(config.role(gen).models, pm)
    for key in ("reward_role", "teacher_role"):
        role = getattr(run, key)
        if role is not None and role not in roles:
            out.append(
                ConfigProblem(
                    f"run.{key}",
                    "reference",
                    f"role {role!r} is not configured under [roles] (configured: "
                    f"{', '.join(sorted(roles))})",
                )
            )
        elif role is not None and role == gen:
            out.append(
                ConfigProblem(
                    f"run.{key}",
                    "generation-role",
                    f"{role!r} generates the batch; a scoring stage runs on another role",
                )
            )
    defer = tuple(r for r in config.placement.defer_roles if r in roles)
    registered = pm.registered("reward_adapters")
    if not defer:
        for i, reward in enumerate(run.rewards):
            if reward.adapter not in registered:
                out.append(
                    ConfigProblem(
                        f"run.rewards[{i}]",
                        "plugin",
                        f"no reward adapter {reward.adapter!r} is registered (registered: "
                        f"{', '.join(sorted(registered)) or 'none'}); install its plugin",
                    )
                )
        for key in ("partial_rollout", "dynamic_batch", "filter_hooks", "eval_dataset"):
            if getattr(run, key):
                out.append(
                    ConfigProblem(f"run.{key}", "unsupported", "relax run does not implement it")
                )
    else:
        workload = DeferredWorkload(
            defer_roles=defer,
            generation_models=config.role(gen).model_names if gen else (),
            reward_adapters=tuple(r.adapter for r in run.rewards),
            reward_role=run.reward_role,
            reward_models=config.role(run.reward_role).model_names
            if run.reward_role in roles
            else (),
            partial_rollout=run.partial_rollout,
            dynamic_batch=run.dynamic_batch,
            filter_hooks=run.filter_hooks,
            eval_data=run.eval_dataset is not None,
            paths={
                "reward_adapters": "run.rewards",
                "eval_data": "run.eval_dataset",
                "defer_roles": "placement.defer_roles",
                "generation_models": f"roles.{gen}.models",
                "reward_models": f"roles.{run.reward_role}.models",
            },
        )
        out += deferred_workload_problems(workload, pm)
        out += _slice_problems(config, pm, defer)
    try:
        load_trainer_class(run.trainer)
    except RelaxError as exc:
        out.append(ConfigProblem("run.trainer", "trainer", getattr(exc, "message", str(exc))))
    return [str(p) for p in out]


def _generation_problems(models: tuple[ModelConfig, ...], pm: PluginManager) -> list[ConfigProblem]:
    out: list[ConfigProblem] = []
    for m in models:
        source = pm.weight_source(m.weight_source or pm.role(m.role).default_weight_source)
        if "tensor" not in source.update_paths:
            out.append(
                ConfigProblem(
                    f"{m.path}.weight_source",
                    "weights",
                    f"{source.name} weights take no tensor update, so the trainer cannot push "
                    'its weights; set weight_source = "ACTOR"',
                )
            )
        if m.external:
            out.append(
                ConfigProblem(
                    f"{m.path}.external_urls",
                    "external",
                    "the policy's engines must be managed: the trainer pushes weights through "
                    "their manager",
                )
            )
        if not Path(m.model_path).is_dir():
            continue  # the job preflight reports a missing model directory
        for name in ("config.json", "tokenizer.json"):
            if not (Path(m.model_path) / name).is_file():
                out.append(
                    ConfigProblem(
                        f"{m.path}.model_path",
                        "model-dir",
                        f"no {name} in {m.model_path!r}: the trainer loads the policy's "
                        "checkpoint and relax run tokenizes prompts with its tokenizer, so it "
                        "must be a local model directory (a relative path is relative to the "
                        "job file)",
                    )
                )
    return out


def _slice_problems(config: JobConfig, pm: PluginManager, defer: tuple[str, ...]) -> list[Any]:
    from relax_core.placement import plan_inference_placement

    slices = defer_slices(plan_inference_placement(config, pm))
    return [
        ConfigProblem(
            f"placement.defer_roles[{config.placement.defer_roles.index(role)}]",
            "defer-slice",
            f"role {role!r} is deferred but shares no GPU with another phase (its models have "
            "no GPU bundles in a deferred phase); place it on the generation role's GPUs",
        )
        for role in defer
        if role not in slices
    ]


def _timeouts(run: RunConfig) -> ManagerTimeouts:
    """The managers' deadlines: lifecycle calls follow the coordinator's deadline, so a hung
    engine's manager gives up about when the coordinator does."""
    op = run.operation_timeout
    return ManagerTimeouts(
        start=600.0,
        offload=op,
        onload=op,
        drain=min(30.0, op / 2),
        update=600.0,
        health=15.0,
        shutdown=10.0,
    )


@attrs.define(eq=False)
class RunJob:
    """The actors, engines and placement groups of one ``relax run`` (see the module
    docstring). ``name`` is the job's name (actor names, ``relax coordinator --job``).

    :raises ValueError: the job has no generation role (:func:`run_problems` says so first).
    """

    config: JobConfig
    run: RunConfig
    pm: PluginManager
    name: str = attrs.field(kw_only=True)
    log_dir: str | None = attrs.field(default=None, kw_only=True)
    generation_role: str = attrs.field(init=False)
    generation_model: ModelConfig = attrs.field(init=False)
    plan: Any = attrs.field(default=None, init=False)
    bound: list[Any] = attrs.field(factory=list, init=False)
    registries: dict[str, Any] = attrs.field(factory=dict, init=False)
    #: role -> model -> manager actor
    actors: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)
    coordinator: Any = attrs.field(default=None, init=False)
    sink: Any = attrs.field(default=None, init=False)
    trainer: Any = attrs.field(default=None, init=False)
    slices: dict[str, str] = attrs.field(factory=dict, init=False)
    engine_pids: set[int] = attrs.field(factory=set, init=False)
    router_pids: set[int] = attrs.field(factory=set, init=False)
    began: float = attrs.field(factory=time.monotonic, init=False)

    def __attrs_post_init__(self) -> None:
        gen = generation_role(self.config, self.pm)
        if gen is None:
            raise ValueError("no generation role: run run_problems() first")
        self.generation_role = gen
        self.generation_model = self.config.role(gen).models[0]

    @property
    def rollout_actor(self) -> Any:
        """The generation model's manager actor."""
        return self.actors[self.generation_role][self.generation_model.name]

    @property
    def leased(self) -> tuple[str, ...]:
        """The roles the coordinator leases besides the generation role."""
        return tuple(r for r in self.slices if r != self.generation_role)

    def _say(self, say: Say, text: str) -> None:
        say(f"  [{time.monotonic() - self.began:5.1f}s] {text}")

    # -- start ---------------------------------------------------------------------------

    def start(self, say: Say) -> None:
        """Bring everything up (see the module docstring); ``say`` gets one line per event.

        :raises PlacementError: the binding failed. :raises LifecycleError: an engine, router
            or the trainer did not start (call :meth:`teardown` in every case).
        """
        from relax_core.discovery.actor import start_registry_actor
        from relax_core.placement import plan_inference_placement
        from relax_core.service import bind_pools, replica_placements, routing_spec

        self.began = time.monotonic()
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
        self.plan = plan = plan_inference_placement(self.config, self.pm)
        pools = len({p.pool for p in plan.placements if p.pool is not None})
        actors = sum(len(role.models) for role in self.config.roles)
        self._say(
            say,
            f"placing: {pools} placement group(s), {len(self.config.roles)} registry and "
            f"{actors} manager actor(s), the coordinator and the trainer …",
        )
        bound = bind_pools(plan, out=self.bound)
        placements = replica_placements(self.config, plan, bound)
        sources = sorted(self.pm.registered("weight_sources"))
        for role in self.config.roles:
            self.registries[role.name] = start_registry_actor(
                role.name,
                routing_spec(role),
                name=f"relax-registry-{self.name}-{role.name}",
                namespace=NAMESPACE,
                weight_sources=sources,
            )
        for role in self.config.roles:
            for model in role.models:
                self.actors.setdefault(role.name, {})[model.name] = self._manager_actor(
                    model, placements[role.name][model.name]
                )
        self._start_coordination()
        trainer_error: list[BaseException] = []
        builder = threading.Thread(
            target=self._start_trainer, args=(bound, trainer_error), name="trainer", daemon=True
        )
        builder.start()
        try:
            self._start_engines(say)
        finally:
            builder.join()
        if trainer_error:
            raise trainer_error[0]
        self._say(say, f"trainer ready ({self.run.trainer}, on {self.run.trainer_device})")

    def _manager_actor(self, model: ModelConfig, placement: Any) -> Any:
        from relax_core.manager.actor import manager_actor_name, start_manager_actor
        from relax_core.service import manager_arguments, router_launch_spec, router_record

        kwargs = manager_arguments(
            model, self.pm, placement=placement, timeouts=_timeouts(self.run), log_dir=self.log_dir
        )
        if kwargs["route_mode"] != "DIRECT":
            record = router_record(model, self.pm.role(model.role), self.pm)
            kwargs.update(
                router_backend=record, router_spec=router_launch_spec(model, record, self.log_dir)
            )
        import ray

        try:
            return start_manager_actor(
                model.name,
                name=manager_actor_name(self.name, model.role, model.name),
                namespace=NAMESPACE,
                publisher=self.registries[model.role],
                **kwargs,
            )
        except ray.exceptions.RayActorError as exc:
            raise LifecycleError(
                f"{model.path}: its manager actor did not start: {_last_line(exc)}"
            ) from None

    def _start_trainer(self, bound: dict[str, Any], errors: list[BaseException]) -> None:
        from relax_core.run.trainer import TrainerContext, start_trainer

        run = self.run
        group, bundle, gpus = None, 0, 1.0 if run.trainer_device.startswith("cuda") else 0.0
        for pool in self.plan.pools:
            if "actor" in pool.training and pool.name in bound:
                # The training share of a pool shared with inference: the trainer sees its GPU.
                b = bound[pool.name]
                group, gpus = b.placement_group, pool.training_ray_gpu_fraction
                bundle = b.order[0] if b.order else 0
        context = TrainerContext(
            job=self.name,
            model_path=self.generation_model.model_path,
            coordinator=self.coordinator,
            sink=self.sink,
            rollout=self.rollout_actor,
            device=run.trainer_device,
            learning_rate=run.learning_rate,
            clip=run.clip,
            distill_coef=run.distill_coef if run.teacher_role else 0.0,
            teacher_mode=run.teacher_mode if run.teacher_role else None,
            seed=run.seed,
            push_format=run.push_format,
        )
        try:
            self.trainer = start_trainer(
                context,
                trainer=run.trainer,
                placement_group=group,
                bundle_index=bundle,
                num_gpus=gpus,
            )
        except BaseException as exc:  # re-raised by start(), after the engines' start ended
            errors.append(exc)

    def _start_engines(self, say: Say) -> None:
        import ray

        from relax_core.service import start_order

        steps = start_order(self.config, self.plan) or [(tuple(self.actors), False)]
        for roles, sleep in steps:
            names = [f"{r}.{m}" for r in roles for m in self.actors[r]]
            what = "deferred, put to sleep once started" if sleep else "awake"
            self._say(say, f"starting {', '.join(names)} ({what})")
            refs = {
                (r, m): actor.start.remote() for r in roles for m, actor in self.actors[r].items()
            }
            problems = []
            for (r, m), ref in refs.items():
                try:
                    result = ray.get(ref)
                except Exception as exc:
                    problems.append(f"{r}.{m}: {_cause(exc)}")
                    continue
                self._track(r, m)
                if not result.ok:
                    problems += [f"{r}.{m} {f.engine_id}: {f.error}" for f in result.failed]
                else:
                    self._say(say, f"{r}.{m}: READY")
            if problems:
                raise LifecycleError(
                    "engines did not become READY:\n  "
                    + "\n  ".join(problems)
                    + (f"\nsee the engine logs in {self.log_dir}" if self.log_dir else "")
                )
            if sleep:
                for r in roles:
                    for m, actor in self.actors[r].items():
                        result = ray.get(actor.offload.remote())
                        wrong = {e: s for e, s in result.states.items() if s != "SLEEPING"}
                        if wrong:
                            raise LifecycleError(
                                f"{r}.{m} could not be put to sleep after its start ({wrong}); "
                                "it shares GPUs with later phases, so nothing more is started"
                            )
                        self._say(
                            say, f"{r}.{m}: SLEEPING (deferred; only the coordinator wakes it)"
                        )

    def _track(self, role: str, model: str) -> None:
        import ray

        actor = self.actors[role][model]
        pids = ray.get(actor.engine_pids.remote(), timeout=60)
        self.engine_pids.update(p for ps in pids.values() for p in ps if p)
        self.router_pids.update(ray.get(actor.router_pids.remote(), timeout=60))

    def _start_coordination(self) -> None:
        from relax_core.coordination.remote import start_coordinator
        from relax_core.coordination.sink import RayBatchSink

        slices = dict(defer_slices(self.plan))
        gen = self.generation_role
        # A generation role on no shared GPU (a CPU model) still takes its lease each step.
        slices.setdefault(gen, f"{gen}:own")
        self.slices = slices
        managers = {
            role: [(f"{role}.{m}", actor) for m, actor in self.actors[role].items()]
            for role in slices
            if role != gen
        }
        self.coordinator = start_coordinator(
            self.name,
            slices=slices,
            managers=managers,
            generation_role=gen,
            operation_timeout=self.run.operation_timeout,
        )
        self.sink = RayBatchSink.start(name=f"relax-batches-{self.name}", namespace=NAMESPACE)

    # -- teardown ------------------------------------------------------------------------

    def teardown(self, say: Say) -> list[str]:
        """Stop everything this job started; return what could not be confirmed (empty when
        nothing is left). Idempotent; never raises for one part's failure (each is tried).

        A manager busy with a lifecycle call (an offload of a hung engine) finishes it first:
        its deadline follows ``operation_timeout``, so the wait is bounded.
        """
        import ray

        from relax_core.service import _still_running, release_pools

        problems: list[str] = []
        if self.trainer is not None:
            ray.kill(self.trainer, no_restart=True)
        for part in (self.coordinator, self.sink):
            if part is not None:
                try:
                    part.stop()
                except Exception as exc:
                    problems.append(f"{type(part).__name__}: {exc}")
        self.trainer = self.coordinator = self.sink = None
        actors = [(r, m, a) for r, models in self.actors.items() for m, a in models.items()]
        # Every engine and router pid was recorded once each model started (asking now could
        # wait behind a hung lifecycle call: the manager's queries take its lock).
        refs = {(r, m): a.shutdown.remote() for r, m, a in actors}
        deadline = time.monotonic() + 2 * self.run.operation_timeout + 60.0
        for (r, m), ref in refs.items():
            try:
                ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except Exception as exc:
                problems.append(f"{r}.{m}: shutdown: {_cause(exc)}")
        # Workers whose cleanup is not confirmed keep their placement groups (as relax serve).
        unconfirmed: list[Any] = []
        for r, m, a in actors:
            try:
                unconfirmed += ray.get(a.unconfirmed_workers.remote(), timeout=30.0)
            except Exception as exc:
                problems.append(f"{r}.{m}: unconfirmed workers not known: {_cause(exc)}")
        for _, _, a in actors:
            ray.kill(a, no_restart=True)
        self.actors = {}
        if actors:
            self._say(say, f"managers stopped ({len(actors)})")
        for registry in self.registries.values():
            registry.stop()
        self.registries = {}
        problems += _still_running(self.engine_pids, self.router_pids)
        if self.engine_pids:
            self._say(
                say,
                f"engines stopped ({len(self.engine_pids)} processes"
                + (f", {len(self.router_pids)} router" if self.router_pids else "")
                + ")",
            )
        kept: dict[str, str] = {}
        released = release_pools(self.bound, unconfirmed, kept=kept, problems=problems)
        if self.bound:
            note = f", {len(kept)} kept" if kept else ""
            self._say(say, f"placement groups removed ({released}){note}")
        self.bound = []
        return problems


def _last_line(exc: BaseException) -> str:
    """The last line of a Ray error's text: the original error of a failed actor creation."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _cause(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if isinstance(cause, BaseException):
        exc = cause
    return f"{type(exc).__name__}: {exc}"
