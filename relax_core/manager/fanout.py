"""Parallel fan-out of actor calls with one deadline; each ends in one :class:`CallOutcome`.
A terminal actor death means the engine process may still run: the manager fences it."""

from __future__ import annotations

import time
from collections.abc import Hashable, Mapping
from typing import Any, TypeVar

import attrs

from relax_core.errors import RelaxError

K = TypeVar("K", bound=Hashable)

#: Lines of a Relax error's message a description keeps (its first ones and its last ones).
_DESCRIBED_LINES = 12


def is_terminal_actor_death(error: BaseException | None) -> bool:
    """True for a confirmed actor death: a ``RayActorError`` but ``ActorUnavailableError``."""
    if error is None:
        return False
    from ray.exceptions import ActorUnavailableError, RayActorError

    return isinstance(error, RayActorError) and not isinstance(error, ActorUnavailableError)


@attrs.frozen
class CallOutcome:
    """How one remote call ended: ``value``, ``error``, or ``timed_out``."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        """The call returned normally."""
        return self.error is None and not self.timed_out

    @property
    def actor_died(self) -> bool:
        """The actor is confirmed dead (its engine process is NOT confirmed dead)."""
        return is_terminal_actor_death(self.error)

    def describe(self) -> str:
        """A short description: a :class:`~relax_core.errors.RelaxError`'s message (at most
        a dozen lines), any other error's last line."""
        if self.timed_out:
            return "no answer before the deadline"
        if self.error is not None:
            cause = getattr(self.error, "cause", None) or self.error
            text = str(cause).strip().splitlines()
            if isinstance(cause, RelaxError):
                return f"{type(cause).__name__}: {_bounded(text)}"
            return f"{type(cause).__name__}: {text[-1] if text else ''}"
        return "ok"


def _bounded(lines: list[str]) -> str:
    """``lines`` joined, or — beyond :data:`_DESCRIBED_LINES` — its first and last lines."""
    if len(lines) > _DESCRIBED_LINES:
        half = _DESCRIBED_LINES // 2
        lines = [*lines[:half], f"… ({len(lines) - 2 * half} lines left out)", *lines[-half:]]
    return "\n".join(lines)


def gather(refs: Mapping[K, Any], timeout: float) -> dict[K, CallOutcome]:
    """Wait for every object ref of ``refs`` until ``timeout`` seconds; one outcome per key
    (``timed_out`` for one still running, not cancelled). Never raises for a failed call."""
    import ray

    if not refs:
        return {}
    keys = list(refs)
    by_ref = {refs[k]: k for k in keys}
    deadline = time.monotonic() + max(0.0, timeout)
    pending = list(by_ref)
    out: dict[K, CallOutcome] = {}
    while pending:
        remaining = max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=len(pending), timeout=remaining)
        try:
            # The common case: every call returned; one get for all of them.
            values = ray.get(ready)
        except Exception:
            values = None
        for i, ref in enumerate(ready):
            if values is not None:
                out[by_ref[ref]] = CallOutcome(value=values[i])
                continue
            try:
                out[by_ref[ref]] = CallOutcome(value=ray.get(ref))
            except Exception as exc:
                out[by_ref[ref]] = CallOutcome(error=exc)
        if time.monotonic() >= deadline:
            break
    for ref in pending:
        out[by_ref[ref]] = CallOutcome(timed_out=True)
    return {k: out[k] for k in keys}
