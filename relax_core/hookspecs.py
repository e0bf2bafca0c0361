"""Every hook a Relax plugin can implement, grouped by the phase that uses them.

Each is a registration hook: it hands the plugin a ``register`` callback to call once per frozen
record (:mod:`relax_core.records`) it adds; two records of one kind with one name are rejected
with both plugins named. Each kind is collected once per plugin manager, when first needed."""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from relax_core import records

hookspec = pluggy.HookspecMarker("relax")
hookimpl = pluggy.HookimplMarker("relax")


# == a job's inference side: checked when a job file is read (relax plan, serve, run) ==========


@hookspec
def relax_register_roles(register: Callable[[records.RoleSpec], None]) -> None:
    """Register inference roles.

    :param register: call it once per :class:`~relax_core.records.RoleSpec`, as in
        ``register(RoleSpec(name="genrm", allowed_weight_sources={"STATIC"},
        default_route_mode="DIRECT", deferrable=True))``."""


@hookspec
def relax_register_engine_backends(register: Callable[[records.EngineBackend], None]) -> None:
    """Register engine backends.

    :param register: call it once per :class:`~relax_core.records.EngineBackend`, as in
        ``register(EngineBackend(name="hf", launch=launch_hf, control_client=ControlClient,
        devices={"cpu", "cuda"}))``."""


@hookspec
def relax_register_routers(register: Callable[[records.RouterBackend], None]) -> None:
    """Register routers that front a model's replica heads (``route_mode = "SGLANG_ROUTER"``).

    :param register: call it once per :class:`~relax_core.records.RouterBackend`, as in
        ``register(RouterBackend(name="smg", launch=launch_smg,
        policies={"round_robin", "consistent_hashing"}, default_policy="consistent_hashing",
        version="1.13.0"))``."""


@hookspec
def relax_register_weight_sources(register: Callable[[records.WeightSource], None]) -> None:
    """Register weight sources (the core registers ``STATIC``, ``ACTOR`` and ``DCS``).

    :param register: call it once per :class:`~relax_core.records.WeightSource`, as in
        ``register(WeightSource(name="S3CKPT", update_paths={"disk"},
        publishes_version=True))``."""


@hookspec
def relax_register_reward_adapters(register: Callable[[records.RewardSpec], None]) -> None:
    """Register reward adapters (how one is called: :class:`~relax_core.records.RewardSpec`).

    :param register: call it once per :class:`~relax_core.records.RewardSpec`, as in
        ``register(RewardSpec(name="exact-match", fn=exact_match, mode="sync",
        label_matcher=lambda label: label is not None, supports_deferred=True))``."""


@hookspec
def relax_register_routing_policies(register: Callable[[records.RoutingPolicy], None]) -> None:
    """Register DIRECT replica-selection policies.

    :param register: call it once per :class:`~relax_core.records.RoutingPolicy`, as in
        ``register(RoutingPolicy(name="random", factory=RandomSelector))``."""


@hookspec
def relax_register_placement_modes(register: Callable[[records.PlacementMode], None]) -> None:
    """Register placement modes (the core registers ``decoupled``, ``split`` and ``defer``).

    :param register: call it once per :class:`~relax_core.records.PlacementMode`, as in
        ``register(PlacementMode(name="packed", assign=assign_packed))``."""


# == an RL step (relax run), in the order a step uses them: collected when [run] is checked ====


@hookspec
def relax_register_data_sources(register: Callable[[records.DataSourceSpec], None]) -> None:
    """Register prompt sources (the core registers ``arithmetic`` and ``jsonl``), named by
    ``[run] dataset`` or an eval stage's ``dataset``, or claiming a file by its suffix.

    :param register: call it once per :class:`~relax_core.records.DataSourceSpec`, as in
        ``register(DataSourceSpec(name="parquet", open=open_parquet, suffixes=(".parquet",),
        check=check_parquet))``."""


@hookspec
def relax_register_rollout_shapes(register: Callable[[records.RolloutShapeSpec], None]) -> None:
    """Register rollout shapes (the core registers ``single-turn``, the default; ``relax-agent``
    ``multi-turn``): ``[run.generation] shape`` names the one that turns each prompt into a group.

    :param register: call it once per :class:`~relax_core.records.RolloutShapeSpec`, as in
        ``register(RolloutShapeSpec(name="best-of-n", build=BestOfN.from_config,
        options=("n",)))``."""


@hookspec
def relax_register_environments(register: Callable[[records.EnvironmentSpec], None]) -> None:
    """Register environments for multi-turn rollouts (``relax-agent`` registers ``calculator``):
    ``[run.generation] environment`` names the one the ``multi-turn`` shape drives, one per
    trajectory, until it says ``done`` or a turn or token limit is reached.

    :param register: call it once per :class:`~relax_core.records.EnvironmentSpec`, as in
        ``register(EnvironmentSpec(name="search", make=SearchEnv, options=("index",)))``."""


@hookspec
def relax_register_stages(register: Callable[[records.StageSpec], None]) -> None:
    """Register kinds of step stages (the core registers ``reward`` and ``eval``; relax-teacher
    ``distill`` and ``student``): ``[[run.stages]]`` lists a step's stages in order, each run on
    the staged batch within its role's lease.

    :param register: call it once per :class:`~relax_core.records.StageSpec`, as in
        ``register(StageSpec(name="length-penalty", build=LengthPenalty.from_config,
        options=("per_token",)))``."""


@hookspec
def relax_register_trainers(register: Callable[[records.TrainerSpec], None]) -> None:
    """Register trainers: the training consumers ``relax run`` starts in a Ray actor, each
    named by ``[run] trainer``.

    :param register: call it once per :class:`~relax_core.records.TrainerSpec`, as in
        ``register(TrainerSpec(name="grpo", trainer_class=PolicyTrainer,
        description="GRPO and distillation on a torch Llama"))``."""


@hookspec
def relax_register_trackers(register: Callable[[records.TrackerSpec], None]) -> None:
    """Register experiment trackers (the core registers ``jsonl`` and ``tensorboard``).

    ``[run] trackers`` (or ``--tracker``) names the ones a run reports to: opened when the steps
    begin, told the config, each committed step's metrics, phase spans and samples, closed when the
    run ends however it ends. A tracker that raises is dropped after one report, unless
    ``strict_trackers = true``.

    :param register: call it once per :class:`~relax_core.records.TrackerSpec`, as in
        ``register(TrackerSpec(name="csv", open=CsvTracker, options=("file",)))``."""


@hookspec
def relax_register_run_probes(register: Callable[[records.RunProbeSpec], None]) -> None:
    """Register run probes: what ``relax run --measure`` measures (the one named ``switching``;
    relax-bench registers it). A probe wraps the run's coordinator and generation handle before
    the first step, and makes the summary's ``switching`` report after the last.

    :param register: call it once per :class:`~relax_core.records.RunProbeSpec`, as in
        ``register(RunProbeSpec(name="switching", start=SwitchTimer))``."""


# == tools: benchmarks (relax bench) and commands (when the command line is built) ============


@hookspec
def relax_register_benchmarks(register: Callable[[records.BenchmarkSpec], None]) -> None:
    """Register benchmarks for ``relax bench NAME [--json] [--quick] [its options]``.

    :param register: call it once per :class:`~relax_core.records.BenchmarkSpec`, as in
        ``register(BenchmarkSpec(name="tokenize", run=measure_tokenize,
        description="tokens per second of the chat template"))``."""


@hookspec
def relax_register_commands(register: Callable[[records.CommandSpec], None]) -> None:
    """Register sub-commands of ``relax`` (collected by every ``relax`` command).

    :param register: call it once per :class:`~relax_core.records.CommandSpec`, as in
        ``register(CommandSpec(name="report", help="Write a run's report.",
        add_arguments=add_arguments, run=run))``."""
