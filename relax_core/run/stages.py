"""A step's stages, built from the job file's stage tables through the registered stage kinds
(:func:`build_stages`), and the core's own two kinds, ``reward`` and ``eval``."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict, Unpack

import attrs

from relax_core.config import ConfigReader, hint
from relax_core.coordination.rewards import RewardStage
from relax_core.coordination.sample import Sample
from relax_core.coordination.stages import Stage, StageContext, StageReport, check_stages
from relax_core.errors import ConfigError, ConfigProblem, ConfigValidationError
from relax_core.hookspecs import hookimpl
from relax_core.records import PluginLookup, StageSpec
from relax_core.run.config import COMMON_STAGE_KEYS, RunConfig, StageTable
from relax_core.run.data import PromptSource, open_source, source_problems


@attrs.frozen
class StageConfig:
    """What a stage kind's ``build`` gets: one stage table, the run's settings, the plugins,
    the generation role and the roles a defer layout leases. Read ``options`` with
    :class:`~relax_core.ConfigReader`; a problem goes at :meth:`key`."""

    table: StageTable
    run: RunConfig
    plugins: PluginLookup
    generation_role: str | None = None
    deferred_roles: tuple[str, ...] = ()
    default_retries: int = 0

    @property
    def retries(self) -> int:
        """How many times a failed idempotent request is sent again (the table's ``retries``,
        else the kind's); for :meth:`~relax_core.StageContext.retrying`."""
        return self.table.retries if self.table.retries is not None else self.default_retries

    @property
    def kind(self) -> str:
        """The stage's kind."""
        return self.table.kind

    @property
    def name(self) -> str:
        """The stage's name in the step: the stage built must take it."""
        return self.table.name

    @property
    def role(self) -> str | None:
        """The role whose lease the stage takes (``None``: none)."""
        return self.table.role

    @property
    def models(self) -> tuple[str, ...]:
        """The models of :attr:`role` the stage uses (empty: every one)."""
        return self.table.models

    @property
    def options(self) -> Mapping[str, Any]:
        """The rest of the table, as written."""
        return self.table.options

    @property
    def path(self) -> str:
        """The table's key path (``run.stages[2]``)."""
        return self.table.path

    def key(self, option: str) -> str:
        """The key path of one of the table's keys (``run.stages[2].top_k``)."""
        return self.table.key(option)

    @property
    def deferred(self) -> bool:
        """The job is a defer layout: its stages score a staged batch in deferred phases."""
        return bool(self.deferred_roles)


class _Job(TypedDict, total=False):
    #: the configured roles (a stage's ``role`` must be one; ``None``: not checked)
    roles: Sequence[str] | None
    generation_role: str | None
    deferred_roles: Sequence[str]


def build_stages(run: RunConfig, plugins: PluginLookup, **job: Unpack[_Job]) -> list[Stage]:
    """Every stage of ``run``, in order, built by its kind. Pure: nothing starts.

    :raises ConfigValidationError: every problem of every stage, each at its key path."""
    stages, problems = _build(run, plugins, **job)
    if problems:
        raise ConfigValidationError(problems)
    return stages


def stage_problems(
    run: RunConfig, plugins: PluginLookup, **job: Unpack[_Job]
) -> list[ConfigProblem]:
    """What :func:`build_stages` would raise, as a list (empty: every stage builds)."""
    return _build(run, plugins, **job)[1]


def _build(
    run: RunConfig,
    plugins: PluginLookup,
    roles: Sequence[str] | None = None,
    generation_role: str | None = None,
    deferred_roles: Sequence[str] = (),
) -> tuple[list[Stage], list[ConfigProblem]]:
    registered = plugins.registered("stages")
    stages: list[Stage] = []
    problems: list[ConfigProblem] = []
    for table in run.stages:
        entry = registered.get(table.kind)
        if entry is None:
            problems.append(_unknown_kind(table, sorted(registered)))
            continue
        spec: StageSpec = entry.record
        if spec.options is not None:  # unknown keys: reported beside what the build finds
            r = ConfigReader()
            r.table(dict(table.options), table.path, (*COMMON_STAGE_KEYS, *spec.options))
            problems += r.problems
        found = _role_problems(table, spec, roles)
        if found:
            problems += found
            continue
        config = StageConfig(
            table, run, plugins, generation_role, tuple(deferred_roles), spec.retries
        )
        built = f"stage kind {table.kind!r} (from {entry.distribution})"
        try:
            stage = spec.build(config)
        except ConfigValidationError as exc:
            problems += exc.problems
        except ConfigError as exc:
            problems.append(ConfigProblem(exc.path or table.path, "stage", exc.message))
        except Exception as exc:
            why = f"{built} failed to build: {type(exc).__name__}: {exc}"
            problems.append(ConfigProblem(table.path, "stage", why))
        else:
            problems += _built_problems(table, stage, built)
            stages.append(stage)
    if not problems:
        try:
            check_stages(stages)
        except ValueError as exc:
            problems.append(ConfigProblem("run.stages", "stages", str(exc)))
    return stages, problems


def _unknown_kind(table: StageTable, known: list[str]) -> ConfigProblem:
    return ConfigProblem(
        table.key("stage"),
        "plugin",
        f"no stage kind {table.kind!r} is registered{hint(table.kind, known)} (registered: "
        f"{', '.join(known) or 'none'}); install the plugin that provides it (relax plugins "
        "lists them)",
    )


def _role_problems(
    table: StageTable, spec: StageSpec, roles: Sequence[str] | None
) -> list[ConfigProblem]:
    r = ConfigReader()
    if spec.needs_role and table.role is None:
        r.problem(
            table.key("role"),
            "required",
            f"stage kind {spec.name!r} calls a role's engines: name the role",
        )
    if table.role is not None and roles is not None and table.role not in roles:
        r.problem(
            table.key("role"),
            "reference",
            f"role {table.role!r} is not configured under [roles] (configured: "
            f"{', '.join(sorted(roles))})",
        )
    return r.problems


def _built_problems(table: StageTable, stage: object, kind: str) -> list[ConfigProblem]:
    if not isinstance(stage, Stage):
        why = f"built {stage!r}, which is not a Stage (name, role, models, fields and an async "
        why += "run(samples, ctx))"
    elif stage.name != table.name:
        why = f"built a stage called {stage.name!r}; it must take the table's name, "
        why += f"{table.name!r} (StageConfig.name)"
    else:
        return []
    return [ConfigProblem(table.path, "stage", f"{kind} {why}")]


# -- the reward stage ----------------------------------------------------------------------------


def read_rewards(
    r: ConfigReader, raw: object, path: str, plugins: PluginLookup, *, deferred: bool = False
) -> list[tuple[Any, float, str]]:
    """A ``rewards = [{ adapter, weight, key }]`` list as ``(RewardSpec, weight, key)``
    entries; its problems go into ``r`` at ``path[i]``."""
    if raw is None:
        r.problem(
            path,
            "required",
            'give at least one reward adapter: rewards = [{ adapter = "exact-match" }]',
        )
        return []
    if not isinstance(raw, list) or not raw:
        r.problem(
            path, "type", f"must be a non-empty list of {{adapter, weight}} tables, got {raw!r}"
        )
        return []
    registered = plugins.registered("reward_adapters")
    out: list[tuple[Any, float, str]] = []
    keys: set[str] = set()
    for i, item in enumerate(raw):
        where = f"{path}[{i}]"
        if not isinstance(item, Mapping):
            r.problem(where, "type", f"must be a table {{adapter, weight}}, got {item!r}")
            continue
        t = r.table(dict(item), where, ("adapter", "weight", "key"))
        name = r.value(t, where, "adapter", str, None, required=True, check=ConfigReader.non_empty)
        weight = r.value(t, where, "weight", float, 1.0, check=ConfigReader.finite)
        key = r.value(t, where, "key", str, None, check=ConfigReader.non_empty)
        if name is None:
            continue
        key = key or name
        if key in keys:
            twice = key == name
            what = f"reward adapter {name!r} is listed twice" if twice else f"key {key!r} repeats"
            where += ".adapter" if twice else ".key"
            r.problem(where, "duplicate", f'{what}; give each a key = "..." of its own')
            continue
        keys.add(key)
        entry = registered.get(name)
        if entry is None:
            r.problem(
                where,
                "plugin",
                f"no reward adapter {name!r} is registered (registered: "
                f"{', '.join(sorted(registered)) or 'none'}); install its plugin",
            )
            continue
        if deferred and not entry.record.supports_deferred:
            r.problem(
                where,
                "defer-adapter",
                f"reward adapter {name!r} (from {entry.distribution}) does not declare "
                "supports_deferred, so it cannot score a staged batch in a deferred phase; "
                "use an adapter that does, or a split layout",
            )
            continue
        out.append((entry.record, float(weight), key))
    return out


def _reward_stage(config: StageConfig, r: ConfigReader, *, name: str) -> RewardStage | None:
    entries = read_rewards(
        r, config.options.get("rewards"), config.key("rewards"), config.plugins,
        deferred=config.deferred,
    )  # fmt: skip
    concurrency = r.value(
        config.options, config.path, "concurrency", int, 64, check=ConfigReader.at_least(1)
    )
    if not entries:
        return None
    return RewardStage(
        entries,
        name=name,
        role=config.role,
        models=config.models,
        concurrency=concurrency,
        timeout=config.run.request_timeout,
        retries=config.table.retries,
    )


def build_reward_stage(config: StageConfig) -> RewardStage:
    """The ``reward`` kind: a :class:`~relax_core.coordination.RewardStage` from ``rewards``.

    :raises ConfigValidationError: every problem of its table."""
    r = ConfigReader()
    stage = _reward_stage(config, r, name=config.name)
    r.raise_problems()
    assert stage is not None
    return stage


_REWARD_KEYS = ("rewards", "concurrency")
#: The core's reward stage kind.
REWARD = StageSpec(
    name="reward",
    build=build_reward_stage,
    options=_REWARD_KEYS,
    description="Reward adapters over the batch: fields reward (weighted sum) and rewards.",
)


# -- evaluation ----------------------------------------------------------------------------------


@attrs.define(eq=False)
class EvalStage:
    """Every ``every`` steps, ``prompts`` held-out prompts generated with the step's policy,
    scored by ``scorer`` and reported; its samples never join the batch."""

    fields = ()

    name: str
    source: Callable[[], PromptSource] = attrs.field(kw_only=True)
    scorer: RewardStage = attrs.field(kw_only=True)
    every: int = attrs.field(default=1, kw_only=True)
    prompts: int = attrs.field(default=4, kw_only=True)
    samples_per_prompt: int = attrs.field(default=1, kw_only=True)
    temperature: float = attrs.field(default=0.0, kw_only=True)
    background: bool = attrs.field(default=False, kw_only=True)
    role: str | None = attrs.field(default=None, init=False)
    models: tuple[str, ...] = attrs.field(default=(), init=False)
    _opened: PromptSource | None = attrs.field(default=None, init=False)

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles its work calls besides the generation role: its scorer's."""
        return () if self.scorer.role is None else (self.scorer.role,)

    def due(self, step: int) -> bool:
        """Whether step ``step`` is one of every ``every``."""
        return step % self.every == 0

    async def run(self, samples: Sequence[Sample], ctx: StageContext) -> StageReport:
        """Evaluate on this step if it is one of every ``every``; else report ``skipped``."""
        if not self.due(ctx.batch_id):
            return StageReport(self.name, {"skipped": 1})
        if self._opened is None:
            self._opened = self.source()
        held_out = await ctx.generate(
            prompts=self._opened.take(self.prompts),
            samples_per_prompt=self.samples_per_prompt,
            temperature=self.temperature,
        )
        scored = await ctx.run_stage(self.scorer, held_out)
        rewards = [float(s.reward) for s in held_out if s.reward is not None]
        counts: dict[str, float] = {
            "samples": len(held_out),
            "scored": len(rewards),
            "reward_mean": statistics.fmean(rewards) if rewards else math.nan,
            "reward_std": statistics.pstdev(rewards) if rewards else math.nan,
        }
        counts.update({f"{self.scorer.name}.{k}": v for k, v in scored.counts.items()})
        return StageReport(self.name, counts, {"sample_ids": [s.id for s in held_out]})


def build_eval_stage(config: StageConfig) -> EvalStage:
    """The ``eval`` kind (its keys: ``docs/run.md``).

    :raises ConfigValidationError: every problem of its table (a dataset no source reads)."""
    r = ConfigReader()
    o, p = config.options, config.path
    dataset = r.value(o, p, "dataset", str, None, required=True, check=ConfigReader.non_empty)
    every = r.value(o, p, "every", int, 1, check=ConfigReader.at_least(1))
    prompts = r.value(
        o, p, "prompts", int, config.run.prompts_per_step, check=ConfigReader.at_least(1)
    )
    samples = r.value(o, p, "samples_per_prompt", int, 1, check=ConfigReader.at_least(1))
    temperature = r.value(o, p, "temperature", float, 0.0, check=ConfigReader.at_least(0))
    background = r.value(o, p, "background", bool, False)
    if background and config.run.mode != "async":
        r.problem(
            config.key("background"),
            "background",
            "a background evaluation runs beside the steps that follow its own, which only "
            'asynchronous steps have: set [run] mode = "async", or remove background',
        )
    scorer = _reward_stage(config, r, name=f"{config.name}.rewards")
    where = {"seed": config.run.seed, "key": config.key("dataset"), "base": config.run.base}
    if dataset is not None:
        r.problems.extend(source_problems(dataset, config.plugins, **where))
    r.raise_problems()
    assert scorer is not None and dataset is not None
    return EvalStage(
        config.name,
        source=lambda: open_source(dataset, config.plugins, **where),
        scorer=scorer,
        every=every,
        prompts=prompts,
        samples_per_prompt=samples,
        temperature=temperature,
        background=bool(background),
    )


_EVAL_KEYS = ("dataset", "every", "prompts", "samples_per_prompt", "temperature")
#: The core's evaluation stage kind.
EVAL = StageSpec(
    name="eval",
    build=build_eval_stage,
    options=(*_EVAL_KEYS, *_REWARD_KEYS, "background"),
    description="Every K steps: held-out prompts generated, scored and reported; never trained on.",
)


@hookimpl
def relax_register_stages(register: Callable[[StageSpec], None]) -> None:
    """Register the core's stage kinds: ``reward`` and ``eval``."""
    register(REWARD)
    register(EVAL)
