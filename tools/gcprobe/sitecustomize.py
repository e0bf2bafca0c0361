"""A probe of Python's garbage-collection pauses, for the H200 scripts (not part of Relax).

With ``GC_PROBE_LOG`` set and this folder first on ``PYTHONPATH``, every Python process started
(the driver, Ray's workers, the engines, ``relax serve``) appends one JSON line to that file for
each collection that took at least ``GC_PROBE_MS`` milliseconds (default 5): wall time, pid,
the process's command, the generation, the pause, the objects collected and those frozen (more
than none: the process had started and frozen its start-up heap). A full collection
in a process that imported torch and transformers costs ~0.1 s; this says whether one landed in
a switch or a wake.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time

_PATH = os.environ.get("GC_PROBE_LOG")
_MIN = float(os.environ.get("GC_PROBE_MS", "5")) / 1e3
_TYPES = os.environ.get("GC_PROBE_TYPES") == "1"
_began: list[float] = [0.0]
_seen: set[str] = set()


def _title() -> str:
    try:
        with open(f"/proc/{os.getpid()}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return ""


def _probe(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _began[0] = time.perf_counter()
        return
    took = time.perf_counter() - _began[0]
    if took < _MIN or _PATH is None:
        return
    row: dict[str, object] = {
        "t": round(time.time(), 4),
        "pid": os.getpid(),
        "cmd": " ".join(sys.argv)[:160],
        # The process's title now (Ray's workers set it to the actor and the task they run,
        # ``ray::Name.method``; sys.argv keeps the worker's command line).
        "title": _title(),
        "generation": info.get("generation"),
        "ms": round(took * 1e3, 2),
        "collected": info.get("collected"),
        # Objects frozen out of full collections (an engine's or a job's start-up heap, frozen
        # once it has started): more than 0, the pause fell while the process served.
        "frozen": gc.get_freeze_count(),
    }
    if _TYPES and info.get("generation") == 2:
        # GC_PROBE_TYPES=1: the most common types among the objects the collector tracks (what
        # a growing heap is made of); costs a pass over them, so only for diagnosis.
        counts: dict[str, int] = {}
        for obj in gc.get_objects():
            name = type(obj).__qualname__
            counts[name] = counts.get(name, 0) + 1
        row["tracked"] = sum(counts.values())
        packages = {m.partition(".")[0] for m in list(sys.modules)}
        row["new_packages"] = sorted(packages - _seen)[:40]  # imported since the last one
        _seen.update(packages)
        row["types"] = dict(sorted(counts.items(), key=lambda kv: -kv[1])[:12])
    try:
        with open(_PATH, "a") as f:
            f.write(json.dumps(row) + "\n")
    except OSError:
        pass


if _PATH:
    gc.callbacks.append(_probe)

# ENGINE_SWITCH_INTERVAL_MS (diagnosis only): the interpreter's GIL switch interval in the hf
# engines' processes (``relax_hf serve``; Python's default is 5 ms), to measure whether an
# engine's compute thread waits for its event loop's thread to hand the GIL back.
_SWITCH_MS = os.environ.get("ENGINE_SWITCH_INTERVAL_MS")
if _SWITCH_MS and "serve" in sys.argv[1:2] and "relax_hf" in " ".join(sys.orig_argv):
    sys.setswitchinterval(float(_SWITCH_MS) / 1e3)


def _chain() -> None:
    """Run the ``sitecustomize`` this one shadows (a later entry of ``sys.path``), if any."""
    here = os.path.dirname(os.path.abspath(__file__))
    for entry in sys.path:
        path = os.path.join(os.path.abspath(entry or "."), "sitecustomize.py")
        if os.path.dirname(path) != here and os.path.isfile(path):
            with open(path) as f:
                code = compile(f.read(), path, "exec")
            exec(code, {"__name__": "sitecustomize", "__file__": path})
            return


_chain()
