"""Taking a job down: the parts besides its models (:class:`Stop`), the models' shutdown, and
the check that every engine and router process is gone."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import attrs

from relax_core._concurrent import each_in_thread
from relax_core.jobs.models import ModelHandle
from relax_core.manager import UnconfirmedWorker
from relax_core.manager.reaper import start_time


@attrs.frozen
class Stop:
    """One part a command started besides the models, and how to stop it; ``kind`` counts
    it in the line ``{kind} stopped (N)`` (none: stopped silently)."""

    name: str
    stop: Callable[[], object]
    kind: str | None = None


def stop_parts(parts: Sequence[Stop], line: Callable[[str], None]) -> list[str]:
    """Stop every part in order (each tried), then ``line`` ``{kind} stopped (N)`` per kind;
    the problems."""
    problems: list[str] = []
    counts: dict[str, int] = {}
    for part in parts:
        try:
            part.stop()
        except Exception as exc:  # every part is tried: named in the problems, never lost
            problems.append(f"{part.name}: {type(exc).__name__}: {exc}")
        if part.kind is not None:
            counts[part.kind] = counts.get(part.kind, 0) + 1
    for kind, n in counts.items():
        line(f"{kind} stopped ({n})")
    return problems


def shutdown_models(models: Sequence[ModelHandle]) -> tuple[list[str], list[UnconfirmedWorker]]:
    """Shut every model down at once, then ask each for its workers whose cleanup is not
    confirmed (their placement groups must be kept); then let go of each (its actor). Returns
    the problems (each model's, by key) and those workers. Never raises for one model."""
    problems: dict[str, list[str]] = {}
    unconfirmed: list[UnconfirmedWorker] = []
    lock = threading.Lock()

    def one(_key: str, model: ModelHandle) -> None:
        found: list[str] = []
        workers: list[UnconfirmedWorker] = []
        for what, step in (
            ("shutdown", model.shutdown),
            ("unconfirmed workers not known", lambda: workers.extend(model.unconfirmed_workers())),
            ("close", model.close),
        ):
            try:
                step()
            except Exception as exc:  # reported; every step and every model is still tried
                found.append(f"{model.key}: {what}: {type(exc).__name__}: {exc}")
        with lock:
            problems[model.key] = found
            unconfirmed.extend(workers)

    each_in_thread(one, [(m.key, m) for m in models], name="shutdown")
    return [p for m in models for p in problems.get(m.key, [])], unconfirmed


def still_running(engine_pids: set[int], router_pids: set[int]) -> list[str]:
    """Wait up to 15 s for these processes to end; a problem line for each kind still alive."""
    deadline = time.monotonic() + 15.0
    left = {p for p in engine_pids | router_pids if _pid_alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if _pid_alive(p)}
    problems = []
    if left & engine_pids:
        problems.append(f"engine processes still running: {sorted(left & engine_pids)}")
    if left & router_pids:
        problems.append(f"router processes still running: {sorted(left & router_pids)}")
    return problems


def _pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not: it only waits to be reaped)."""
    if sys.platform.startswith("linux"):
        return start_time(pid) is not None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        pass
    return True
