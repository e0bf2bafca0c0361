"""The ``[run]`` table of a job file: what ``relax run`` does each step.

Parsed with the job file's own rules (:class:`~relax_core.config.ConfigReader`): types, ranges
and choices are checked, unknown keys are errors with a "did you mean" hint, and every problem
is reported at once with its key path (``run.stages[1].top_k``).

A step's stages are listed in order as ``[[run.stages]]`` tables, each naming a registered kind
of stage (``stage = "reward"``) with its own keys; only their common keys (``stage``,
``name``, ``role``, ``models``) are read here, the rest by the stage's own builder
(:mod:`relax_core.run.stages`). Without ``[[run.stages]]``, the shorthand keys describe
today's step: ``rewards`` (and ``reward_role``) make the reward stage, ``teacher_role`` (and
``teacher_mode``, ``top_k``) the distillation stage after it. What the table says about the
roles (that a stage's role is configured, that the generation role is updatable) is checked
against the whole job by :func:`relax_core.run.job.run_problems`.

``docs/run.md`` lists every key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from relax_core.config import ConfigReader, JobConfig
from relax_core.records import NAME_PATTERN
from relax_core.tracking.tracker import TrackerEntry

if TYPE_CHECKING:
    from relax_core.plugins import PluginManager
    from relax_core.records import TrainerSpec

__all__ = [
    "CHECKPOINT_EVERY",
    "DISTILL_STAGE",
    "PUSH_BUCKET_BYTES",
    "PUSH_FORMATS",
    "PUSH_PAUSES",
    "REWARD_STAGE",
    "RUN_MODES",
    "STALE_ACTIONS",
    "TEACHER_MODES",
    "GenerationTable",
    "RunConfig",
    "StageTable",
    "parse_run_config",
]

#: ``teacher_mode`` values: the teacher's log-prob of each sampled token, or its top-k.
TEACHER_MODES = ("sampled", "top-k")
#: ``push_format`` values: the trainer's weights as safetensors bytes (any host, any device),
#: SGLang's own torch format (CUDA IPC handles: the engines must be on the trainer's GPU), or a
#: torch.distributed broadcast from the trainer (rank 0) to every replica (gloo on CPU, NCCL on
#: CUDA). Each pushes the weights in buckets of ``push_bucket_bytes``.
PUSH_FORMATS = ("safetensors", "ipc", "distributed")
#: ``checkpoint_every``'s default: a checkpoint of the run every this many committed steps
#: (and after the last), in the run's directory (``relax run --resume``; 0: none).
CHECKPOINT_EVERY = 10
#: ``push_bucket_bytes``' default: the size of one bucket of a weight push (512 MiB).
PUSH_BUCKET_BYTES = 512 << 20
#: ``mode`` values: each step's phases one after the other, or generation of the next steps
#: overlapping the scoring, commit and training of this one (``docs/run.md``).
RUN_MODES = ("sync", "async")
#: ``stale_action`` values: what the async driver does with a group generated with weights more
#: than ``max_staleness`` versions older than the trainer's: generate another in its place, or
#: train on a smaller batch. Either way it is counted, never trained on.
STALE_ACTIONS = ("regenerate", "drop")
#: ``push_pause`` values: how a weight push meets rollout's requests in flight — the manager's
#: fence (admission closed, the requests finished first), or SGLang's ``pause_generation`` in
#: that mode, the update, ``continue_generation`` (``in_place``, ``retract``: the requests
#: kept, their tokens after the push from the new weights; ``abort``: they end with what they
#: had, and the rollout shape sends each on from its tokens, with the new weights).
PUSH_PAUSES = ("fence", "in_place", "retract", "abort")
#: The kind of stage the ``rewards`` shorthand makes (the core's own reward stage).
REWARD_STAGE = "reward"
#: The kind of stage the ``teacher_role`` shorthand makes: the distillation prefill the
#: ``relax-teacher`` distribution registers.
DISTILL_STAGE = "distill"

#: Every stage table's own keys; the others are the stage kind's options.
COMMON_STAGE_KEYS = ("stage", "name", "role", "models", "retries")
#: ``on_empty_batch`` values: what a step whose stages dropped every group does — nothing is
#: committed nor trained either way; ``skip`` goes on with the next step, ``fail`` fails the
#: step (counted against ``max_failed_steps``).
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
    """One stage of the step as the job file gives it: its kind (a registered
    :class:`~relax_core.records.StageSpec`), its name in the step (default: its role, else its
    kind), the role whose lease it takes, the models of that role it uses, the rest of its
    table (``options``, read by the kind's builder) and the key path of the table
    (``run.stages[2]``); ``keys`` maps a key of the table to where the job file has it when
    that is elsewhere (the shorthand's ``role`` is ``run.teacher_role``)."""

    kind: str
    name: str
    role: str | None = None
    models: tuple[str, ...] = ()
    options: Mapping[str, Any] = attrs.field(factory=dict)
    path: str = "run"
    keys: Mapping[str, str] = attrs.field(factory=dict)
    #: the table's ``retries`` (``None``: the kind's default, ``StageSpec.retries``)
    retries: int | None = None

    def key(self, option: str) -> str:
        """The key path of one of the table's keys (``run.stages[2].top_k``)."""
        return self.keys.get(option, f"{self.path}.{option}")


@attrs.frozen
class GenerationTable:
    """``[run.generation]``: the rollout shape a step generates with (a registered
    :class:`~relax_core.records.RolloutShapeSpec`, default ``single-turn``) and the rest of
    the table (``options``, read by the shape's builder); ``path`` is the table's key path."""

    shape: str = "single-turn"
    options: Mapping[str, Any] = attrs.field(factory=dict)
    path: str = "run.generation"


@attrs.frozen
class RunConfig:
    """What each step of ``relax run`` does (the ``[run]`` table).

    ``dataset`` names a registered prompt source or a file one reads (as written; resolved
    against the job file's directory, ``base``, when opened). ``stages`` are the step's
    stages in order (:class:`StageTable`). ``trainer`` is the trainer's name (the one
    registered trainer when the table names none) or a ``package.module:ClassName`` path;
    ``trainer_options`` the instance of its options record
    (:attr:`~relax_core.records.TrainerSpec.options`) read from the table's other keys
    (``learning_rate``…), ``None`` when it has none. ``partial_rollout`` is accepted only so
    the defer preflight can say why it is refused.

    ``mode`` is ``sync`` (each step's phases in turn) or ``async``: generation of steps
    ``N+1 … N+max_staleness`` runs while step ``N`` is scored, committed and trained, and no
    sample generated with weights more than ``max_staleness`` versions older than the
    trainer's is trained on (``stale_action``: generated again or dropped, counted).
    ``stream_scoring`` (async mode): the leading stages that can (the reward stage, the
    teacher's prefill) score each group as it completes, ``stream_concurrency`` groups at a
    time, where their role is not deferred.
    ``push_pause``: how a push meets rollout's requests in flight (:data:`PUSH_PAUSES`;
    ``in_place`` by default in async mode, the fence otherwise). ``push_bucket_bytes``: the
    size of one bucket of a push (one flat buffer, one engine call; a larger tensor gets a
    bucket of its own), :data:`PUSH_BUCKET_BYTES` by default. ``checkpoint_every``: a
    checkpoint every this many committed steps and after the last, where the run has a
    directory (:mod:`~relax_core.run.checkpoint`; 0: none).
    """

    steps: int = 3
    dataset: str = "arithmetic"
    prompts_per_step: int = 4
    samples_per_prompt: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    stages: tuple[StageTable, ...] = ()
    generation: GenerationTable = GenerationTable()
    seed: int = 0
    trainer: str = ""
    trainer_options: Any = None
    trainer_device: str = "cpu"
    push_format: str = "safetensors"
    operation_timeout: float = 180.0
    request_timeout: float = 300.0
    partial_rollout: bool = False
    trackers: tuple[TrackerEntry, ...] = ()
    tracker_samples: int = 4
    strict_trackers: bool = False
    checkpoint_every: int = CHECKPOINT_EVERY
    mode: str = "sync"
    max_staleness: int = 1
    stale_action: str = "regenerate"
    stream_scoring: bool = True
    stream_concurrency: int = 8
    push_pause: str = "fence"
    push_bucket_bytes: int = PUSH_BUCKET_BYTES
    max_failed_steps: int = 3
    generation_retries: int = 2
    on_empty_batch: str = "skip"
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


def _device(v: Any) -> str | None:
    if v == "cpu" or v == "cuda" or (v.startswith("cuda:") and v[5:].isdigit()):
        return None
    return f"must be cpu, cuda or cuda:N, got {v!r}"


def _trainer(v: Any) -> str | None:
    """A registered trainer's name (whether one is registered is checked against the plugins,
    by ``run_problems``) or a ``package.module:ClassName`` path."""
    module, colon, name = v.partition(":")
    if not colon and NAME_PATTERN.match(v):
        return None
    if module and name and all(p.isidentifier() for p in (*module.split("."), name)):
        return None
    return (
        "must be 'package.module:ClassName' or a registered trainer's name (relax plugins "
        f"lists them), got {v!r}"
    )


def parse_run_config(job: JobConfig, pm: PluginManager | None = None) -> RunConfig:
    """The job's ``[run]`` table as a :class:`RunConfig` (an absent table: the defaults).

    The trainer (``trainer``, or the one trainer registered in ``pm``, default the
    process-wide plugin manager) reads its own keys of the table through its options record
    (:attr:`~relax_core.records.TrainerSpec.options`); any other key is unknown.

    :raises ConfigValidationError: every problem, each with its ``run.*`` key path.
    """
    r = ConfigReader()
    p = "run"
    raw = dict(job.run)
    spec = _trainer_spec(r, raw, pm)
    option_keys = _option_keys(spec)
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
    config = RunConfig(
        steps=v(t, p, "steps", int, 3, check=ConfigReader.at_least(1)),
        dataset=v(t, p, "dataset", str, "arithmetic", check=ConfigReader.non_empty),
        prompts_per_step=v(t, p, "prompts_per_step", int, 4, check=ConfigReader.at_least(1)),
        samples_per_prompt=v(t, p, "samples_per_prompt", int, 4, check=ConfigReader.at_least(1)),
        max_new_tokens=v(t, p, "max_new_tokens", int, 16, check=ConfigReader.at_least(1)),
        temperature=v(t, p, "temperature", float, 1.0, check=ConfigReader.at_least(0)),
        stages=stages,
        generation=_generation_table(r, t.get("generation")),
        seed=v(t, p, "seed", int, 0),
        trainer=v(t, p, "trainer", str, spec.name if spec else "", check=_trainer),
        trainer_options=trainer_options,
        trainer_device=v(t, p, "trainer_device", str, "cpu", check=_device),
        push_format=v(
            t, p, "push_format", str, "safetensors", check=ConfigReader.one_of(PUSH_FORMATS)
        ),
        operation_timeout=v(t, p, "operation_timeout", float, 180.0, check=ConfigReader.positive),
        request_timeout=v(t, p, "request_timeout", float, 300.0, check=ConfigReader.positive),
        partial_rollout=v(t, p, "partial_rollout", bool, False),
        trackers=tracker_entries(r, t.get("trackers", []), f"{p}.trackers"),
        tracker_samples=v(t, p, "tracker_samples", int, 4, check=ConfigReader.at_least(0)),
        strict_trackers=v(t, p, "strict_trackers", bool, False),
        checkpoint_every=v(
            t, p, "checkpoint_every", int, CHECKPOINT_EVERY, check=ConfigReader.at_least(0)
        ),
        mode=v(t, p, "mode", str, "sync", check=ConfigReader.one_of(RUN_MODES)),
        max_staleness=v(t, p, "max_staleness", int, 1, check=ConfigReader.at_least(0)),
        stale_action=v(
            t, p, "stale_action", str, "regenerate", check=ConfigReader.one_of(STALE_ACTIONS)
        ),
        stream_scoring=v(t, p, "stream_scoring", bool, True),
        stream_concurrency=v(t, p, "stream_concurrency", int, 8, check=ConfigReader.at_least(1)),
        push_pause=v(
            t,
            p,
            "push_pause",
            str,
            "in_place" if t.get("mode") == "async" else "fence",
            check=ConfigReader.one_of(PUSH_PAUSES),
        ),
        push_bucket_bytes=v(
            t, p, "push_bucket_bytes", int, PUSH_BUCKET_BYTES, check=ConfigReader.at_least(1)
        ),
        max_failed_steps=v(t, p, "max_failed_steps", int, 3, check=ConfigReader.at_least(0)),
        generation_retries=v(t, p, "generation_retries", int, 2, check=ConfigReader.at_least(0)),
        on_empty_batch=v(
            t, p, "on_empty_batch", str, "skip", check=ConfigReader.one_of(EMPTY_BATCH_ACTIONS)
        ),
        base=_base(job.source),
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
    """The registered trainer the table names; when it names none, the one registered, or of
    several the one whose record says it is the ``default`` (a problem at ``run.trainer``
    otherwise); ``None`` for a class path or a name
    nobody registered (``run_problems`` says so, listing the registered ones)."""
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


def _option_keys(spec: TrainerSpec | None) -> tuple[str, ...]:
    """The ``[run]`` keys the trainer's options record reads."""
    if spec is None or spec.options is None:
        return ()
    return tuple(f.alias or f.name for f in attrs.fields(spec.options) if f.init)


def tracker_entries(r: ConfigReader, raw: object, path: str) -> tuple[TrackerEntry, ...]:
    """``[run] trackers``: each entry a tracker's name (``"tensorboard"``) or a table naming
    it with its options (``{ tracker = "wandb", project = "rl" }``); whether each is
    registered, and its options known, is checked against the plugins
    (:func:`~relax_core.tracking.tracker_problems`)."""
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


def _base(source: str | None) -> str | None:
    """The directory relative paths of the run are relative to: the job file's."""
    if source is None:
        return None
    return str(Path(source).resolve().parent)


def resolve_path(path: str, base: str | None) -> str:
    """``path`` made absolute against ``base`` (the job file's directory; the working
    directory without one)."""
    if os.path.isabs(path):
        return path
    return str((Path(base) if base else Path.cwd()).joinpath(path).resolve())


def _generation_table(r: ConfigReader, raw: object) -> GenerationTable:
    """``[run.generation]``: its ``shape`` (a name; whether one is registered, and the rest of
    the table, is checked against the plugins by the shape's builder)."""
    p = "run.generation"
    if raw is None:
        return GenerationTable()
    if not isinstance(raw, Mapping):
        r.problem(p, "type", f"must be a table ([run.generation]), got {raw!r}")
        return GenerationTable()
    t = dict(raw)
    shape = r.value(t, p, "shape", str, "single-turn", check=_stage_name)
    options = {k: val for k, val in t.items() if k != "shape"}
    return GenerationTable(shape or "single-turn", options, p)


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
    """The default stages from ``rewards`` / ``reward_role`` and ``teacher_role`` /
    ``teacher_mode`` / ``top_k`` (key paths stay ``run.*``)."""
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
        keys = {
            "role": "run.teacher_role",
            "stage": "run.teacher_role",
            "mode": "run.teacher_mode",
        }
        stages.append(
            StageTable(DISTILL_STAGE, teacher_role, teacher_role, options=options, keys=keys)
        )
    return tuple(stages)
