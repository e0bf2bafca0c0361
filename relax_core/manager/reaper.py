"""Kill an engine's (or a router's) process group when the process that started it dies.

Run as a stdlib-only script (``python -I -S reaper.py WORKER_PID ENGINE_PID``) by the worker
after each launch: it detaches (double fork), prints its pid, and polls every ``INTERVAL``
seconds; once the worker is gone it SIGKILLs the engine's group, once the engine is gone it
exits (pids identified by start time, never a reused one). Best effort: the manager still
fences an engine whose actor died."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time

INTERVAL = 0.1


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # Fields after the command name (which may hold spaces and parentheses).
    return raw[raw.rindex(")") + 2 :].split()


def start_time(pid: int) -> str | None:
    """The start time of ``pid`` (``/proc/PID/stat`` field 22); ``None`` if gone or a zombie."""
    fields = _stat(pid)
    if fields is None or fields[0] in ("Z", "X"):
        return None
    return fields[19]


def _kill_engine(engine: int, engine_start: str) -> None:
    fields = _stat(engine)
    if fields is None or fields[19] != engine_start:
        return
    pgid = int(fields[2])
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if pgid == engine:
            os.killpg(engine, signal.SIGKILL)
        else:
            os.kill(engine, signal.SIGKILL)


def watch(worker: int, worker_start: str, engine: int, engine_start: str) -> None:
    """Poll until the worker or the engine is gone; kill the engine if the worker went first."""
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    while True:
        if start_time(engine) != engine_start:
            return
        if start_time(worker) != worker_start:
            _kill_engine(engine, engine_start)
            return
        time.sleep(INTERVAL)


def start_reaper(owner: int, process: int) -> int | None:
    """Start this script detached, to SIGKILL ``process``'s group once ``owner`` is gone.

    :returns: the reaper's pid; ``None`` if either process was already gone."""
    import subprocess

    reaper = subprocess.Popen(
        [sys.executable, "-I", "-S", os.path.abspath(__file__), str(owner), str(process)],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    assert reaper.stdout is not None
    line = reaper.stdout.readline()
    reaper.wait(timeout=10)
    reaper.stdout.close()
    return int(line.strip() or 0) or None


def main(argv: list[str]) -> int:
    worker, engine = int(argv[0]), int(argv[1])
    worker_start, engine_start = start_time(worker), start_time(engine)
    if worker_start is None or engine_start is None:
        print(0, flush=True)
        return 0
    if os.fork() > 0:
        # The intermediate process exits at once; the grandchild is re-parented away from Ray.
        os._exit(0)
    os.setsid()
    print(os.getpid(), flush=True)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    watch(worker, worker_start, engine, engine_start)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
