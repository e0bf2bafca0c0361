"""Failure classes of the data path: where an upstream exchange failed, and what that allows.

Every upstream failure falls in one of three classes, by how far the request got:

- :attr:`FailureClass.CONNECT`: no connection could be opened, so nothing was sent. Trying
  another replica is safe (the client does, once; a replica's circuit breaker counts these).
- :attr:`FailureClass.BEFORE_FIRST_BYTE`: the request was sent, then the exchange failed (reset,
  the deadline) before any byte of the answer arrived. The engine may have executed it: it is
  never replayed.
- :attr:`FailureClass.MID_STREAM`: the answer had started (its status line arrived) and then
  failed — a body cut short, a stream that died or went silent. Never replayed; a relayed
  stream is cut, so the caller cannot take it for a whole answer.

An RL rollout that is replayed is a duplicated, biased sample, so only the first class is ever
retried. The gateway counts each class in ``/metrics``
(``relax_gateway_upstream_failures_total{class}``).
"""

from __future__ import annotations

import enum

from relax_core.errors import RequestNotReplayedError, UpstreamUnreachableError

__all__ = ["FailureClass", "failure_class"]


class FailureClass(enum.StrEnum):
    """How far a failed upstream exchange got (see the module docstring)."""

    CONNECT = "connect"
    BEFORE_FIRST_BYTE = "before_first_byte"
    MID_STREAM = "mid_stream"


def failure_class(error: BaseException) -> FailureClass | None:
    """The class of a data-path error, or ``None`` for one that is not a transport failure
    (an HTTP error status, a bad body, a routing error)."""
    if isinstance(error, UpstreamUnreachableError):
        return FailureClass.CONNECT
    if isinstance(error, RequestNotReplayedError):
        if error.answer_started:
            return FailureClass.MID_STREAM
        return FailureClass.BEFORE_FIRST_BYTE
    return None
