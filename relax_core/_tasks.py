"""Run awaitables as tasks of their own and wait for them all, leaving none behind."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def gather_all(aws: Iterable[Awaitable[T]]) -> list[T]:
    """Every awaitable's result, in order, each run as a task at once.

    On the first failure, or when the caller is cancelled, the other tasks are cancelled and
    waited for before the error is raised: no task outlives the call."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
