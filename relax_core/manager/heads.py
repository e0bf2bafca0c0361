"""Calls to the replica heads: over each head's private control channel, or as Ray actor calls."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from relax_core.errors import ChannelError
from relax_core.manager.channel import ControlAddress, call_many
from relax_core.manager.fanout import CallOutcome, gather
from relax_core.manager.slots import SlotTable


@attrs.define
class HeadCalls:
    """Call one worker method on the head of many replicas at once: over the control channel
    (``control_channel``) or Ray. A failed HTTP exchange proves nothing: Ray is asked (up to
    ``probe_timeout``) whether the actor died (then the outcome is Ray's; the caller fences)."""

    slots: SlotTable
    control_channel: bool
    probe_timeout: float

    def call(
        self, method: str, calls: Mapping[int, Mapping[str, Any]], timeout: float
    ) -> dict[int, CallOutcome]:
        """``method(**kwargs)`` on the head of replica ``index`` for every ``index: kwargs``;
        one outcome per index. Blocking; never raises for a failed call."""
        over_http: dict[int, tuple[ControlAddress, str, Mapping[str, Any]]] = {}
        over_ray: dict[int, Any] = {}
        for i, kwargs in calls.items():
            head = self.slots.at(i).head
            if self.control_channel and head.control is not None:
                over_http[i] = (head.control, method, kwargs)
            else:
                over_ray[i] = getattr(head.actor, method).remote(**kwargs)
        outs = call_many(over_http, timeout)
        if over_ray:
            outs.update(gather(over_ray, timeout))
        unsure = [
            i for i in over_http if outs[i].timed_out or isinstance(outs[i].error, ChannelError)
        ]
        if unsure:
            probes = gather(
                {i: self.slots.at(i).head.actor.actor_pid.remote() for i in unsure},
                self.probe_timeout,
            )
            for i in unsure:
                if probes[i].actor_died:
                    outs[i] = probes[i]
        return {i: outs[i] for i in calls}
