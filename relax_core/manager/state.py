"""Replica states, their transitions (``docs/manager.md``'s state machine) and onload/offload
plans; pure. FAILED means "not routable", never "memory released"."""

from __future__ import annotations

import enum
from collections.abc import Iterable

import attrs

from relax_core.engine.tags import ALL_TAGS, TAG_ORDER, normalize_tags, ordered
from relax_core.errors import LifecycleError, NotApplicable


class ReplicaState(enum.StrEnum):
    """The state of one logical replica (schema 2 publishes it as a string)."""

    STARTING = "STARTING"
    READY = "READY"
    DRAINING = "DRAINING"
    SLEEPING = "SLEEPING"
    ONLOADING = "ONLOADING"
    FAILED = "FAILED"
    STOPPING = "STOPPING"


_S = ReplicaState
#: Transitions kept in ``Replica.history`` (the newest).
_HISTORY = 64
_TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    _S.STARTING: frozenset({_S.READY, _S.FAILED, _S.STOPPING}),
    _S.READY: frozenset({_S.DRAINING, _S.FAILED, _S.STOPPING}),
    _S.DRAINING: frozenset({_S.SLEEPING, _S.READY, _S.FAILED, _S.STOPPING}),
    _S.SLEEPING: frozenset({_S.ONLOADING, _S.DRAINING, _S.FAILED, _S.STOPPING}),
    _S.ONLOADING: frozenset({_S.READY, _S.SLEEPING, _S.FAILED, _S.STOPPING}),
    _S.FAILED: frozenset({_S.STOPPING}),
    _S.STOPPING: frozenset({_S.STARTING, _S.STOPPING}),
}


@attrs.define
class Replica:
    """The manager's record of one logical replica; ``base_url`` (the head's public URL) is
    kept after the head is gone."""

    index: int
    engine_id: str
    state: ReplicaState = ReplicaState.STARTING
    resident: frozenset[str] = frozenset()
    weights_valid: bool = False
    admission_open: bool = False
    base_url: str | None = None
    generation: int = 0
    weight_version: str | None = None
    error: str | None = None
    #: how many transitions the replica has made (a health probe that overlapped one is stale)
    transitions: int = 0
    #: the last transitions (oldest first), for diagnostics and tests
    history: list[tuple[ReplicaState, ReplicaState]] = attrs.field(factory=list, repr=False)

    def advance(self, to: ReplicaState, *, error: str | None = None) -> None:
        """Move to ``to``; :class:`LifecycleError` if the state machine has no such edge."""
        if to not in _TRANSITIONS[self.state]:
            raise LifecycleError(
                f"replica {self.engine_id}: no transition {self.state} -> {to}; allowed from "
                f"{self.state}: {sorted(_TRANSITIONS[self.state])}"
            )
        self.history.append((self.state, to))
        self.transitions += 1
        if len(self.history) > _HISTORY:
            del self.history[: len(self.history) - _HISTORY]
        self.state = to
        if to is ReplicaState.FAILED:
            # Not routable any more; the memory is *not* known to be free.
            self.admission_open = False
            self.error = error or self.error
        elif error is not None:
            self.error = error

    @property
    def is_ready(self) -> bool:
        """READY with every tag resident, valid weights and open admission."""
        return (
            self.state is ReplicaState.READY
            and self.resident == ALL_TAGS
            and self.weights_valid
            and self.admission_open
        )

    @property
    def direct_eligible(self) -> bool:
        """Whether a DIRECT client may send this replica requests (FAILED/SLEEPING never)."""
        return self.is_ready and self.base_url is not None

    def became_ready(self) -> None:
        """Record that every tag is resident, weights are valid and admission reopened."""
        if self.resident != ALL_TAGS or not self.weights_valid:
            raise LifecycleError(
                f"replica {self.engine_id}: cannot be READY with resident tags "
                f"{list(ordered(self.resident))} and weights_valid={self.weights_valid}; "
                f"READY needs {list(TAG_ORDER)} and valid weights"
            )
        self.admission_open = True
        self.advance(ReplicaState.READY)


@attrs.frozen
class OffloadPlan:
    """What an offload must do to one replica: release ``tags`` (empty: nothing to do)."""

    tags: tuple[str, ...]

    @property
    def noop(self) -> bool:
        """True when every requested tag is already released."""
        return not self.tags

    def begin(self, replica: Replica) -> None:
        """The release starts: admission closes, the replica drains (DRAINING)."""
        replica.admission_open = False
        replica.advance(ReplicaState.DRAINING)

    def confirm(self, replica: Replica) -> None:
        """The release is confirmed: the tags are gone (SLEEPING)."""
        replica.resident -= frozenset(self.tags)
        replica.advance(ReplicaState.SLEEPING)


@attrs.frozen
class OnloadPlan:
    """What an onload must do to one replica: resume ``tags`` in order; ``reopen`` admission."""

    tags: tuple[str, ...]
    reopen: bool

    @property
    def noop(self) -> bool:
        """True when nothing is missing and admission is already as it should be."""
        return not self.tags and not self.reopen

    def begin(self, replica: Replica) -> None:
        """The resume starts (ONLOADING)."""
        replica.advance(ReplicaState.ONLOADING)

    def confirm(self, replica: Replica) -> None:
        """The resume is confirmed: READY when admission reopened, else still SLEEPING."""
        replica.resident |= frozenset(self.tags)
        if self.reopen:
            replica.became_ready()
        else:
            replica.advance(ReplicaState.SLEEPING)


def plan_offload(replica: Replica, tags: Iterable[str] | None) -> OffloadPlan:
    """Which tags an offload must release from ``replica`` (only resident ones).
    :raises NotApplicable: the replica is STARTING, DRAINING, ONLOADING, FAILED or STOPPING."""
    wanted = normalize_tags(tags)
    if replica.state not in (ReplicaState.READY, ReplicaState.SLEEPING):
        raise NotApplicable(
            f"replica {replica.engine_id} is {replica.state}; offload applies to READY or "
            "SLEEPING replicas (recover or shut down a FAILED one)"
        )
    return OffloadPlan(ordered(wanted & replica.resident))


def plan_onload(replica: Replica, tags: Iterable[str] | None) -> OnloadPlan:
    """Which tags an onload must resume on ``replica`` (only missing ones), and whether
    admission reopens (every tag resident).
    :raises NotApplicable: the replica is STARTING, DRAINING, ONLOADING, FAILED or STOPPING."""
    wanted = normalize_tags(tags)
    if replica.state is ReplicaState.READY:
        return OnloadPlan((), False)
    if replica.state is not ReplicaState.SLEEPING:
        raise NotApplicable(
            f"replica {replica.engine_id} is {replica.state}; onload applies to SLEEPING "
            "replicas (recover or shut down a FAILED one)"
        )
    resume = ordered(wanted - replica.resident)
    will_be = replica.resident | frozenset(resume)
    return OnloadPlan(resume, will_be == ALL_TAGS and replica.weights_valid)
