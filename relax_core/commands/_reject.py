"""How a sub-command reports a job it rejected before starting anything."""

from __future__ import annotations

import sys


def reject(command: str, *lines: str, nothing_started: bool = True) -> int:
    """Print ``relax COMMAND: rejected: N problem(s)`` and each problem on stderr; return 2,
    the exit status of a rejected job. ``nothing_started`` adds that nothing was started."""
    note = "; nothing was started" if nothing_started else ""
    print(f"relax {command}: rejected: {len(lines)} problem(s){note}", file=sys.stderr)
    for line in lines:
        print(f"  {line}", file=sys.stderr)
    return 2
