"""The ``[run]`` table of a job file (``docs/run.md`` lists every key): of ``[[run.stages]]``
only the common keys are read here; without it the shorthand keys (``rewards``,
``teacher_role``…) make the default stages."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from relax_core.config import Check, ConfigReader, JobConfig
from relax_core.records import NAME_PATTERN
from relax_core.tracking.tracker import TrackerEntry

if TYPE_CHECKING:
    from relax_core.plugins import PluginManager
    from relax_core.records import TrainerSpec

#: ``teacher_mode`` values: the teacher's log-prob of each sampled token, or its top-k.
TEACHER_MODES = ("sampled", "top-k")
#: ``push_format`` values: safetensors bytes (any host, any device), CUDA IPC handles (the
#: engines on the trainer's GPU), or a torch.distributed broadcast to every replica.
PUSH_FORMATS = ("safetensors", "ipc", "distributed")
#: ``checkpoint_every``'s default: a checkpoint every this many committed steps (0: none).
CHECKPOINT_EVERY = 10
#: ``push_bucket_bytes``' default: the size of one bucket of a weight push (512 MiB).
PUSH_BUCKET_BYTES = 512 << 20
#: ``mode`` values: each step's phases in turn, or generation overlapping the rest.
RUN_MODES = ("sync", "async")
#: ``stale_action`` values: what the async driver does with a group too stale to train on.
STALE_ACTIONS = ("regenerate", "drop")
#: ``push_pause`` values: how a weight push meets rollout's requests in flight — the manager's
#: fence, or SGLang's ``pause_generation`` in that mode (``docs/run.md``).
PUSH_PAUSES = ("fence", "in_place", "retract", "abort")
#: The kind of stage the ``rewards`` shorthand makes (the core's own reward stage).
REWARD_STAGE = "reward"
#: The kind of stage the ``teacher_role`` shorthand makes (the ``relax-teacher`` plugin's).
DISTILL_STAGE = "distill"

#: Every stage table's own keys; the others are the stage kind's options.
COMMON_STAGE_KEYS = ("stage", "name", "role", "models", "retries")
#: ``on_empty_batch`` values: what a step whose stages dropped every group does.
EMPTY_BATCH_ACTIONS = ("skip", "fail")
#: Keys the table no longer has, and where what they did went.
_MOVED = {
    "eval_dataset": 'evaluation is a stage: [[run.stages]] stage = "eval" with its dataset',
    "filter_hooks": "a filter is a stage: list it under [[run.stages]] (e.g. the "
    'relax-dynamic-sampling plugin\'s stage = "dynamic-sampling")',
    "dynamic_batch": "over-sampling to fill the batch is a stage: [[run.stages]] stage = "
    '"dynamic-sampling" (the relax-dynamic-sampling plugin)',
}


@attrs.frozen
class StageTable:
    """One stage of the step as the job file gives it; ``keys`` maps a key to where the job
    file has it when that is elsewhere (the shorthand's ``role`` is ``run.teacher_role``)."""

    kind: str
    name: str
    role: str | None = None
    models: tuple[str, ...] = ()
    options: Mapping[str, Any] = attrs.field(factory=dict)
    path: str = "run"
    keys: Mapping[str, str] = attrs.field(factory=dict)
    #: ``None``: the kind's default
    retries: int | None = None

    def key(self, option: str) -> str:
        """The key path of one of the table's keys (``run.stages[2].top_k``)."""
        return self.keys.get(option, f"{self.path}.{option}")


@attrs.frozen
class GenerationTable:
    """``[run.generation]``: the rollout shape and its ``options``."""

    shape: str = "single-turn"
    options: Mapping[str, Any] = attrs.field(factory=dict)
    path: str = "run.generation"


def _device(v: Any) -> str | None:
    if v == "cpu" or v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit()):
        return None
    return f"must be cpu, cuda or cuda:N, got {v!r}"


def _trainer(v: Any) -> str | None:
    module, colon, name = v.partition(":")
    if not colon and NAME_PATTERN.match(v):
        return None
    if module and name and all(p.isidentifier() for p in (*module.split("."), name)):
        return None
    return (
        "must be 'package.module:ClassName' or a registered trainer's name (relax plugins "
        f"lists them), got {v!r}"
    )


def _key(default: Any, check: Check | None = None) -> Any:
    """A ``[run]`` key read as one value of its default's type (``int``, ``float``, ``str`` or
    ``bool``), checked by ``check``."""
    return attrs.field(default=default, metadata={"plain": True, "check": check})


_at_least, _one_of = ConfigReader.at_least, ConfigReader.one_of


@attrs.frozen
class RunConfig:
    """The ``[run]`` table (each key in ``docs/run.md``); ``dataset`` is relative to ``base``
    (the job file's directory); ``trainer_options``: the trainer's options record, if any."""

    steps: int = _key(3, _at_least(1))
    dataset: str = _key("arithmetic", ConfigReader.non_empty)
    prompts_per_step: int = _key(4, _at_least(1))
    samples_per_prompt: int = _key(4, _at_least(1))
    max_new_tokens: int = _key(16, _at_least(1))
    temperature: float = _key(1.0, _at_least(0))
    stages: tuple[StageTable, ...] = ()
    generation: GenerationTable = GenerationTable()
    seed: int = _key(0)
    trainer: str = _key("", _trainer)
    trainer_options: Any = None
    trainer_device: str = _key("cpu", _device)
    push_format: str = _key("safetensors", _one_of(PUSH_FORMATS))
    operation_timeout: float = _key(180.0, ConfigReader.positive)
    request_timeout: float = _key(300.0, ConfigReader.positive)
    partial_rollout: bool = _key(False)
    trackers: tuple[TrackerEntry, ...] = ()
    tracker_samples: int = _key(4, _at_least(0))
    strict_trackers: bool = _key(False)
    checkpoint_every: int = _key(CHECKPOINT_EVERY, _at_least(0))
    mode: str = _key("sync", _one_of(RUN_MODES))
    max_staleness: int = _key(1, _at_least(0))
    stale_action: str = _key("regenerate", _one_of(STALE_ACTIONS))
    stream_scoring: bool = _key(True)
    stream_concurrency: int = _key(8, _at_least(1))
    push_pause: str = _key("fence", _one_of(PUSH_PAUSES))
    push_bucket_bytes: int = _key(PUSH_BUCKET_BYTES, _at_least(1))
    max_failed_steps: int = _key(3, _at_least(0))
    generation_retries: int = _key(2, _at_least(0))
    on_empty_batch: str = _key("skip", _one_of(EMPTY_BATCH_ACTIONS))
    base: str | None = None

    def stage(self, name: str) -> StageTable:
        """The stage called ``name``; :class:`KeyError` naming the step's stages otherwise."""
        for table in self.stages:
            if table.name == name:
                return table
        raise KeyError(f"no stage {name!r}; the step's stages: {[t.name for t in self.stages]}")


_SHORTHAND = ("rewards", "reward_role", "teacher_role", "teacher_mode", "top_k")
_KEYS = (
    *[
        f.name
        for f in attrs.fields(RunConfig)
        if f.name not in ("stages", "generation", "base", "trainer_options")
    ],
    "generation",
    "stages",
    *_SHORTHAND,
    *_MOVED,
)


def parse_run_config(job: JobConfig, pm: PluginManager | None = None) -> RunConfig:
    """The job's ``[run]`` table as a :class:`RunConfig` (an absent table: the defaults).

    :raises ConfigValidationError: every problem, each with its ``run.*`` key path."""
    r = ConfigReader()
    p = "run"
    raw = dict(job.run)
    spec = _trainer_spec(r, raw, pm)
    option_keys: tuple[str, ...] = ()
    if spec is not None and spec.options is not None:
        option_keys = tuple(f.alias or f.name for f in attrs.fields(spec.options) if f.init)
    named = raw.get("trainer")
    if spec is None and isinstance(named, str) and NAME_PATTERN.match(named):
        # A trainer nobody registered (run_problems says so): its keys cannot be told yet.
        option_keys = tuple(k for k in raw if k not in _KEYS)
    t = r.table(raw, p, (*_KEYS, *option_keys), unlisted=_MOVED)
    v = r.value
    for key, where in _MOVED.items():
        if key in t:
            r.problem(f"{p}.{key}", "moved", f"no longer a [run] key: {where} (docs/run.md)")
    if "stages" in t:
        given = [k for k in _SHORTHAND if k in t]
        if given:
            r.problem(
                f"{p}.{given[0]}",
                "stages",
                f"{', '.join(given)} describe the default stages; with [[run.stages]] give "
                "every stage there instead (a reward stage lists its rewards in its own table)",
            )
        stages = _stage_tables(r, t["stages"])
    else:
        stages = _shorthand(r, t)
    trainer_options = None
    if spec is not None and spec.options is not None:
        own = {k: t[k] for k in option_keys if k in t}
        trainer_options = r.record(own, p, spec.options)
    defaults = {f.name: f.default for f in attrs.fields(RunConfig)}
    defaults["trainer"] = spec.name if spec else ""
    defaults["push_pause"] = "in_place" if t.get("mode") == "async" else "fence"
    plain = {
        f.name: v(t, p, f.name, type(f.default), defaults[f.name], check=f.metadata["check"])
        for f in attrs.fields(RunConfig)
        if f.metadata.get("plain")
    }
    config = RunConfig(
        stages=stages,
        generation=_generation_table(r, t.get("generation")),
        trainer_options=trainer_options,
        trackers=tracker_entries(r, t.get("trackers", []), f"{p}.trackers"),
        base=None if job.source is None else str(Path(job.source).resolve().parent),
        **plain,
    )
    if config.push_format == "ipc" and not config.trainer_device.startswith("cuda"):
        r.problem(
            f"{p}.push_format",
            "push-format",
            "ipc pushes CUDA IPC handles of the trainer's tensors: it needs trainer_device = "
            "'cuda' on the engines' GPU; use 'safetensors'",
        )
    if config.push_format == "distributed" and config.push_pause != "fence":
        r.problem(
            f"{p}.push_format",
            "push-format",
            "distributed pushes through a broadcast group, behind the manager's fence: it needs "
            f"push_pause = 'fence' (it is {config.push_pause!r}; async mode defaults to "
            "'in_place'); use 'safetensors' or 'ipc' to push while requests are paused",
        )
    if config.mode == "sync":
        for key in ("max_staleness", "stale_action", "stream_scoring", "stream_concurrency"):
            if key in t:
                r.problem(
                    f"{p}.{key}",
                    "mode",
                    f"{key} applies to mode = 'async' only; set mode = 'async' or remove it",
                )
    if (
        spec is not None
        and spec.check is not None
        and (spec.options is None or trainer_options is not None)
    ):
        r.problems.extend(spec.check(config))
    r.raise_problems(job.source)
    return config


def _trainer_spec(
    r: ConfigReader, table: Mapping[str, Any], pm: PluginManager | None
) -> TrainerSpec | None:
    """The registered trainer the table names, else the one (or the ``default`` one)."""
    if pm is None:
        from relax_core.plugins import get_plugin_manager

        pm = get_plugin_manager()
    registered = pm.registered("trainers")
    name = table.get("trainer")
    if name is None:
        defaults = [n for n, found in registered.items() if found.record.default]
        only = list(registered) if len(registered) == 1 else defaults
        if len(only) == 1:
            return registered[only[0]].record  # type: ignore[no-any-return]
        if not registered:
            why = "none is registered (install a trainer plugin)"
        else:
            why = f"{len(registered)} are registered ({', '.join(sorted(registered))}) and " + (
                f"{len(defaults)} say they are the default ({', '.join(sorted(defaults))})"
                if defaults
                else "none says it is the default"
            )
        r.problem(
            "run.trainer",
            "required",
            f"name the trainer: {why}; trainer = 'NAME' (relax plugins lists them) or "
            "'package.module:ClassName'",
        )
        return None
    found = registered.get(name) if isinstance(name, str) else None
    return found.record if found is not None else None  # type: ignore[no-any-return]


def tracker_entries(r: ConfigReader, raw: object, path: str) -> tuple[TrackerEntry, ...]:
    """``[run] trackers``: each a tracker's name or a table naming it with its options."""
    if not isinstance(raw, list):
        r.problem(path, "type", f"must be a list of tracker names or tables, got {raw!r}")
        return ()
    out: list[TrackerEntry] = []
    for i, item in enumerate(raw):
        where = f"{path}[{i}]"
        if isinstance(item, str):
            item = {"tracker": item}
        if not isinstance(item, Mapping):
            r.problem(where, "type", f"must be a tracker's name or a table, got {item!r}")
            continue
        name = r.value(item, where, "tracker", str, None, required=True, check=_stage_name)
        if name is not None:
            options = {k: val for k, val in item.items() if k != "tracker"}
            out.append(TrackerEntry(name, options, where))
    return tuple(out)


def _generation_table(r: ConfigReader, raw: object) -> GenerationTable:
    """``[run.generation]``: its ``shape`` name and the rest of the table."""
    p = "run.generation"
    if raw is None:
        return GenerationTable()
    if not isinstance(raw, Mapping):
        r.problem(p, "type", f"must be a table ([run.generation]), got {raw!r}")
        return GenerationTable()
    t = dict(raw)
    shape = r.value(t, p, "shape", str, "single-turn", check=_stage_name)
    return GenerationTable(shape, {k: val for k, val in t.items() if k != "shape"}, p)


def _stage_tables(r: ConfigReader, raw: object) -> tuple[StageTable, ...]:
    """``[[run.stages]]``: each table's common keys checked, its name unique."""
    p = "run.stages"
    if not isinstance(raw, list) or not raw:
        r.problem(p, "type", "must be a non-empty list of [[run.stages]] tables")
        return ()
    out: list[StageTable] = []
    names: dict[str, str] = {}
    for i, entry in enumerate(raw):
        where = f"{p}[{i}]"
        if not isinstance(entry, Mapping):
            r.problem(where, "type", f"must be a table, got {entry!r}")
            continue
        t = dict(entry)
        kind = r.value(t, where, "stage", str, None, required=True, check=_stage_name)
        role = r.value(t, where, "role", str, None, check=ConfigReader.non_empty)
        name = r.value(t, where, "name", str, None, check=_stage_name)
        models = r.str_list(t, where, "models")
        retries = r.value(t, where, "retries", int, None, check=ConfigReader.at_least(0))
        if kind is None:
            continue
        name = name or role or kind
        if name in names:
            r.problem(
                f"{where}.name",
                "duplicate",
                f"two stages are called {name!r} ({names[name]} and {where}); give each a "
                'name = "..." of its own',
            )
            continue
        names[name] = where
        options = {k: val for k, val in t.items() if k not in COMMON_STAGE_KEYS}
        out.append(StageTable(kind, name, role, models, options, where, retries=retries))
    return tuple(out)


def _stage_name(v: Any) -> str | None:
    if NAME_PATTERN.match(v):
        return None
    return "must start with a letter and hold only letters, digits, '_', '.' and '-'"


def _shorthand(r: ConfigReader, t: Mapping[str, Any]) -> tuple[StageTable, ...]:
    """The default stages from the shorthand keys (key paths stay ``run.*``)."""
    p = "run"
    if "rewards" not in t:
        r.problem(
            f"{p}.rewards",
            "required",
            'give at least one reward adapter: rewards = [{ adapter = "exact-match" }] (or '
            "list the step's stages as [[run.stages]])",
        )
    reward_role = r.value(t, p, "reward_role", str, None, check=ConfigReader.non_empty)
    teacher_role = r.value(t, p, "teacher_role", str, None, check=ConfigReader.non_empty)
    mode = r.value(t, p, "teacher_mode", str, "sampled", check=ConfigReader.one_of(TEACHER_MODES))
    top_k = r.value(t, p, "top_k", int, 8, check=ConfigReader.at_least(1))
    if "top_k" in t and mode != "top-k":
        r.problem(f"{p}.top_k", "teacher-mode", "top_k applies to teacher_mode = 'top-k' only")
    for key in ("teacher_mode", "top_k"):
        if key in t and teacher_role is None:
            r.problem(
                f"{p}.{key}",
                "teacher-role",
                "there is no teacher stage without teacher_role; name the role to distill from",
            )
    stages = [
        StageTable(
            REWARD_STAGE,
            reward_role or "rewards",
            reward_role,
            options={"rewards": t.get("rewards")} if "rewards" in t else {},
            keys={"role": "run.reward_role", "stage": "run.rewards"},
        )
    ]
    if teacher_role is not None:
        options = {"mode": mode, "top_k": top_k} if mode == "top-k" else {"mode": mode}
        keys = {"role": "run.teacher_role", "stage": "run.teacher_role", "mode": "run.teacher_mode"}
        stages.append(
            StageTable(DISTILL_STAGE, teacher_role, teacher_role, options=options, keys=keys)
        )
    return tuple(stages)
