"""The coordinator's two state machines: batch states and role leases — pure, no I/O.

Batch state answers "may this batch be trained on"; lease state answers "which role may still
hold the shared GPUs". They are never mixed::

    batch:  PENDING -> COMMITTED   (commit_batch, every role SLEEPING, sink write receipt)
            PENDING -> FAILED      (fail_batch, or an unconfirmed lifecycle RPC)

    lease:  SLEEPING  -> ACTIVE    (begin_batch / begin_student_scoring for the generation role)
            SLEEPING  -> ONLOADING (activate begins)
            ONLOADING -> ACTIVE    (every manager onload confirmed)
            ONLOADING -> BLOCKED   (a failure or a timeout)
            ACTIVE    -> DRAINING  (deactivate begins)
            ACTIVE    -> SLEEPING  (the generation role's offload acknowledged)
            ACTIVE    -> BLOCKED   (the generation role's release not confirmed)
            DRAINING  -> SLEEPING  (every manager offload confirmed)
            DRAINING  -> BLOCKED   (a failure or a timeout)
            BLOCKED   -> SLEEPING  (only the operator reset, after confirming the GPUs are clean)

BLOCKED is the fail-stop fence of a shared GPU: the result of an onload or offload is not known,
so the GPUs are never handed to another role, and a late reply does not change that.
"""

from __future__ import annotations

import enum

from relax_core.errors import CoordinationError

__all__ = ["BatchState", "LeaseState", "check_lease_transition"]


class BatchState(enum.StrEnum):
    """The coordinator's view of one batch (finer data phases belong to the DeferredBatch)."""

    PENDING = "PENDING"
    COMMITTED = "COMMITTED"
    FAILED = "FAILED"


class LeaseState(enum.StrEnum):
    """Whether a role may hold its defer slice's GPUs."""

    SLEEPING = "SLEEPING"
    ONLOADING = "ONLOADING"
    ACTIVE = "ACTIVE"
    DRAINING = "DRAINING"
    BLOCKED = "BLOCKED"


_L = LeaseState
_LEASE_TRANSITIONS: dict[LeaseState, frozenset[LeaseState]] = {
    _L.SLEEPING: frozenset({_L.ONLOADING, _L.ACTIVE}),
    _L.ONLOADING: frozenset({_L.ACTIVE, _L.BLOCKED}),
    _L.ACTIVE: frozenset({_L.DRAINING, _L.SLEEPING, _L.BLOCKED}),
    _L.DRAINING: frozenset({_L.SLEEPING, _L.BLOCKED}),
    _L.BLOCKED: frozenset({_L.SLEEPING}),
}


def check_lease_transition(role: str, old: LeaseState, new: LeaseState) -> None:
    """Refuse a lease transition the state machine does not have (a coordinator bug).

    :raises CoordinationError: naming the role and both states.
    """
    if new not in _LEASE_TRANSITIONS[old]:
        raise CoordinationError(
            f"role {role!r}: lease transition {old} -> {new} does not exist (allowed from {old}: "
            f"{', '.join(sorted(_LEASE_TRANSITIONS[old]))})"
        )
