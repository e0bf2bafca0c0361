"""Process helpers of the ``relax serve`` / ``relax demo`` subprocess tests: processes by
session and command line, the process listening on a port, a subprocess's output read line by
line with deadlines, a micro hf model, and ``relax serve`` run as a user runs it.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode(errors="replace")
    except OSError:
        return None
    return raw.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    fields = _stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit()]


def in_session(sid: int) -> list[int]:
    """Live processes of session ``sid`` (what ``relax serve`` started there, Ray included)."""
    out = []
    for pid in _pids():
        fields = _stat(pid)
        if fields is not None and fields[0] not in ("Z", "X") and int(fields[3]) == sid:
            out.append(pid)
    return out


def mentioning(text: str) -> list[int]:
    """Live processes whose command line contains ``text``."""
    return [p for p in _pids() if text in cmdline(p) and alive(p) and p != os.getpid()]


def listener_pid(port: int) -> int | None:
    """The process holding the TCP socket listening on ``port`` (from /proc/net/tcp)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError), open(table) as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":
                    inodes.add(cols[9])
    for pid in _pids():
        with contextlib.suppress(OSError):
            for fd in os.listdir(f"/proc/{pid}/fd"):
                with contextlib.suppress(OSError):
                    link = os.readlink(f"/proc/{pid}/fd/{fd}")
                    if link.startswith("socket:[") and link[8:-1] in inodes:
                        return pid
    return None


class Lines:
    """A subprocess's output, read on a thread; :meth:`wait_for` a line with a deadline."""

    def __init__(self, stream: IO[str]) -> None:
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, pattern: str, timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        for line in self.lines:
            if m := re.search(pattern, line):
                return m
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"no line matching {pattern!r} after {timeout}s:\n{self}")
            try:
                line = self._queue.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"output ended before {pattern!r}:\n{self}")
            self.lines.append(line)
            if m := re.search(pattern, line):
                return m

    def rest(self, timeout: float) -> str:
        self._thread.join(timeout)
        while not self._queue.empty():
            line = self._queue.get()
            if line is not None:
                self.lines.append(line)
        return str(self)

    def __str__(self) -> str:
        return "\n".join(self.lines)


#: (seed, size) -> the model this process made with ``make-tiny-model``, kept in a directory
#: of its own (removed at exit) that no test writes to; every test gets a copy (the command is
#: deterministic per seed and size: plugins/relax-hf/tests/test_plugin.py).
_MADE: dict[tuple[int, str], Path] = {}


@functools.cache
def _cache() -> Path:
    path = Path(tempfile.mkdtemp(prefix="relax-tiny-models-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def made_tiny_models(targets: dict[Path, tuple[int, str]]) -> None:
    """Each ``target`` a tiny model of its ``(seed, size)``: made as a user makes one
    (``python -m relax_hf make-tiny-model``, in parallel) the first time this process needs
    it, then copied."""
    procs = []
    for seed, size in dict.fromkeys(targets.values()):
        if (seed, size) not in _MADE:
            made = _cache() / f"seed{seed}-{size}"
            command = [sys.executable, "-m", "relax_hf", "make-tiny-model", str(made)]
            command += ["--seed", str(seed), "--size", size]
            popen = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            procs.append((seed, size, made, popen))
    for seed, size, made, proc in procs:
        _, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, err
        _MADE[(seed, size)] = made
    for target, key in targets.items():
        shutil.copytree(_MADE[key], target)


def make_tiny_model(path: Path) -> Path:
    """A micro hf model made the way a user makes one (``python -m relax_hf make-tiny-model``;
    a copy of this process's first one after it: :func:`made_tiny_models`)."""
    made_tiny_models({path: (0, "micro")})
    return path


@contextlib.contextmanager
def serve(config: Path, *args: str) -> Iterator[tuple[subprocess.Popen[str], Lines, Path]]:
    """``python -m relax_core serve CONFIG ARGS`` in a session of its own; on the way out,
    whatever the test did, every process it left (its session, its engines) is killed."""
    stderr = config.with_suffix(".stderr")
    with open(stderr, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "relax_core", "serve", str(config), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            start_new_session=True,
        )
    assert proc.stdout is not None
    lines = Lines(proc.stdout)
    try:
        yield proc, lines, stderr
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(30)
        leftovers = in_session(proc.pid) + mentioning(str(config.parent))
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.stdout.close()
