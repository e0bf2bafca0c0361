"""What ``relax report`` shows, read from what a run left in its directory: the ``jsonl``
tracker's ``run.jsonl`` (:mod:`relax_report.jsonl`). Pure data, no plotting.

:func:`report_data` returns one JSON object, the one the page embeds (``<script
id="relax-report-data">``) and draws:

- ``steps``: the committed steps, in order; ``series``: metric name -> one value per step
  (``None`` where the step has none): ``reward/mean``, ``reward/std``, ``reward/<key>``,
  ``teacher/kl``, ``tokens``, ``response_length/mean``, ``parse_failures``, …;
  ``phases``: phase name -> seconds per step (``time/<phase>``);
- ``lanes``: the GPU residency of each shared slice (a defer slice more than one role takes
  turns on): one segment per interval a role held it (``kind`` ``held``) and per switch
  (``onload``, ``offload``) with its start and end (seconds since the run's first phase), its
  step, seconds and bytes (``weight_bytes`` and ``kv_cache_bytes`` measured with ``relax run
  --measure``; else ``None``, and ``planned_gib``: the residency plan's budget of the role on
  the slice);
- ``pushes``: each weight push (the ``push`` lane's spans): ``step``, ``start``, ``end``
  (seconds since the run's first phase, as the lanes), ``seconds``, ``failed``;
- ``staleness``: per step whose metrics have the staleness histogram
  (``async/staleness/<k>``: samples ``k`` versions behind), over its ``train`` span: ``step``,
  ``start``, ``end``, ``histogram`` (``k`` -> samples) and ``max``;
- ``samples``: every sample the trackers were shown, with its ``step``;
- ``job``, ``config``, ``summary`` (``None`` when the run left none: it was killed).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = ["report_data"]

#: The jsonl tracker's file in a run directory.
RUN_FILE = "run.jsonl"


def _lines(path: str) -> list[dict[str, Any]]:
    """The file's JSON objects (a last line cut short by a killed run is skipped)."""
    out = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                if f.read().strip():  # only the very last line may be torn
                    raise ValueError(f"{path}:{number}: not a JSON line") from None
    return out


def report_data(run_dir: str) -> dict[str, Any]:
    """The report's data of the run in ``run_dir`` (see the module docstring).

    :raises ValueError: ``run_dir`` has no ``run.jsonl`` (the run had no ``jsonl`` tracker:
        ``relax run --report`` turns it on), or a line of it is not JSON.
    """
    path = os.path.join(run_dir, RUN_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"{run_dir}: no {RUN_FILE}; the report is drawn from the jsonl tracker's records "
            '(run with --report, --tracker jsonl or [run] trackers = ["jsonl"])'
        )
    rows = _lines(path)
    config: dict[str, Any] = next((r["config"] for r in rows if r["type"] == "config"), {})
    summary = next((r["summary"] for r in rows if r["type"] == "close"), None)
    metrics = {r["step"]: r["metrics"] for r in rows if r["type"] == "metrics"}
    spans = [r for r in rows if r["type"] == "span"]
    steps = sorted(metrics)
    names = sorted({k for m in metrics.values() for k in m if not k.startswith("time/")})
    phases = sorted(
        {k for m in metrics.values() for k in m if k.startswith("time/")} - {"time/step"}
    )
    return {
        "job": config.get("job"),
        "config": config,
        "summary": summary,
        "steps": steps,
        "series": {k: [metrics[n].get(k) for n in steps] for k in names},
        "phases": {k[len("time/") :]: [metrics[n].get(k, 0.0) for n in steps] for k in phases},
        "lanes": residency_lanes(config, spans, summary),
        "pushes": pushes(spans),
        "staleness": staleness(metrics, spans),
        "samples": [
            {"step": r["step"], **s} for r in rows if r["type"] == "samples" for s in r["samples"]
        ],
    }


def _origin(spans: Iterable[Mapping[str, Any]]) -> float:
    """The run's first phase's start: the time axis' zero."""
    return min((s["start"] for s in spans), default=0.0)


def pushes(spans: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The weight pushes (the ``push`` lane's spans; see the module docstring)."""
    t0 = _origin(spans)
    return [
        {
            "step": s["step"],
            "start": s["start"] - t0,
            "end": s["start"] + s["seconds"] - t0,
            "seconds": s["seconds"],
            "failed": bool(s.get("failed")),
        }
        for s in sorted(spans, key=lambda s: s["start"])
        if s.get("lane") == "push"
    ]


_STALENESS = "async/staleness/"


def staleness(
    metrics: Mapping[int, Mapping[str, Any]], spans: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Each step's staleness histogram over its ``train`` span (see the module docstring); a
    step without either is left out."""
    t0 = _origin(spans)
    trained = {s["step"]: s for s in spans if s.get("lane") == "trainer" and s["name"] == "train"}
    out = []
    for step, m in sorted(metrics.items()):
        histogram = {
            k[len(_STALENESS) :]: int(v)
            for k, v in sorted(m.items())
            if k.startswith(_STALENESS) and k[len(_STALENESS) :].isdigit()
        }
        span = trained.get(step)
        if not histogram or span is None:
            continue
        out.append(
            {
                "step": step,
                "start": span["start"] - t0,
                "end": span["start"] + span["seconds"] - t0,
                "histogram": histogram,
                "max": max(int(k) for k in histogram),
            }
        )
    return out


def _switch_bytes(summary: Mapping[str, Any] | None) -> dict[tuple[int, str, str], list[Any]]:
    """``--measure``'s switches by (step, role, direction), in the order they happened."""
    out: dict[tuple[int, str, str], list[Any]] = {}
    switching = (summary or {}).get("switching") or {}
    for s in switching.get("switches") or ():
        out.setdefault((s["step"], s["role"], s["direction"]), []).append(s)
    return out


def _shared_slices(config: Mapping[str, Any]) -> dict[str, list[str]]:
    """Slice id -> its roles, for the slices more than one role shares."""
    by_slice: dict[str, list[str]] = {}
    for role, sid in (config.get("slices") or {}).items():
        by_slice.setdefault(sid, []).append(role)
    return {sid: sorted(roles) for sid, roles in sorted(by_slice.items()) if len(roles) > 1}


def _planned(config: Mapping[str, Any], sid: str, role: str) -> float | None:
    slices = (config.get("residency") or {}).get("slices") or {}
    demand = ((slices.get(sid) or {}).get("demand") or {}).get(role)
    return None if demand is None else float(sum(demand.values()))


def residency_lanes(
    config: Mapping[str, Any], spans: Iterable[Mapping[str, Any]], summary: Any = None
) -> list[dict[str, Any]]:
    """The residency segments of every shared slice (see the module docstring), from the
    ``leases`` lane's ``<role>.onload`` / ``<role>.offload`` spans: a role holds its slice
    from the start of its onload to the end of its offload; one whose first switch is an
    offload held it from the start of the run (the generation role starts awake)."""
    spans = sorted(spans, key=lambda s: s["start"])
    if not spans:
        return []
    t0 = spans[0]["start"]
    t_end = max(s["start"] + s["seconds"] for s in spans)
    measured = _switch_bytes(summary)
    taken: dict[tuple[int, str, str], int] = {}
    out: list[dict[str, Any]] = []
    for sid, roles in _shared_slices(config).items():
        for role in roles:
            planned = _planned(config, sid, role)
            since: float | None = None
            first = True
            for s in spans:
                if s.get("lane") != "leases" or not s["name"].startswith(f"{role}."):
                    continue
                direction = s["name"][len(role) + 1 :]
                if direction not in ("onload", "offload"):
                    continue
                start, end = s["start"] - t0, s["start"] + s["seconds"] - t0
                if direction == "offload" and first:
                    since = 0.0
                first = False
                key = (s["step"], role, direction)
                index = taken.get(key, 0)
                taken[key] = index + 1
                found = measured.get(key, [])
                m = found[index] if index < len(found) else {}
                if direction == "offload" and since is not None:
                    out.append(_segment(sid, role, "held", since, start, s["step"], planned))
                    since = None
                segment = _segment(sid, role, direction, start, end, s["step"], planned)
                segment.update(
                    seconds=s["seconds"],
                    failed=bool(s.get("failed")),
                    weight_bytes=m.get("weight_bytes"),
                    kv_cache_bytes=m.get("kv_cache_bytes"),
                )
                out.append(segment)
                if direction == "onload":
                    since = end
            if since is not None:
                out.append(_segment(sid, role, "held", since, t_end - t0, None, planned))
    return out


def _segment(
    sid: str, role: str, kind: str, start: float, end: float, step: int | None, planned: Any
) -> dict[str, Any]:
    return {
        "slice": sid,
        "role": role,
        "kind": kind,
        "start": start,
        "end": end,
        "step": step,
        "planned_gib": planned,
    }
