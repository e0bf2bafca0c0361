"""Parts of the hypothesis state machines (the lease engine, the coordinator, the wake
controller, the step driver): their settings (each runs real asyncio tasks, so no deadline and
no too-slow health check; the count of examples and of rules per example is each test's own)
and what a fake handle's call does when it misbehaves."""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, settings


def machine_settings(
    examples: int, steps: int, *, derandomize: bool = False, filter_too_much: bool = False
) -> settings:
    """``examples`` runs of at most ``steps`` rules each; ``derandomize``: the same examples
    every session; ``filter_too_much``: a machine whose preconditions reject many draws."""
    checks = [HealthCheck.too_slow] + ([HealthCheck.filter_too_much] if filter_too_much else [])
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        derandomize=derandomize,
        deadline=None,
        suppress_health_check=checks,
    )


async def misbehave(behaviour: str, never: asyncio.Event, late: float, what: str) -> None:
    """What a fake manager handle's call does before it answers, after one yield to the loop:
    ``"hang"`` waits for ``never`` (set only at teardown), ``"late"`` answers after ``late``
    seconds, ``"raise"`` raises as the call of a dead actor does (``what``: the call, in the
    message); any other behaviour goes on at once."""
    await asyncio.sleep(0)
    if behaviour == "hang":
        await never.wait()
    if behaviour == "late":
        await asyncio.sleep(late)
    if behaviour == "raise":
        raise RuntimeError(f"{what}: the actor died")
