"""What an environment of a multi-turn rollout is: the records it takes and gives, and its
Protocol (docs/plugins.md, "An environment", walks through one).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol, runtime_checkable

import attrs

from relax_core import Prompt, RelaxError

__all__ = [
    "GUIDE_KEYS",
    "Environment",
    "EnvironmentConfig",
    "EnvironmentStepError",
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
    ``guide`` (one of :data:`GUIDE_KEYS`) constraining the first policy turn's sampling (the
    log-probs returned are the constrained sampling's)."""

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
    """What the environment answers a turn: ``messages`` to append (not when ``done``), the
    turn's ``reward``, tool counts (summed in the step's ``rollout`` object), the next turn's
    ``guide`` and free-form ``info`` (kept in the trajectory's record)."""

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
    table (``options``) and its key path, the trajectory's id, ``[run.generation]
    tool_timeout``."""

    options: Mapping[str, Any]
    trajectory_id: str
    tool_timeout: float = 10.0
    path: str = "run.generation.env"


@runtime_checkable
class Environment(Protocol):
    """One trajectory's environment, made per trajectory by ``EnvironmentSpec.make``:
    ``reset`` once, then ``step`` per policy turn until ``done``, ``max_turns`` or
    ``max_total_tokens``. What either raises fails the step
    (:class:`EnvironmentStepError`); a plain ``step`` runs on the event
    loop: keep it quick, or run tools through a :class:`~relax_agent.ToolBox`."""

    def reset(self, prompt: Prompt) -> Reset:
        """The trajectory's first messages, from the dataset row ``prompt``."""

    def step(self, turn: Turn) -> Any:
        """The :class:`Observation` of the policy's ``turn`` (or an awaitable of it)."""


class EnvironmentStepError(RelaxError):
    """A multi-turn rollout's environment failed (raised, or answered no observation): the
    step fails uncommitted. ``environment`` and ``trajectory`` (the sample's id) say which."""

    def __init__(self, environment: str, trajectory: str, message: str) -> None:
        self.environment, self.trajectory, self.message = environment, trajectory, message
        super().__init__(f"environment {environment!r}, trajectory {trajectory}: {message}")
