"""Run one call per item, each in its own thread, and wait for them all."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any


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
