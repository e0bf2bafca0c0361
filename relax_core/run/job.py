"""What ``relax run`` brings up on Ray and takes down again (:class:`RunJob`), and the checks
made before anything starts (:func:`run_problems`)."""

from __future__ import annotations

import functools
import os
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import attrs

from relax_core.config import ConfigReader, JobConfig, ModelConfig
from relax_core.coordination.preflight import DeferredWorkload, deferred_workload_problems
from relax_core.coordination.remote import NAMESPACE
from relax_core.coordination.residency import ResidencyPlan, defer_slices, plan_residency
from relax_core.coordination.stages import Stage, stage_fields
from relax_core.errors import ConfigProblem, RelaxError
from relax_core.jobs.runtime import JobRuntime, Say
from relax_core.jobs.teardown import Stop
from relax_core.manager import ManagerTimeouts
from relax_core.manager.actor import ManagerActor
from relax_core.manager.external import ExternalEngines
from relax_core.plugins import PluginManager
from relax_core.run.config import RunConfig


def generation_role(config: JobConfig, pm: PluginManager) -> str | None:
    """The configured role that generates the training batch (``generation_phase``), if one
    is; ``None`` when none or several are."""
    found = [r.name for r in config.roles if pm.role(r.name).generation_phase]
    return found[0] if len(found) == 1 else None


def run_problems(config: JobConfig, run: RunConfig, pm: PluginManager) -> list[str]:
    """Every reason ``relax run`` cannot run ``config`` with ``run``, as ``key.path: [rule]
    message`` lines; empty when it can. Starts nothing (it reads the data source)."""
    from relax_core.jobs.checks import check_job
    from relax_core.run.background import background_problems
    from relax_core.run.data import source_problems
    from relax_core.run.stages import stage_problems
    from relax_core.run.trainer import load_trainer_class
    from relax_core.tracking.hub import tracker_problems

    if problems := list(check_job(config, pm)):
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
        from relax_core.run.rollout import rollout_problems

        models = config.role(gen).models
        out += _generation_problems(models, pm)
        shape = rollout_problems(run.generation, run, pm, **_shape_model(models[0]))
        out += shape
        if not shape:
            from relax_core.run.features import engine_feature_problems

            out += engine_feature_problems(run.generation, run, pm, models)
    defer = tuple(r for r in config.placement.defer_roles if r in roles)
    out += source_problems(run.dataset, pm, seed=run.seed, base=run.base)
    out += stage_problems(
        run, pm, roles=config.role_names, generation_role=gen, deferred_roles=defer
    )
    out += background_problems(run.stages, defer_roles=defer, residency=config.placement.residency)
    out += [
        ConfigProblem(
            f"{m.path}.external_urls",
            "external",
            f"role {m.role!r} takes turns on shared GPUs (placement.defer_roles), but this "
            "model is served by engines relax run does not start, onload nor offload: take "
            f"{m.role!r} out of placement.defer_roles, or drop external_urls",
        )
        for role in defer
        for m in config.role(role).models
        if m.external
    ]
    if defer:
        workload = DeferredWorkload(
            defer_roles=defer,
            generation_models=config.role(gen).model_names if gen else (),
            partial_rollout=run.partial_rollout,
            paths={
                "defer_roles": "placement.defer_roles",
                "generation_models": f"roles.{gen}.models",
            },
        )
        out += deferred_workload_problems(workload)
        out += _slice_problems(config, pm, defer)
    elif run.partial_rollout:
        out.append(
            ConfigProblem("run.partial_rollout", "unsupported", "relax run does not implement it")
        )
    out += tracker_problems(run.trackers, pm)
    try:
        load_trainer_class(run.trainer, pm)
    except RelaxError as exc:
        out.append(ConfigProblem("run.trainer", "trainer", getattr(exc, "message", str(exc))))
    return [str(p) for p in out]


def _generation_problems(models: tuple[ModelConfig, ...], pm: PluginManager) -> list[ConfigProblem]:
    r = ConfigReader()
    for m in models:
        source = pm.weight_source(m.weight_source or pm.role(m.role).default_weight_source)
        if "tensor" not in source.update_paths:
            r.problem(
                f"{m.path}.weight_source",
                "weights",
                f"{source.name} weights take no tensor update, so the trainer cannot push "
                'its weights; set weight_source = "ACTOR"',
            )
        if m.external:
            r.problem(
                f"{m.path}.external_urls",
                "external",
                f"the {m.role} role generates the batch, and the trainer pushes its weights "
                "to those engines after every step through their manager: relax run must "
                "start them; drop external_urls (external engines suit a model whose "
                "weights never change: a teacher's, a judge's)",
            )
        if not Path(m.model_path).is_dir():
            continue  # the job preflight reports a missing model directory
        for name in ("config.json", "tokenizer.json"):
            if not (Path(m.model_path) / name).is_file():
                r.problem(
                    f"{m.path}.model_path",
                    "model-dir",
                    f"no {name} in {m.model_path!r}: the trainer loads the policy's "
                    "checkpoint and relax run tokenizes prompts with its tokenizer, so it "
                    "must be a local model directory (a relative path is relative to the "
                    "job file)",
                )
    return r.problems


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


def _shape_model(model: ModelConfig) -> dict[str, Any]:
    """The generation model as the rollout shape's builder hears it."""
    return {"model": model.name, "model_path": model.model_path, "model_where": model.path}


@attrs.define(eq=False)
class RunJob:
    """The actors, engines and placement groups of one ``relax run``; ``name``: the job's.

    :raises ValueError: the job has no generation role (:func:`run_problems` says so first)."""

    config: JobConfig
    run: RunConfig
    pm: PluginManager
    name: str = attrs.field(kw_only=True)
    log_dir: str | None = attrs.field(default=None, kw_only=True)
    generation_role: str = attrs.field(init=False)
    generation_model: ModelConfig = attrs.field(init=False)
    runtime: JobRuntime = attrs.field(factory=JobRuntime, init=False)
    registries: dict[str, Any] = attrs.field(factory=dict, init=False)
    #: role -> model -> manager actor (every role; not the models served by external engines)
    actors: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)
    #: role -> model -> the actor of a model served by ``external_urls`` (never driven)
    external: dict[str, dict[str, Any]] = attrs.field(factory=dict, init=False)
    coordinator: Any = attrs.field(default=None, init=False)
    sink: Any = attrs.field(default=None, init=False)
    trainer: Any = attrs.field(default=None, init=False)
    slices: dict[str, str] = attrs.field(factory=dict, init=False)
    residency: ResidencyPlan = attrs.field(factory=ResidencyPlan, init=False)
    stages: list[Stage] = attrs.field(factory=list, init=False)
    rollout_shape: Any = attrs.field(default=None, init=False)

    def __attrs_post_init__(self) -> None:
        from relax_core.run.stages import build_stages

        gen = generation_role(self.config, self.pm)
        if gen is None:
            raise ValueError("no generation role: run run_problems() first")
        self.generation_role = gen
        self.generation_model = self.config.role(gen).models[0]
        self.stages = build_stages(
            self.run,
            self.pm,
            roles=self.config.role_names,
            generation_role=gen,
            deferred_roles=self.config.placement.defer_roles,
        )
        from relax_core.run.rollout import build_rollout_shape

        self.rollout_shape = build_rollout_shape(
            self.run.generation, self.run, self.pm, **_shape_model(self.generation_model)
        )

    @property
    def rollout_actor(self) -> Any:
        """The generation model's manager actor."""
        return self.actors[self.generation_role][self.generation_model.name]

    @property
    def bound(self) -> list[Any]:
        """The bound placement groups."""
        return self.runtime.bound

    @property
    def engine_pids(self) -> set[int]:
        """Every engine pid seen (checked gone at teardown)."""
        return self.runtime.engine_pids

    @property
    def router_pids(self) -> set[int]:
        """Every router pid seen (checked gone at teardown)."""
        return self.runtime.router_pids

    def start(
        self,
        say: Say,
        *,
        on_interrupt: Callable[[], None] | None = None,
        on_started: Callable[[int, int], None] | None = None,
    ) -> None:
        """Bring everything up (blocks); ``say`` gets one line per event.

        :raises PlacementError: the binding failed. :raises LifecycleError: an engine, router
            or the trainer did not start (call :meth:`teardown` in every case)."""
        from relax_core.discovery.actor import start_registry_actor
        from relax_core.jobs.managers import routing_spec, start_model_actor
        from relax_core.jobs.models import RayModel

        runtime = self.runtime
        runtime.began = time.monotonic()
        if self.log_dir is not None:
            os.makedirs(self.log_dir, exist_ok=True)
        plan = runtime.plan_for(self.config, self.pm)
        pools = len({p.pool for p in plan.placements if p.pool is not None})
        actors = sum(len(role.models) for role in self.config.roles)
        runtime.line(
            say,
            f"placing: {pools} placement group(s), {len(self.config.roles)} registry and "
            f"{actors} manager actor(s), the coordinator and the trainer …",
        )
        placements = runtime.bind(self.config)
        sources = sorted(self.pm.registered("weight_sources"))
        # Each actor is a new worker process: started side by side, their starts overlap.
        with ThreadPoolExecutor(max_workers=8, thread_name_prefix="placing") as pool:
            registries = {
                role.name: pool.submit(
                    start_registry_actor,
                    role.name,
                    routing_spec(role),
                    name=f"relax-registry-{self.name}-{role.name}",
                    namespace=NAMESPACE,
                    weight_sources=sources,
                )
                for role in self.config.roles
            }
            wait(list(registries.values()))
            for name, started in registries.items():
                if started.exception() is None:
                    self.registries[name] = started.result()
            _raise_first(registries.values())
            op = self.run.operation_timeout  # lifecycle calls follow the coordinator's deadline
            timeouts = ManagerTimeouts(
                start=600.0, offload=op, onload=op, drain=min(30.0, op / 2), update=600.0,
                shutdown=10.0,
            )  # fmt: skip
            managers = {
                (role.name, model.name): pool.submit(
                    start_model_actor,
                    model,
                    self.pm,
                    actor_class=ExternalEnginesActor if model.external else ManagerActor,
                    job=self.name,
                    placement=placements[role.name][model.name],
                    publisher=self.registries[role.name],
                    timeouts=timeouts,
                    log_dir=self.log_dir,
                )
                for role in self.config.roles
                for model in role.models
            }
            # Every start is waited for before one's error is raised: whatever did start is
            # recorded for the teardown.
            wait(list(managers.values()))
        for (role_name, model_name), started in managers.items():
            # A role whose models are all external has no actor to rebuild: an empty entry.
            self.actors.setdefault(role_name, {})
            if started.exception() is not None:
                continue
            actor = started.result()
            external = self.config.role(role_name).model(model_name).external
            owner = self.external if external else self.actors
            owner.setdefault(role_name, {})[model_name] = actor
            # A manager busy with a lifecycle call finishes it before its shutdown: its
            # deadline follows operation_timeout, so the wait is bounded.
            timeout = 2 * self.run.operation_timeout + 60.0
            handle = RayModel(  # type: ignore[abstract]  # generated methods
                role_name, model_name, actor, shutdown_timeout=timeout
            )
            runtime.add(handle)
        _raise_first(managers.values())
        for model in self.config.models():
            if model.external:
                runtime.line(
                    say,
                    f"{model.role}.{model.name}: external engines at "
                    f"{', '.join(model.external_urls)}: not started, onloaded, offloaded nor "
                    "rebuilt by this run, and never sent weights",
                )
        self._start_coordination()
        trainer_error: list[BaseException] = []
        builder = threading.Thread(
            target=self._start_trainer,
            args=(runtime.pools, trainer_error),
            name="trainer",
            daemon=True,
        )
        builder.start()
        try:
            runtime.start(
                self.config, say, logs=self.log_dir, on_interrupt=on_interrupt,
                on_started=on_started, sleep_note="only the coordinator wakes it, for its phase",
            )  # fmt: skip
        finally:
            builder.join()
        if trainer_error:
            raise trainer_error[0]
        runtime.line(say, f"trainer ready ({self.run.trainer}, on {self.run.trainer_device})")

    def _start_trainer(self, bound: dict[str, Any], errors: list[BaseException]) -> None:
        from relax_core.run.trainer import TrainerContext, start_trainer

        run = self.run
        group, bundle, gpus = None, 0, 1.0 if run.trainer_device.startswith("cuda") else 0.0
        for pool in self.runtime.plan.pools:
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
            options=run.trainer_options,
            mode=run.mode,
            fields=tuple(stage_fields(self.stages)),
            seed=run.seed,
            push_format=run.push_format,
            push_bucket_bytes=run.push_bucket_bytes,
            push_pause=None if run.push_pause == "fence" else run.push_pause,
        )
        try:
            self.trainer = start_trainer(
                context,
                trainer=run.trainer,
                pm=self.pm,
                placement_group=group,
                bundle_index=bundle,
                num_gpus=gpus,
            )
        except BaseException as exc:  # re-raised by start(), after the engines' start ended
            errors.append(exc)

    def _start_coordination(self) -> None:
        from relax_core.coordination.remote import start_coordinator
        from relax_core.coordination.sink import RayBatchSink

        slices = dict(defer_slices(self.runtime.plan))
        gen = self.generation_role
        # A generation role on no shared GPU (a CPU model) has a slice of its own: free under a
        # planned residency (it never switches), leased each step under an exclusive one.
        slices.setdefault(gen, f"{gen}:own")
        self.slices = slices
        self.residency = plan_residency(
            self.runtime.plan, slices, mode=self.config.placement.residency, roles=tuple(slices)
        )
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
            residency=self.residency,
        )
        self.sink = RayBatchSink.start(name=f"relax-batches-{self.name}", namespace=NAMESPACE)

    def teardown(self, say: Say) -> list[str]:
        """Stop everything this job started; what could not be confirmed (empty: nothing
        left). Idempotent; never raises for one part's failure (each is tried)."""
        import ray

        first = []
        if self.trainer is not None:
            first.append(
                Stop("trainer", functools.partial(ray.kill, self.trainer, no_restart=True))
            )
        if self.coordinator is not None:
            first.append(Stop("coordinator", self.coordinator.stop))
        if self.sink is not None:
            first.append(Stop("batch sink", self.sink.stop))
        then = [Stop(f"{role} registry", r.stop) for role, r in self.registries.items()]
        self.trainer = self.coordinator = self.sink = None
        self.actors, self.external, self.registries = {}, {}, {}
        return self.runtime.teardown(say, first=first, then=then)


class ExternalEnginesActor(ManagerActor):
    """The actor of a model served by ``external_urls``: a
    :class:`~relax_core.manager.actor.ManagerActor` around
    :class:`~relax_core.manager.external.ExternalEngines`."""

    _manager_class = ExternalEngines


def _raise_first(started: Iterable[Future[Any]]) -> None:
    """Raise the error of the first start that failed (all of them have ended)."""
    for future in started:
        error = future.exception()
        if error is not None:
            raise error
