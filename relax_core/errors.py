"""The error hierarchy of Relax.

Every error says what was wrong, where (a config key path, a snapshot field path, an engine id,
a bundle index) and, where there is one, what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from relax_core.manager.results import HealthReport, LifecycleResult

__all__ = [
    "CapabilityError",
    "ConfigError",
    "InferenceRecoveryRequired",
    "LifecycleError",
    "PlacementError",
    "PluginError",
    "RelaxError",
    "RequestNotReplayedError",
    "RoutingError",
    "SnapshotError",
    "UpstreamError",
]


class RelaxError(Exception):
    """Base class of every error Relax raises on purpose."""


class PluginError(RelaxError):
    """A plugin could not be loaded, or two plugins registered the same name."""


class ConfigError(RelaxError):
    """A configuration value is invalid.

    ``path`` is the dotted key path of the offending value (``roles.genrm.models.judge.tp``).
    """

    def __init__(self, path: str, message: str) -> None:
        self.path = path
        self.message = message
        super().__init__(f"{path}: {message}" if path else message)


class SnapshotError(ConfigError):
    """A discovery snapshot does not follow schema 2 (``path`` names the field)."""


class PlacementError(RelaxError):
    """A placement plan or a bound placement group violates one or more rules.

    ``violations`` holds every violation found, not just the first.
    """

    def __init__(self, violations: Sequence[str]) -> None:
        self.violations = tuple(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} placement violation(s):\n{lines}")


class RoutingError(RelaxError):
    """A request could not be routed.

    ``status`` is the HTTP status a gateway answers with (400 or 503); ``retry_after`` is set
    (seconds) when trying again later can succeed.
    """

    def __init__(self, status: int, message: str, *, retry_after: float | None = None) -> None:
        self.status = status
        self.message = message
        self.retry_after = retry_after
        super().__init__(message)


class UpstreamError(RelaxError):
    """An engine or router could not be reached or answered badly.

    ``status`` is the HTTP status a gateway answers with (502 transport or bad answer,
    504 deadline).
    """

    def __init__(self, status: int, message: str, *, request_id: str | None = None) -> None:
        self.status = status
        self.message = message
        self.request_id = request_id
        super().__init__(message)


class RequestNotReplayedError(UpstreamError):
    """A POST reached the wire and then failed; it was not replayed.

    The upstream may or may not have executed it. ``request_id`` identifies it so the caller can
    deduplicate or abort it.
    """


class CapabilityError(RelaxError):
    """An operation is not allowed for this engine (a STATIC model asked to update weights)."""


class LifecycleError(RelaxError):
    """An onload, offload, start or shutdown step did not complete or could not be confirmed."""


class InferenceRecoveryRequired(LifecycleError):
    """An engine actor died without confirmed cleanup of its engine process.

    Its slot, pending record and placement-group fence are kept; nothing is rebuilt
    automatically. Confirm the node or container is clean, then start a new job.

    ``result`` is the per-replica :class:`~relax_core.manager.LifecycleResult` of the call that
    found the fence while it ran (``None`` when the call was refused before anything ran);
    ``report`` is the :class:`~relax_core.manager.HealthReport` of a ``health_check()`` that
    found one.
    """

    def __init__(
        self,
        message: str,
        *,
        result: LifecycleResult | None = None,
        report: HealthReport | None = None,
    ) -> None:
        self.result = result
        self.report = report
        super().__init__(message)


# -- the InferenceManager's own errors -----------------------------------------------------------

__all__ += ["ChannelError", "NotApplicable"]


class NotApplicable(LifecycleError):
    """A lifecycle call does not apply to a replica in its current state (it is skipped)."""


class ChannelError(LifecycleError):
    """The HTTP exchange with a head's private control endpoint failed (no answer from the worker).

    The worker's own failures are reported as its own exceptions, never as this; a channel
    error says nothing about whether the worker actor died (the manager asks Ray).
    """
