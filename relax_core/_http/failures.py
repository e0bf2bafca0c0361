"""Failure classes of the data path: how far a failed upstream exchange got. Only ``CONNECT``
(nothing was sent) is ever retried: a replayed RL rollout is a duplicated, biased sample."""

from __future__ import annotations

import enum

from relax_core.errors import RequestNotReplayedError, UpstreamUnreachableError


class FailureClass(enum.StrEnum):
    """How far a failed upstream exchange got: nothing sent, sent, or mid-answer."""

    CONNECT = "connect"
    BEFORE_FIRST_BYTE = "before_first_byte"
    MID_STREAM = "mid_stream"


def failure_class(error: BaseException) -> FailureClass | None:
    """The class of a data-path error, or ``None`` for one that is not a transport failure
    (an HTTP error status, a bad body, a routing error)."""
    if isinstance(error, UpstreamUnreachableError):
        return FailureClass.CONNECT
    if isinstance(error, RequestNotReplayedError):
        return FailureClass.MID_STREAM if error.answer_started else FailureClass.BEFORE_FIRST_BYTE
    return None
