"""The ``[run]`` table of a job file: what ``relax run`` does each step.

Parsed with the job file's own rules (:mod:`relax_core.config`): types, ranges and choices are
checked, unknown keys are errors with a "did you mean" hint, and every problem is reported at
once with its key path (``run.rewards[1].weight``). What the table says about the roles (that
``reward_role`` is configured, that the generation role is updatable, the defer preflight) is
checked against the whole job by :func:`relax_core.run.job.run_problems`.

``docs/run.md`` lists every key.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from relax_core.config import ConfigReader, JobConfig
from relax_core.records import NAME_PATTERN

__all__ = [
    "ARITHMETIC",
    "DEFAULT_TRAINER",
    "PUSH_FORMATS",
    "TEACHER_MODES",
    "RewardWeight",
    "RunConfig",
    "parse_run_config",
]

#: The built-in prompt source: generated arithmetic questions with known answers.
ARITHMETIC = "arithmetic"
#: ``teacher_mode`` values: the teacher's log-prob of each sampled token, or its top-k.
TEACHER_MODES = ("sampled", "top-k")
#: ``push_format`` values: the trainer's weights as safetensors bytes (any host, any device),
#: or SGLang's own torch format (CUDA IPC handles: the engines must be on the trainer's GPU).
PUSH_FORMATS = ("safetensors", "ipc")
#: The trainer ``relax run`` uses unless ``trainer`` names another: the registered name of the
#: reference torch trainer (GRPO plus distillation), which the ``relax-torch-trainer``
#: distribution registers.
DEFAULT_TRAINER = "grpo"


@attrs.frozen
class RewardWeight:
    """One reward adapter of the reward stage and its weight in the sample's reward."""

    adapter: str
    weight: float = 1.0


@attrs.frozen
class RunConfig:
    """What each step of ``relax run`` does (the ``[run]`` table).

    ``dataset`` is :data:`ARITHMETIC` or the path of a JSONL file (resolved against the job
    file's directory). ``reward_role`` is the role the reward stage's model-backed adapters
    call (its lease is taken for the stage when it is deferred); ``teacher_role`` the role
    prefilled for distillation (none: no teacher stage). The features a deferred batch cannot
    stage (``partial_rollout``, ``dynamic_batch``, ``filter_hooks``, ``eval_dataset``) are
    accepted as keys only so the defer preflight can say why they are refused.
    """

    steps: int = 3
    dataset: str = ARITHMETIC
    prompts_per_step: int = 4
    samples_per_prompt: int = 4
    max_new_tokens: int = 16
    temperature: float = 1.0
    rewards: tuple[RewardWeight, ...] = ()
    reward_role: str | None = None
    teacher_role: str | None = None
    teacher_mode: str = "sampled"
    top_k: int = 8
    distill_coef: float = 1.0
    learning_rate: float = 1e-5
    clip: float = 0.2
    seed: int = 0
    trainer: str = DEFAULT_TRAINER
    trainer_device: str = "cpu"
    push_format: str = "safetensors"
    operation_timeout: float = 180.0
    request_timeout: float = 300.0
    partial_rollout: bool = False
    dynamic_batch: bool = False
    filter_hooks: tuple[str, ...] = ()
    eval_dataset: str | None = None

    @property
    def teacher_top_k(self) -> int:
        """The top-k width the teacher stage asks for (0 in sampled mode)."""
        return self.top_k if self.teacher_mode == "top-k" else 0


_KEYS = tuple(f.name for f in attrs.fields(RunConfig))
_REWARD_KEYS = ("adapter", "weight")


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


def parse_run_config(job: JobConfig) -> RunConfig:
    """The job's ``[run]`` table as a :class:`RunConfig` (an absent table: the defaults).

    A relative ``dataset`` path is resolved against the directory of the job file
    (``job.source``; the working directory for a config given as text).

    :raises ConfigValidationError: every problem, each with its ``run.*`` key path.
    """
    r = ConfigReader()
    p = "run"
    t = r.table(dict(job.run), p, _KEYS)
    v = r.value
    rewards = _rewards(r, t.get("rewards"))
    dataset = v(t, p, "dataset", str, ARITHMETIC, check=ConfigReader.non_empty)
    if dataset != ARITHMETIC:
        dataset = _resolve(dataset, job.source)
    teacher_role = v(t, p, "teacher_role", str, None, check=ConfigReader.non_empty)
    mode = v(t, p, "teacher_mode", str, "sampled", check=ConfigReader.one_of(TEACHER_MODES))
    if "top_k" in t and mode != "top-k":
        r.problem(f"{p}.top_k", "teacher-mode", "top_k applies to teacher_mode = 'top-k' only")
    for key in ("teacher_mode", "top_k", "distill_coef"):
        if key in t and teacher_role is None:
            r.problem(
                f"{p}.{key}",
                "teacher-role",
                "there is no teacher stage without teacher_role; name the role to distill from",
            )
    eval_dataset = v(t, p, "eval_dataset", str, None, check=ConfigReader.non_empty)
    config = RunConfig(
        steps=v(t, p, "steps", int, 3, check=ConfigReader.at_least(1)),
        dataset=dataset,
        prompts_per_step=v(t, p, "prompts_per_step", int, 4, check=ConfigReader.at_least(1)),
        samples_per_prompt=v(t, p, "samples_per_prompt", int, 4, check=ConfigReader.at_least(1)),
        max_new_tokens=v(t, p, "max_new_tokens", int, 16, check=ConfigReader.at_least(1)),
        temperature=v(t, p, "temperature", float, 1.0, check=ConfigReader.at_least(0)),
        rewards=rewards,
        reward_role=v(t, p, "reward_role", str, None, check=ConfigReader.non_empty),
        teacher_role=teacher_role,
        teacher_mode=mode,
        top_k=v(t, p, "top_k", int, 8, check=ConfigReader.at_least(1)),
        distill_coef=v(t, p, "distill_coef", float, 1.0, check=ConfigReader.at_least(0)),
        learning_rate=v(t, p, "learning_rate", float, 1e-5, check=ConfigReader.positive),
        clip=v(t, p, "clip", float, 0.2, check=ConfigReader.positive),
        seed=v(t, p, "seed", int, 0),
        trainer=v(t, p, "trainer", str, DEFAULT_TRAINER, check=_trainer),
        trainer_device=v(t, p, "trainer_device", str, "cpu", check=_device),
        push_format=v(
            t, p, "push_format", str, "safetensors", check=ConfigReader.one_of(PUSH_FORMATS)
        ),
        operation_timeout=v(t, p, "operation_timeout", float, 180.0, check=ConfigReader.positive),
        request_timeout=v(t, p, "request_timeout", float, 300.0, check=ConfigReader.positive),
        partial_rollout=v(t, p, "partial_rollout", bool, False),
        dynamic_batch=v(t, p, "dynamic_batch", bool, False),
        filter_hooks=r.str_list(t, p, "filter_hooks"),
        eval_dataset=eval_dataset,
    )
    if config.push_format == "ipc" and not config.trainer_device.startswith("cuda"):
        r.problem(
            f"{p}.push_format",
            "push-format",
            "ipc pushes CUDA IPC handles of the trainer's tensors: it needs trainer_device = "
            "'cuda' on the engines' GPU; use 'safetensors'",
        )
    r.raise_problems(job.source)
    return config


def _resolve(path: str, source: str | None) -> str:
    if os.path.isabs(path) or source is None:
        return os.path.abspath(path)
    return str((Path(source).resolve().parent / path).resolve())


def _rewards(r: ConfigReader, raw: object) -> tuple[RewardWeight, ...]:
    p = "run.rewards"
    if raw is None:
        r.problem(
            p,
            "required",
            'give at least one reward adapter: rewards = [{ adapter = "exact-match" }]',
        )
        return ()
    if not isinstance(raw, list) or not raw:
        r.problem(p, "type", f"must be a non-empty list of {{adapter, weight}} tables, got {raw!r}")
        return ()
    out: list[RewardWeight] = []
    seen: set[str] = set()
    for i, entry in enumerate(raw):
        where = f"{p}[{i}]"
        if not isinstance(entry, Mapping):
            r.problem(where, "type", f"must be a table {{adapter, weight}}, got {entry!r}")
            continue
        t = r.table(dict(entry), where, _REWARD_KEYS)
        name = r.value(t, where, "adapter", str, None, required=True, check=ConfigReader.non_empty)
        weight = r.value(t, where, "weight", float, 1.0, check=ConfigReader.finite)
        if name is None:
            continue
        if name in seen:
            r.problem(f"{where}.adapter", "duplicate", f"reward adapter {name!r} is listed twice")
            continue
        seen.add(name)
        out.append(RewardWeight(name, weight))
    return tuple(out)
