"""The error hierarchy of Relax: every error class the core raises on purpose, in one place.

Every error says what was wrong, where (a key path, a field, an engine id, a bundle index) and,
where there is one, what to do."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import orjson

__all__ = [
    "BatchFailedError",
    "CapabilityError",
    "ChannelError",
    "CheckpointError",
    "ConfigError",
    "ConfigValidationError",
    "CoordinationError",
    "EmptyBatchError",
    "GatewayError",
    "InferenceRecoveryRequired",
    "InvalidRequestError",
    "LeaseBlockedError",
    "LifecycleError",
    "ModelNotReadyError",
    "NotApplicable",
    "PlacementError",
    "PluginError",
    "RelaxError",
    "RequestNotReplayedError",
    "RoutingError",
    "ScoringError",
    "SinkError",
    "SnapshotError",
    "StreamStalledError",
    "TrackerError",
    "UpstreamError",
    "UpstreamStatusError",
    "UpstreamUnreachableError",
]


class RelaxError(Exception):
    """Base class of every error Relax raises on purpose.

    Every Relax error pickles with its declared attributes (it crosses Ray actor boundaries),
    whatever its constructor takes."""

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild_error, (type(self), self.args, dict(self.__dict__)))


def _rebuild_error(cls: type[RelaxError], args: tuple[Any, ...], state: dict[str, Any]) -> Any:
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class PluginError(RelaxError):
    """A plugin could not be loaded, or two plugins registered the same name."""


class ConfigError(RelaxError):
    """A configuration value is invalid: ``path`` is its dotted key path, ``message`` what is wrong
    and what to do."""

    def __init__(self, path: str, message: str) -> None:
        self.path, self.message = path, message
        super().__init__(f"{path}: {message}" if path else message)


@attrs.frozen
class ConfigProblem:
    """One problem in a config: the key path, a short rule name and what to do (the items of
    :class:`ConfigValidationError`; ``relax_core.config`` exports it too)."""

    path: str
    rule: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: [{self.rule}] {self.message}"


class ConfigValidationError(ConfigError):
    """A job config has one or more problems (raised by :func:`relax_core.config.load_config`).

    ``problems``: every :class:`~relax_core.config.ConfigProblem` found, so a user fixes them all in
    one pass; ``source`` names the file (``None``: a dict). ``path`` is the first problem's key
    path; ``str()`` lists them all."""

    def __init__(self, problems: Sequence[ConfigProblem], source: str | None = None) -> None:
        self.problems = tuple(problems)
        self.source = source
        where = f" in {source}" if source else ""
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(
            self.problems[0].path if self.problems else "",
            f"{len(self.problems)} config problem(s){where}:\n{lines}",
        )

    def __str__(self) -> str:
        return self.message


class SnapshotError(ConfigError):
    """A discovery snapshot does not follow schema 2 (``path`` names the field); a client that
    fetches one answers ``RoutingError(503)`` instead."""


class PlacementError(RelaxError):
    """A placement plan or a bound placement group breaks rules: ``violations`` holds every one."""

    def __init__(self, violations: Sequence[str]) -> None:
        self.violations = tuple(violations)
        lines = "\n".join(f"  - {v}" for v in self.violations)
        super().__init__(f"{len(self.violations)} placement violation(s):\n{lines}")


class _StatusError(RelaxError):
    """An error a gateway answers with its HTTP ``status``; ``message`` says what to do."""

    def __init__(self, status: int, message: str) -> None:
        self.status, self.message = status, message
        super().__init__(message)


class RoutingError(_StatusError):
    """A request could not be routed; nothing was sent.

    ``status``: 400 (unknown model, alias or route key: fix the request) or 503 (not READY, no
    eligible replica, registry unavailable: try again); ``retry_after`` (seconds) when a later try
    can succeed."""

    def __init__(self, status: int, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(status, message)
        self.retry_after = retry_after


class ModelNotReadyError(RoutingError):
    """The model a request resolved to is not READY: a 503, nothing sent. ``role``, ``model`` and
    ``state`` say which; a gateway that can wake the role waits and retries, any other caller
    retries after ``retry_after``."""

    def __init__(
        self, message: str, *, role: str, model: str, state: str, retry_after: float | None = None
    ) -> None:
        super().__init__(503, message, retry_after=retry_after)
        self.role, self.model, self.state = role, model, state


class InvalidRequestError(RoutingError):
    """A request body is malformed (not JSON, not an object, a field of the wrong shape): always a
    400, nothing sent. ``field`` names the offending JSON field (``None``: the whole body); a
    gateway answers it with ``param`` = ``field``."""

    def __init__(self, message: str, *, field: str | None = None) -> None:
        super().__init__(400, message)
        self.field = field


class UpstreamError(_StatusError):
    """An engine or router could not be reached or answered badly: ``status`` 502 (transport, bad
    answer) or 504 (deadline); ``request_id``: the ``X-Request-ID`` it travelled with, if any."""

    def __init__(self, status: int, message: str, *, request_id: str | None = None) -> None:
        super().__init__(status, message)
        self.request_id = request_id


class UpstreamUnreachableError(UpstreamError):
    """No connection could be opened: nothing was sent, a retry is safe. ``status`` 502 or 504
    (the connect deadline). The client already retried once on a fresh snapshot: check
    ``relax status``."""


class UpstreamStatusError(UpstreamError):
    """The upstream answered with an HTTP error status (4xx or 5xx); the request is never replayed.

    ``status``, ``body`` (bytes), ``retry_after`` (its ``Retry-After``, seconds) are the upstream's,
    ``url`` where the request went; the message quotes the start of the body."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        body: bytes,
        url: str,
        request_id: str | None = None,
        retry_after: float | None = None,
    ) -> None:
        super().__init__(status, message, request_id=request_id)
        self.body, self.url, self.retry_after = body, url, retry_after

    def json(self) -> Any:
        """The body decoded as JSON (raises ``orjson.JSONDecodeError`` when it is not JSON)."""
        return orjson.loads(self.body)


class RequestNotReplayedError(UpstreamError):
    """A POST reached the wire and then failed; it was not replayed (it may have run).

    ``request_id`` identifies it to deduplicate or abort. ``status``: 504 when the deadline passed
    or a stream went silent (``__cause__`` is a :class:`StreamStalledError`), else 502.
    ``answer_started``: whether the answer's status line had arrived."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        request_id: str | None = None,
        answer_started: bool = False,
    ) -> None:
        super().__init__(status, message, request_id=request_id)
        self.answer_started = answer_started


class StreamStalledError(RelaxError, TimeoutError):
    """A streamed body went silent for longer than its idle limit.

    A ``TimeoutError`` raised while a body is read, turned into a 504
    :class:`RequestNotReplayedError`. ``seconds``: the limit; ``started``: whether any body bytes
    had arrived; ``setting``: the option that sets that limit (raise it for a slow engine)."""

    def __init__(self, seconds: float, started: bool) -> None:
        self.seconds, self.started = seconds, started
        self.setting = "stream_idle_timeout" if started else "stream_first_chunk_timeout"
        super().__init__(f"no data for {seconds:g}s")


class GatewayError(_StatusError):
    """An answer a role gateway gives instead of forwarding: ``status`` and a JSON error body
    ``{"error": {"message", "type", "code", "param"}}``.

    ``field`` is sent as ``param``, ``retry_after`` as ``Retry-After``, ``request_id`` as
    ``X-Request-ID``; :func:`~relax_core.gateway.handler.gateway_error` builds it from the
    others."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        retry_after: float | None = None,
        field: str | None = None,
        request_id: str | None = None,
    ) -> None:
        super().__init__(status, message)
        self.retry_after, self.field, self.request_id = retry_after, field, request_id


class CapabilityError(RelaxError):
    """An operation is not allowed for this engine (a STATIC model asked to update weights)."""


class LifecycleError(RelaxError):
    """An onload, offload, start or shutdown step did not complete or could not be confirmed."""


class InferenceRecoveryRequired(LifecycleError):
    """An engine actor died without confirmed cleanup of its engine process.

    Its slot, pending record and placement-group fence are kept, nothing is rebuilt: confirm the
    node is clean, then start a new job. ``result``: the
    :class:`~relax_core.manager.LifecycleResult` of the call that found the fence (``None``:
    refused before anything ran); ``report``: the :class:`~relax_core.manager.HealthReport` that
    found one."""

    def __init__(self, message: str, *, result: Any = None, report: Any = None) -> None:
        self.result, self.report = result, report
        super().__init__(message)


# -- the InferenceManager's own errors -----------------------------------------------------------


class NotApplicable(LifecycleError):
    """A lifecycle call does not apply to a replica in its current state (it is skipped)."""


class ChannelError(LifecycleError):
    """The HTTP exchange with a head's private control endpoint failed (no answer from the worker);
    it says nothing of whether the worker died, and the worker's own failures are never one."""


# -- coordination: the LifecycleCoordinator, the DeferredBatch and the batch sinks -------------


class CoordinationError(RelaxError):
    """A coordinator call was refused: wrong order, unknown role, a reused operation id, a
    batch that is not the pending one. Nothing changed."""


class LeaseBlockedError(CoordinationError):
    """A role's shared-GPU lease is BLOCKED: an onload or offload of ``role`` was not confirmed
    (``reason``). No role on its slice gets a lease until an operator resets it."""

    def __init__(self, role: str, reason: str) -> None:
        self.role, self.reason = role, reason
        super().__init__(
            f"role {role!r} lease is BLOCKED: {reason}. No other role on its GPUs is activated. "
            f"Confirm on the node that the {role} engines hold no GPU memory (stop them if "
            f"needed), then run `relax coordinator reset --role {role} --confirm-clean`"
        )


class BatchFailedError(CoordinationError):
    """A batch will never be committed: ``batch_id`` and the ``cause`` (the first failure);
    ``failed_batch`` names the batch that failed when it is an earlier one."""

    def __init__(self, batch_id: int, cause: str, *, failed_batch: int | None = None) -> None:
        self.batch_id, self.cause = batch_id, cause
        self.failed_batch = batch_id if failed_batch is None else failed_batch
        if self.failed_batch == batch_id:
            text = f"batch {batch_id} FAILED: {cause}"
        else:
            text = (
                f"batch {batch_id} will not be committed: the run failed at batch "
                f"{self.failed_batch}: {cause}"
            )
        super().__init__(text)


class EmptyBatchError(CoordinationError):
    """The stages dropped every group of batch ``batch_id`` (``reasons``: ``"stage: reason"`` ->
    groups); ``[run] on_empty_batch`` says whether the step is skipped or failed."""

    def __init__(self, batch_id: int, reasons: Mapping[str, int]) -> None:
        self.batch_id = batch_id
        self.reasons = dict(reasons)
        why = "; ".join(f"{k} ({v} groups)" for k, v in self.reasons.items()) or "no groups"
        super().__init__(
            f"batch {batch_id}: the stages dropped every group ({why}); nothing to commit or "
            "train on"
        )


class ScoringError(RelaxError):
    """A deferred scoring stage or the validation of its fields failed; nothing was written
    back. ``stage`` names the stage (``genrm``, ``teacher``, ``validation``)."""

    def __init__(self, stage: str, message: str) -> None:
        self.stage, self.message = stage, message
        super().__init__(f"{stage}: {message}")


class SinkError(RelaxError):
    """A batch-sink operation (put, get, delete) failed; ``partition`` names the partition."""

    def __init__(self, partition: str, message: str) -> None:
        self.partition, self.message = partition, message
        super().__init__(f"partition {partition!r}: {message}")


class TrackerError(RelaxError):
    """An experiment tracker failed (``tracker``: its name; ``call``: ``open``, ``log_metrics`` …);
    reported once and dropped, unless ``strict_trackers`` ends the run."""

    def __init__(self, tracker: str, call: str, message: str) -> None:
        self.tracker, self.call, self.message = tracker, call, message
        super().__init__(f"tracker {tracker!r} failed in {call}: {message}")


class CheckpointError(RelaxError):
    """A run's checkpoint (in ``run_dir``) cannot be written or resumed from; the message says what,
    where and what to do."""

    def __init__(self, run_dir: str, message: str) -> None:
        self.run_dir, self.message = run_dir, message
        super().__init__(f"{run_dir}: {message}")
