"""What an environment of a multi-turn rollout is: the records it takes and gives, and its
Protocol.

An environment is a plugin of ``relax_register_environments`` (an
:class:`~relax_core.records.EnvironmentSpec`); the ``multi-turn`` shape makes one per
trajectory (``spec.make(EnvironmentConfig)``) and drives it:

1. ``reset(prompt) -> Reset``: the trajectory's first messages from the dataset row (a
   :class:`~relax_core.Prompt`: its text, label and metadata), and optionally a ``guide`` for
   the first policy turn (below);
2. per policy turn, ``await step(turn) -> Observation``: the :class:`Turn` (the policy's text
   and ids, its index, the conversation so far) in; the messages to append (tool results,
   the user's next words), an optional reward for the turn, ``done``, and optionally a
   ``guide`` for the next turn;
3. the trajectory ends when the environment says ``done``, after ``max_turns`` policy turns, or
   when ``max_total_tokens`` is reached.

``step`` may be a coroutine function or a plain one (a plain one runs on the event loop: keep
it quick, or run tools through a :class:`~relax_core.agent.ToolBox`, which bounds each call).
Whatever ``reset`` or ``step`` raises fails the step with an
:class:`~relax_core.errors.EnvironmentStepError` naming the environment and the trajectory; a
tool's failure is not the environment's: it is an observation.

A ``guide`` is a constraint on the next policy turn in the engine's constrained-decoding
terms (``{"regex": …}``, ``{"json_schema": …}`` or ``{"ebnf": …}``, sent in the turn's
``sampling_params``): the policy still samples every token, from its own distribution
restricted to what the grammar allows; the log-probs the engine returns are those of the
restricted sampling.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from relax_core.run.data import Prompt

__all__ = [
    "GUIDE_KEYS",
    "Environment",
    "EnvironmentConfig",
    "Observation",
    "Reset",
    "Turn",
]

#: The keys a guide may hold (the engine's constrained-decoding sampling parameters).
GUIDE_KEYS = ("regex", "json_schema", "ebnf")


def _messages(value: Any) -> tuple[dict[str, Any], ...]:
    out = []
    for i, m in enumerate(value):
        if (
            not isinstance(m, Mapping)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
        ):
            raise ValueError(f"messages[{i}] must be an object with string role and content")
        out.append(dict(m))
    return tuple(out)


def _guide(value: Any) -> Mapping[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping) or len(value) != 1 or next(iter(value)) not in GUIDE_KEYS:
        raise ValueError(f"a guide is one of {{{', '.join(GUIDE_KEYS)}: …}}, got {value!r}")
    return dict(value)


@attrs.frozen
class Reset:
    """A trajectory's start: its first ``messages`` (system, user, …) and an optional
    ``guide`` for the first policy turn (see the module docstring)."""

    messages: tuple[dict[str, Any], ...] = attrs.field(converter=_messages)
    guide: Mapping[str, Any] | None = attrs.field(default=None, converter=_guide)

    @messages.validator
    def _some(self, _a: object, value: tuple[dict[str, Any], ...]) -> None:
        if not value:
            raise ValueError("Reset.messages: a trajectory starts with at least one message")


@attrs.frozen
class Turn:
    """One policy turn: its ``text`` and ``ids`` (as the engine sampled them), its index
    (``0`` first), the trajectory's id and the conversation before it (``messages``)."""

    index: int
    text: str
    ids: tuple[int, ...]
    trajectory_id: str
    messages: tuple[Mapping[str, Any], ...]


@attrs.frozen
class Observation:
    """What the environment answers a turn: ``messages`` to append (tool results as ``tool``
    messages, the user's next words…), the turn's ``reward`` (``None``: none),
    ``done`` (the trajectory ends; ``messages`` are then not appended), ``tool_calls`` (how
    many tool calls the turn made), ``tool_errors`` (how many of them failed: a
    :class:`~relax_core.agent.ToolResult` with ``error``) and ``tool_timeouts`` (how many of
    those ran out of time) — summed per trajectory and reported in the step's ``rollout``
    object —, ``guide`` for the next turn and free-form ``info`` (kept in the trajectory's
    record)."""

    messages: tuple[dict[str, Any], ...] = attrs.field(default=(), converter=_messages)
    reward: float | None = None
    done: bool = False
    tool_calls: int = 0
    tool_errors: int = 0
    tool_timeouts: int = 0
    guide: Mapping[str, Any] | None = attrs.field(default=None, converter=_guide)
    info: Mapping[str, Any] = attrs.field(factory=dict)


@attrs.frozen
class EnvironmentConfig:
    """What ``EnvironmentSpec.make`` gets for one trajectory: the ``[run.generation.env]``
    table (``options``) and its key path, the trajectory's id, the seconds a tool call may
    take (``tool_timeout``, ``[run.generation] tool_timeout``)."""

    options: Mapping[str, Any]
    trajectory_id: str
    tool_timeout: float = 10.0
    path: str = "run.generation.env"


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment (see the module docstring)."""

    def reset(self, prompt: Prompt) -> Reset:
        """The trajectory's first messages, from the dataset row ``prompt``."""
        ...

    def step(self, turn: Turn) -> Any:
        """The :class:`Observation` of the policy's ``turn`` (or an awaitable of it)."""
        ...
