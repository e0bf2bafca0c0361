"""An asyncio event loop on a virtual clock, for state-machine tests of deadlines.

Its ``time()`` stands still while callbacks are ready and, when none is, jumps to the next
timer: every timeout fires in the order of its deadline, however loaded the machine is, and a
test of a 2 ms operation deadline against a 40 ms wait cannot see the two race (on a real
clock a descheduled process finds both due at once and runs them in one iteration).
"""

from __future__ import annotations

import asyncio
from typing import Any

__all__ = ["VirtualClockLoop"]


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """A selector event loop whose clock moves only to the next due timer (no real waiting)."""

    def __init__(self) -> None:
        super().__init__()
        self._virtual_now = 0.0

    def time(self) -> float:
        return self._virtual_now

    def _run_once(self) -> None:
        # asyncio's own queues: ready callbacks and the heap of timers (private, stable API
        # since Python 3.4; this is test code).
        ready: Any = self._ready  # type: ignore[attr-defined]
        scheduled: Any = self._scheduled  # type: ignore[attr-defined]
        if not ready:
            live = [h for h in scheduled if not h.cancelled()]
            if live:
                self._virtual_now = max(self._virtual_now, min(h.when() for h in live))
        super()._run_once()  # type: ignore[misc]
