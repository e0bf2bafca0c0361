"""The coordinator's two state machines, never mixed: batch states and role leases (diagram in
``docs/coordination.md``). BLOCKED is the fail-stop fence of a shared GPU: an onload or offload
of unknown result gives the GPUs to no other role until the operator resets it."""

from __future__ import annotations

import enum

from relax_core.errors import CoordinationError


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

    :raises CoordinationError: naming the role and both states."""
    if new not in _LEASE_TRANSITIONS[old]:
        raise CoordinationError(
            f"role {role!r}: lease transition {old} -> {new} does not exist (allowed from {old}: "
            f"{', '.join(sorted(_LEASE_TRANSITIONS[old]))})"
        )
