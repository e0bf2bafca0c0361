"""Run many calls at once and wait for them all: awaitables as tasks, or one thread per item."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, TypeVar

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


def each_in_thread(
    target: Callable[..., None],
    items: Iterable[tuple[Any, ...]],
    *,
    name: str,
    daemon: bool = False,
) -> None:
    """Call ``target(*item)`` for every item at once, one thread each, and wait for all.

    Threads are named ``f"{name}-{item[0]}"``. Blocking; ``target`` must catch what it wants
    reported (an exception ends only its thread). ``daemon``: the threads do not keep the
    process alive."""
    threads = [
        threading.Thread(target=target, args=item, name=f"{name}-{item[0]}", daemon=daemon)
        for item in items
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
