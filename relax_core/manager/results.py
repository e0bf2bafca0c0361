"""What lifecycle calls return: one result per logical replica, never one flag for all."""

from __future__ import annotations

import enum
from collections.abc import Mapping

import attrs

from relax_core.errors import LifecycleError


class Outcome(enum.StrEnum):
    """How one replica came out of a lifecycle call."""

    DONE = "done"  #: the step ran and was confirmed
    NOOP = "noop"  #: nothing to do (already in the asked-for state)
    FAILED = "failed"  #: not confirmed: the replica is FAILED (memory NOT known to be free)
    SKIPPED = "skipped"  #: the call does not apply to the replica's state


@attrs.frozen
class ReplicaResult:
    """One replica's outcome: its state afterwards, the tags acted on, the error if any;
    ``seconds`` its worker's call and ``timings`` what the worker reports of them (onload and
    offload: ``engine_calls``, the seconds of its calls to the engine; offload: ``drain``)."""

    engine_id: str
    outcome: Outcome
    state: str
    tags: tuple[str, ...] = ()
    error: str | None = None
    seconds: float = 0.0
    timings: Mapping[str, float] = attrs.field(factory=dict, eq=False)


@attrs.frozen
class LifecycleResult:
    """The per-replica results of one manager call (``start``, ``offload``, ``onload``, …):
    ``seconds`` the call's, under the manager's lock; ``timings`` an onload's or offload's hops
    (``publish_begin``, ``heads``, ``publish_wait``, ``publish``: docs/run.md, ``--measure``)."""

    operation: str
    model_id: str
    replicas: tuple[ReplicaResult, ...]
    seconds: float = 0.0
    timings: Mapping[str, float] = attrs.field(factory=dict, eq=False)

    @property
    def ok(self) -> bool:
        """True when no replica FAILED (a shared GPU may be handed on only then)."""
        return not self.failed

    @property
    def failed(self) -> tuple[ReplicaResult, ...]:
        """The replicas whose step was not confirmed."""
        return tuple(r for r in self.replicas if r.outcome is Outcome.FAILED)

    @property
    def states(self) -> Mapping[str, str]:
        """Engine id -> state after the call."""
        return {r.engine_id: r.state for r in self.replicas}

    @property
    def outcomes(self) -> Mapping[str, Outcome]:
        """Engine id -> outcome."""
        return {r.engine_id: r.outcome for r in self.replicas}

    def raise_for_failures(self) -> LifecycleResult:
        """Return ``self``, or raise :class:`LifecycleError` naming every failed replica."""
        if self.failed:
            lines = "; ".join(f"{r.engine_id}: {r.error}" for r in self.failed)
            raise LifecycleError(
                f"{self.operation} of model {self.model_id!r}: {len(self.failed)} of "
                f"{len(self.replicas)} replica(s) not confirmed ({lines}); they are FAILED and "
                "their memory is not known to be free: call recover() or shutdown()"
            )
        return self


@attrs.frozen
class ReplicaHealth:
    """One replica's health-check verdict.

    ``action``: ``none``, ``suspect`` (a probe failed, the process lives: kept until
    ``failed_probes`` reaches ``unhealthy_after``), ``failed``, ``cleaned``, ``rebuilt``,
    ``pending`` (a cleanup step not confirmed) or ``fenced``."""

    engine_id: str
    healthy: bool
    state: str
    action: str
    problems: tuple[str, ...] = ()
    failed_probes: int = 0


@attrs.frozen
class HealthReport:
    """The result of :meth:`InferenceManager.health_check` over every worker of every replica."""

    model_id: str
    replicas: tuple[ReplicaHealth, ...]

    @property
    def healthy(self) -> bool:
        """True when every replica was healthy."""
        return all(r.healthy for r in self.replicas)

    @property
    def by_engine(self) -> Mapping[str, ReplicaHealth]:
        """Engine id -> verdict."""
        return {r.engine_id: r for r in self.replicas}


@attrs.frozen
class UnconfirmedWorker:
    """A worker whose cleanup the manager could not confirm: what it may still hold, and where.

    ``fenced``: its actor died (only an operator can confirm the node is clean); otherwise
    ``reason`` says why its shutdown is pending. Its placement group (``placement_group_id``)
    must not be released."""

    model_id: str
    worker: str
    fenced: bool
    reason: str
    placement_group_id: str | None
    bundles: tuple[int, ...]
    node_ip: str | None
    node_id: str | None
    engine_pid: int | None

    def describe(self) -> str:
        """One line for an operator: the worker, where it ran, why it is not confirmed."""
        where = f"node {self.node_ip or '?'}"
        if self.engine_pid is not None:
            where += f", engine pid {self.engine_pid}"
        if self.bundles:
            where += f", bundle {', '.join(str(b) for b in self.bundles)}"
        kind = "fenced" if self.fenced else "shutdown not confirmed"
        return f"{self.worker} ({where}): {kind}: {self.reason}"
