"""Every hook a Relax plugin can implement.

A plugin is a module (found through the ``relax`` entry-point group) with functions marked
``@relax_core.hookimpl``. Registration hooks hand the plugin a ``register`` callback; the plugin
calls it with frozen records from :mod:`relax_core.records`. Two records of one kind with one
name are rejected with both plugins named.

Every hook here is a registration hook, collected once per plugin manager, when a command
first needs the kind. They are grouped by the phase in which their records are used:

- **a job's inference side** (every command that reads a job: ``relax plan``, ``serve``,
  ``run``): roles, engine backends, routers, weight sources, reward adapters, routing policies,
  placement modes — checked when the job file is read, used as its models start and serve;
- **an RL step** (``relax run``): data sources (the step's prompts), rollout shapes (how a
  prompt becomes a group: one completion, or a multi-turn trajectory) and the environments a
  multi-turn shape drives, stages (what the step does
  to its batch, in order), trainers (who trains on the committed batch) — collected when the
  ``[run]`` table is checked, before anything starts; trackers (who hears what the run
  did: its config, each committed step's metrics, each phase, samples to inspect) — opened
  when the steps begin, closed when the run ends, however it ends;
- **tools** (``relax bench``, ``relax`` itself): benchmarks — collected when ``relax bench``
  runs; commands (sub-commands of ``relax``) — collected when the command line is built.

A plugin implements a hook under the same name and calls ``register`` once per record it adds;
each hook below names its record and shows that call::

    from relax_core import hookimpl
    from relax_core.records import RoutingPolicy

    @hookimpl
    def relax_register_routing_policies(register):
        register(RoutingPolicy(name="random", factory=RandomSelector))
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from relax_core import records

__all__ = ["hookimpl", "hookspec"]

hookspec = pluggy.HookspecMarker("relax")
hookimpl = pluggy.HookimplMarker("relax")


# == a job's inference side ===================================================================

# -- roles -----------------------------------------------------------------------------------


@hookspec
def relax_register_roles(register: Callable[[records.RoleSpec], None]) -> None:
    """Register inference roles.

    :param register: call it once per :class:`~relax_core.records.RoleSpec`, as in
        ``register(RoleSpec(name="genrm", allowed_weight_sources={"STATIC"},
        default_route_mode="DIRECT", deferrable=True))``.
    """


# -- engine backends -------------------------------------------------------------------------


@hookspec
def relax_register_engine_backends(register: Callable[[records.EngineBackend], None]) -> None:
    """Register engine backends.

    :param register: call it once per :class:`~relax_core.records.EngineBackend`, as in
        ``register(EngineBackend(name="hf", launch=launch_hf, control_client=ControlClient,
        devices={"cpu", "cuda"}))``.
    """


# -- routers ---------------------------------------------------------------------------------


@hookspec
def relax_register_routers(register: Callable[[records.RouterBackend], None]) -> None:
    """Register routers that front a model's replica heads (``route_mode = "SGLANG_ROUTER"``).

    :param register: call it once per :class:`~relax_core.records.RouterBackend`, as in
        ``register(RouterBackend(name="smg", launch=launch_smg,
        policies={"round_robin", "consistent_hashing"}, default_policy="consistent_hashing",
        version="1.13.0"))``.
    """


# -- weight sources --------------------------------------------------------------------------


@hookspec
def relax_register_weight_sources(register: Callable[[records.WeightSource], None]) -> None:
    """Register weight sources (the core registers ``STATIC``, ``ACTOR`` and ``DCS``).

    :param register: call it once per :class:`~relax_core.records.WeightSource`, as in
        ``register(WeightSource(name="S3CKPT", update_paths={"disk"},
        publishes_version=True))``.
    """


# -- reward adapters -------------------------------------------------------------------------


@hookspec
def relax_register_reward_adapters(register: Callable[[records.RewardSpec], None]) -> None:
    """Register reward adapters.

    :param register: call it once per :class:`~relax_core.records.RewardSpec`, as in
        ``register(RewardSpec(name="exact-match", fn=exact_match, mode="sync",
        label_matcher=lambda label: label is not None, supports_deferred=True))``.

    An adapter is called ``fn(response, label)`` (plus ``metadata=`` with
    ``pass_metadata=True``; an ``async`` adapter also gets ``context=``, a
    :class:`~relax_core.coordination.RewardContext` with the sample and the loop's client of
    each role) and returns a number or a :class:`~relax_core.coordination.RewardResult`.
    ``sync`` adapters run in Ray workers; ``label_matcher(label) -> bool`` limits the samples
    an adapter scores; ``supports_deferred`` lets it score a staged batch in a deferred phase.
    """


# -- routing policies ------------------------------------------------------------------------


@hookspec
def relax_register_routing_policies(register: Callable[[records.RoutingPolicy], None]) -> None:
    """Register DIRECT replica-selection policies.

    :param register: call it once per :class:`~relax_core.records.RoutingPolicy`, as in
        ``register(RoutingPolicy(name="random", factory=RandomSelector))``.
    """


# -- placement modes -------------------------------------------------------------------------


@hookspec
def relax_register_placement_modes(register: Callable[[records.PlacementMode], None]) -> None:
    """Register placement modes (the core registers ``decoupled``, ``split`` and ``defer``).

    :param register: call it once per :class:`~relax_core.records.PlacementMode`, as in
        ``register(PlacementMode(name="packed", assign=assign_packed))``.
    """


# == an RL step (relax run): in the order a step uses them — where its prompts come from, what
# it does to its batch, who trains on it ========================================================


@hookspec
def relax_register_data_sources(register: Callable[[records.DataSourceSpec], None]) -> None:
    """Register prompt sources (the core registers ``arithmetic`` and ``jsonl``).

    ``[run] dataset`` names one (``dataset = "arithmetic"``) or a file whose suffix one claims
    (``dataset = "train.jsonl"``); an eval stage's ``dataset`` is found the same way.

    :param register: call it once per :class:`~relax_core.records.DataSourceSpec`, as in
        ``register(DataSourceSpec(name="parquet", open=open_parquet, suffixes=(".parquet",),
        check=check_parquet))``.
    """


@hookspec
def relax_register_rollout_shapes(register: Callable[[records.RolloutShapeSpec], None]) -> None:
    """Register rollout shapes (the core registers ``single-turn``, the default; the
    ``relax-agent`` plugin ``multi-turn``).

    ``[run.generation] shape`` names the one a run generates with; it turns each prompt of a step
    into one group of samples through the generation role's route (``shape.group(request)``),
    for the step's first groups and for every group a stage asks more of. Built
    (``RolloutShapeSpec.build``) when the run is checked, before anything starts.

    :param register: call it once per :class:`~relax_core.records.RolloutShapeSpec`, as in
        ``register(RolloutShapeSpec(name="best-of-n", build=BestOfN.from_config,
        options=("n",)))``.
    """


@hookspec
def relax_register_environments(register: Callable[[records.EnvironmentSpec], None]) -> None:
    """Register environments for multi-turn rollouts (the ``relax-agent`` plugin registers
    ``calculator``, a calculator tool for the arithmetic dataset).

    ``[run.generation] environment`` names the one the ``multi-turn`` shape drives: one
    environment per trajectory (``EnvironmentSpec.make(config)``), reset from the prompt's
    dataset row, stepped with each policy turn — its observation's messages appended as
    tokens the policy never trains on, its optional reward recorded per turn — until it says
    ``done``, or ``max_turns`` or ``max_total_tokens`` is reached. Its options are checked
    (``EnvironmentSpec.check``) when the run is checked.

    :param register: call it once per :class:`~relax_core.records.EnvironmentSpec`, as in
        ``register(EnvironmentSpec(name="search", make=SearchEnv, options=("index",)))``.
    """


@hookspec
def relax_register_stages(register: Callable[[records.StageSpec], None]) -> None:
    """Register kinds of step stages (the core registers ``reward`` and ``eval``;
    relax-teacher ``distill`` and ``student``).

    ``[[run.stages]]`` lists a step's stages in order, each by its kind (``stage =
    "distill"``); each runs on the staged batch after generation, within its role's lease, and
    declares the sample fields it writes. Built (``StageSpec.build``) when the run is checked.

    :param register: call it once per :class:`~relax_core.records.StageSpec`, as in
        ``register(StageSpec(name="length-penalty", build=LengthPenalty.from_config,
        options=("per_token",)))``.
    """


@hookspec
def relax_register_trainers(register: Callable[[records.TrainerSpec], None]) -> None:
    """Register trainers: the training consumers ``relax run`` starts in a Ray actor, each
    named by ``[run] trainer`` (collected when a run's table is checked, before anything
    starts).

    :param register: call it once per :class:`~relax_core.records.TrainerSpec`, as in
        ``register(TrainerSpec(name="grpo", trainer_class=PolicyTrainer,
        description="GRPO and distillation on a torch Llama"))``.
    """


@hookspec
def relax_register_trackers(register: Callable[[records.TrackerSpec], None]) -> None:
    """Register experiment trackers (the core registers ``jsonl`` and ``tensorboard``;
    contrib's relax-wandb ``wandb``, relax-mlflow ``mlflow``).

    ``[run] trackers`` (and ``relax run --tracker NAME``) names the ones a run reports to. Each
    is opened in the driver when the steps begin (``TrackerSpec.open(context)``), hears the
    run's config once, each committed step's metrics, each phase span and a few samples per
    step, and is closed at the end of the run, also on a failure or Ctrl-C. A tracker that
    raises is reported once and left out for the rest of the run (``strict_trackers = true``
    ends the run instead).

    :param register: call it once per :class:`~relax_core.records.TrackerSpec`, as in
        ``register(TrackerSpec(name="csv", open=CsvTracker, options=("file",)))``.
    """


# == tools: commands around a job =================================================================

# -- benchmarks ------------------------------------------------------------------------------


@hookspec
def relax_register_benchmarks(register: Callable[[records.BenchmarkSpec], None]) -> None:
    """Register benchmarks: ``relax bench NAME [--json] [--quick] [its options]`` runs one,
    ``relax bench`` lists them (collected when ``relax bench`` runs).

    :param register: call it once per :class:`~relax_core.records.BenchmarkSpec`, as in
        ``register(BenchmarkSpec(name="tokenize", run=measure_tokenize,
        description="tokens per second of the chat template"))``.
    """


# -- commands --------------------------------------------------------------------------------


@hookspec
def relax_register_commands(register: Callable[[records.CommandSpec], None]) -> None:
    """Register sub-commands of ``relax`` (collected when the command line is built, by every
    ``relax`` command).

    :param register: call it once per :class:`~relax_core.records.CommandSpec`, as in
        ``register(CommandSpec(name="report", help="Write a run's report.",
        add_arguments=add_arguments, run=run))``.
    """
