"""The error hierarchy of Relax.

Every error says what was wrong, where (a config key path, a snapshot field path, an engine id,
a bundle index) and, where there is one, what to do about it.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "BatchFailedError",
    "CapabilityError",
    "ConfigError",
    "CoordinationError",
    "InferenceRecoveryRequired",
    "LeaseBlockedError",
    "LifecycleError",
    "PlacementError",
    "PluginError",
    "RelaxError",
    "RequestNotReplayedError",
    "RoutingError",
    "ScoringError",
    "SinkError",
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
    """


# -- coordination ----------------------------------------------------------------------------
# Errors of the LifecycleCoordinator, the DeferredBatch and the batch sinks. They cross Ray
# (raised in the coordinator actor, re-raised in the caller), so each pickles with its fields.


class CoordinationError(RelaxError):
    """A coordinator call was refused: wrong order, unknown role, a reused operation id, a
    batch that is not the pending one. Nothing changed."""


class LeaseBlockedError(CoordinationError):
    """A role's shared-GPU lease is BLOCKED: an onload or offload of it was not confirmed.

    ``role`` is the role; ``reason`` what went unconfirmed. The coordinator grants no role on
    the same defer slice a lease until an operator has confirmed that the role's GPUs are clean
    and reset the lease (``relax coordinator reset``).
    """

    def __init__(self, role: str, reason: str) -> None:
        self.role = role
        self.reason = reason
        super().__init__(
            f"role {role!r} lease is BLOCKED: {reason}. No other role on its GPUs is activated. "
            f"Confirm on the node that the {role} engines hold no GPU memory (stop them if "
            f"needed), then run `relax coordinator reset --role {role} --confirm-clean`"
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.role, self.reason))


class BatchFailedError(CoordinationError):
    """A batch will never be committed: ``batch_id`` and the ``cause`` (the first failure).

    Raised to ``wait_committed`` waiters, to callers of the failed batch's operations and, for
    later batches, when the run failed earlier (``failed_batch`` names that batch).
    """

    def __init__(self, batch_id: int, cause: str, *, failed_batch: int | None = None) -> None:
        self.batch_id = batch_id
        self.cause = cause
        self.failed_batch = batch_id if failed_batch is None else failed_batch
        if self.failed_batch == batch_id:
            text = f"batch {batch_id} FAILED: {cause}"
        else:
            text = (
                f"batch {batch_id} will not be committed: the run failed at batch "
                f"{self.failed_batch}: {cause}"
            )
        super().__init__(text)

    def __reduce__(self) -> tuple[object, ...]:
        return (_rebuild_batch_failed, (self.batch_id, self.cause, self.failed_batch))


def _rebuild_batch_failed(batch_id: int, cause: str, failed_batch: int) -> BatchFailedError:
    return BatchFailedError(batch_id, cause, failed_batch=failed_batch)


class ScoringError(RelaxError):
    """A deferred scoring stage or the validation of its fields failed; nothing was written
    back. ``stage`` names the stage (``genrm``, ``teacher``, ``validation``)."""

    def __init__(self, stage: str, message: str) -> None:
        self.stage = stage
        self.message = message
        super().__init__(f"{stage}: {message}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.stage, self.message))


class SinkError(RelaxError):
    """A batch-sink operation (put, get, delete) failed; ``partition`` names the partition."""

    def __init__(self, partition: str, message: str) -> None:
        self.partition = partition
        self.message = message
        super().__init__(f"partition {partition!r}: {message}")

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.partition, self.message))
