"""The summary of tools/h200-issue34.sh: ``python tools/h200_issue34_summary.py OUT`` reads the
files the script wrote under OUT and prints one JSON object (missing parts are ``null``).

- ``switches``: each switch of the run-h200.toml run (graphs on) against 1.25 x the pinned copy
  of its bytes + 15 ms, the engines' own seconds, the decode graphs captured during it and its
  hops in ms (``hops_median_ms``: each hop's median over the onloads and the offloads, and
  per role: ``hops_median_ms_by_role``);
- ``phases``: per step past the first, generate's and genrm's tokens/s (their engines'
  generation counters over the phase's seconds), and over the engine's own at that shape
  (``relax-hf engine-throughput``), and the engine alone with the phase's own requests
  (``engine_variants``: its ``--compare`` variants over the random prompts);
- ``gpu_bench``: decode at concurrency 1 against the roofline; ``wake``: p50 / p99 against the
  pinned copy; ``async``: each run's committed steps.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

LIMIT_FACTOR, LIMIT_FIXED = 1.25, 0.015


def _rows(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    except (OSError, ValueError):
        return []


def _last_json(path: Path) -> dict[str, Any] | None:
    rows = _rows(path)
    return rows[-1] if rows else None


def _delta(after: dict[str, Any], before: dict[str, Any], key: str) -> Any:
    if key in after and key in before:
        return after[key] - before[key]
    return None


def _run(rows: list[dict[str, Any]]) -> dict[str, Any]:
    steps = [r for r in rows if "reward_mean" in r]
    summary = rows[-1] if rows and rows[-1].get("summary") else {}
    switching = summary.get("switching") or {}
    switches = []
    for w in switching.get("switches") or []:
        copy = w.get("copy_seconds")
        limit = None if copy is None else LIMIT_FACTOR * copy + LIMIT_FIXED
        captures = _delta(
            w.get("counters_after") or {}, w.get("counters_before") or {}, "cuda_graph_captures"
        )
        switches.append(
            {
                "step": w["step"],
                "role": w["role"],
                "direction": w["direction"],
                "ms": round(w["seconds"] * 1e3, 1),
                "engine_ms": None
                if w.get("engine_seconds") is None
                else round(w["engine_seconds"] * 1e3, 1),
                "copy_ms": None if copy is None else round(copy * 1e3, 1),
                "limit_ms": None if limit is None else round(limit * 1e3, 1),
                "within": None if limit is None else w["seconds"] <= limit,
                "captures": captures,
                # Where the switch's milliseconds went (docs/run.md, --measure: each hop).
                "hops_ms": {k: round(v * 1e3, 2) for k, v in (w.get("hops") or {}).items()},
            }
        )
    phases = []
    for s in steps[1:]:
        row: dict[str, Any] = {"step": s["step"], "samples": s.get("samples")}
        for role, phase in (("rollout", "generate"), ("genrm", "genrm")):
            at = {
                (w["role"], w["direction"], w["step"]): w for w in switching.get("switches") or []
            }
            on = [at[k] for k in [(role, "onload", s["step"])] if k in at]
            off = [at[k] for k in [(role, "offload", s["step"])] if k in at]
            seconds = (s.get("phases") or {}).get(phase)
            if on and off and seconds:
                a, b = off[0].get("counters_before") or {}, on[0].get("counters_after") or {}
                tokens = _delta(a, b, "generation_tokens_total")
                busy = _delta(a, b, "step_seconds_total")
                row[phase] = {
                    "seconds": round(seconds, 3),
                    "tokens": tokens,
                    "tokens_per_s": None if tokens is None else round(tokens / seconds, 1),
                    # the engine's compute thread in steps, over the phase's seconds
                    "engine_busy": None if busy is None else round(busy / seconds, 3),
                    "steps": {k: _delta(a, b, f"{k}_steps_total") for k in ("prefill", "decode")},
                    # graphs captured on first use inside the phase (~60 ms each on an H100)
                    "graphs_captured": _delta(a, b, "cuda_graph_captures"),
                }
        phases.append(row)
    within = [x["within"] for x in switches if x["within"] is not None]
    captured = [x["captures"] for x in switches if x["captures"] is not None]
    return {
        "steps": len(steps),
        "step_seconds": [round(r["seconds"], 2) for r in steps],
        "switching_share": switching.get("share_of_step"),
        "switches_within_1.25x_copy_plus_15ms": f"{sum(within)} of {len(within)}",
        "all_within_15ms": all(within) if within else None,
        "graphs_captured_during_switches": sum(captured) if captured else None,
        "switches": switches,
        "hops_median_ms": {d: _median_hops(switches, d) for d in ("onload", "offload")},
        "hops_median_ms_by_role": {
            role: {d: _median_hops(switches, d, role) for d in ("onload", "offload")}
            for role in dict.fromkeys(x["role"] for x in switches)
        },
        "phases": phases,
    }


def _median_hops(
    switches: list[dict[str, Any]], direction: str, role: str | None = None
) -> dict[str, float]:
    """Each hop's median over the run's switches of ``direction`` (of ``role``: ``None``,
    every role's) that report it."""
    hops = [
        x["hops_ms"] for x in switches if x["direction"] == direction and role in (None, x["role"])
    ]
    keys = dict.fromkeys(k for h in hops for k in h)
    return {k: round(statistics.median(h[k] for h in hops if k in h), 2) for k in keys}


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged


#: The run's phases that are switches (rollout's offload acknowledgement counted as one).
_SWITCH_PHASES = (".onload", ".offload", ".ack")


def _exposed_switching(trace: Path, switches: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The probe's switches (``started`` and ``seconds``) placed in the run's Chrome trace
    (``relax run --trace``): their milliseconds during which no phase other than a switch
    ran on any lane (rollout's onload runs beside the trainer's step: it costs the run
    nothing, yet the probe's ``share_of_step`` counts it), over the wall time from the first
    phase's start to the last one's end. Rollout's offload acknowledgement (``rollout.ack``)
    counts as switching too. Without the probe's switches (a run without ``--measure``), the
    trace's own switch phases."""
    try:
        doc = json.loads(trace.read_text())
    except (OSError, ValueError):
        return None
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    spans = [(e["name"], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6) for e in events
             if e.get("ph") == "X"]  # fmt: skip
    timed = [w for w in switches if w.get("started")]
    if not spans:
        return None
    if timed:
        ours = [(w["started"], w["started"] + w["seconds"]) for w in timed]
        ours += [(a, b) for n, a, b in spans if n.endswith(".ack")]
    else:  # a run without --measure: the switches' own phases (no probe inside them)
        ours = [(a, b) for n, a, b in spans if n.endswith(_SWITCH_PHASES)]
    other = _union([(a, b) for n, a, b in spans if not n.endswith(_SWITCH_PHASES)])
    exposed = 0.0
    for a, b in _union(ours):
        exposed += (b - a) - sum(max(0.0, min(b, d) - max(a, c)) for c, d in other)
    wall = max(b for _, _, b in spans) - min(a for _, a, _ in spans)
    return {
        "switch_ms": round(sum(b - a for a, b in ours) * 1e3, 1),
        "exposed_ms": round(exposed * 1e3, 1),
        "wall_ms": round(wall * 1e3, 1),
        "exposed_share_of_wall": round(exposed / wall, 4) if wall else None,
    }


def main(out: Path) -> dict[str, Any]:
    rows = _rows(out / "graphs.jsonl")
    result: dict[str, Any] = {"graphs_run": _run(rows)}
    switches = ((rows or [{}])[-1].get("switching") or {}).get("switches")
    result["graphs_run"]["switching_exposed"] = _exposed_switching(
        out / "trace.json", switches or []
    )
    for role, phase in (("rollout", "generate"), ("genrm", "genrm")):
        engine = _last_json(out / f"throughput-{role}.json")
        own = engine.get("tokens_per_s") if engine else None
        ratios = [
            p[phase]["tokens_per_s"] / own
            for p in result["graphs_run"]["phases"]
            if own and phase in p and p[phase]["tokens_per_s"] is not None
        ]
        result[f"{phase}_vs_engine"] = {
            "engine_tokens_per_s": own,
            "engine_busy": engine.get("engine_busy") if engine else None,
            "engine_shape": None
            if not engine
            else {k: engine.get(k) for k in ("concurrency", "prompt_tokens", "max_new_tokens")},
            "phase_over_engine": [round(r, 3) for r in ratios],
            "median": round(statistics.median(ratios), 3) if ratios else None,
            "target": 0.8,
            # the engine alone with the phase's own requests (--compare), over random prompts
            "engine_variants": None if not engine else engine.get("variants"),
        }
    bench = _last_json(out / "gpu-bench.json")
    decode = (bench or {}).get("decode") or {}
    result["gpu_bench"] = {
        "c1_tokens_per_s": decode.get("c1_tokens_per_s"),
        "c64_tokens_per_s": decode.get("c64_tokens_per_s"),
        "c1_over_roofline": decode.get("c1_over_roofline"),
        "steps": decode.get("steps"),  # decode steps, started ahead, of those unused
        "target": 0.35,
    }
    off = ((_last_json(out / "gpu-bench-off.json") or {}).get("decode")) or {}
    if off.get("c1_tokens_per_s") and decode.get("c1_tokens_per_s"):
        # the overlapped schedule off, right after (PARTS=gpu-bench-off)
        result["gpu_bench"]["without_overlap"] = {
            k: off.get(k) for k in ("c1_tokens_per_s", "c64_tokens_per_s", "c1_over_roofline")
        }
        result["gpu_bench"]["c1_overlap_over_without"] = round(
            decode["c1_tokens_per_s"] / off["c1_tokens_per_s"], 3
        )
    fused = ((_last_json(out / "gpu-bench-compile.json") or {}).get("decode")) or {}
    if fused.get("c1_tokens_per_s"):
        # --torch-compile (PARTS=gpu-bench-compile): the decode step's pieces fused
        result["gpu_bench"]["with_torch_compile"] = {
            k: fused.get(k) for k in ("c1_tokens_per_s", "c64_tokens_per_s", "c1_over_roofline")
        }
        if decode.get("c1_tokens_per_s"):
            result["gpu_bench"]["c1_compiled_over_default"] = round(
                fused["c1_tokens_per_s"] / decode["c1_tokens_per_s"], 3
            )
    wake = _last_json(out / "wake.json")
    copy = _last_json(out / "copy.json")
    if wake:
        p50, p99 = wake.get("wake_cost_p50_ms"), wake.get("wake_cost_p99_ms")
        pinned = (copy or {}).get("pinned_h2d_ms")
        result["wake"] = {
            "p50_ms": p50,
            "p99_ms": p99,
            "pinned_copy_ms": pinned,
            "p50_over_copy": round(p50 / pinned, 2) if p50 and pinned else None,
            "p99_over_p50": round(p99 / p50, 2) if p50 and p99 else None,
            "targets": "p50 <= 2 x copy, p99 <= 2 x p50",
        }
    runs = []
    for path in sorted(out.glob("async-*.jsonl"), key=lambda p: int(p.stem.split("-")[1])):
        rows = _rows(path)
        steps = [r for r in rows if "reward_mean" in r]
        runs.append({"run": path.stem, "steps_committed": len(steps),
                     "step_seconds": [round(r["seconds"], 2) for r in steps]})  # fmt: skip
    result["async_runs"] = runs
    # PARTS=judge-paths: the judge's requests with the engine admitting at every step (n=1)
    # and every N steps; per path, tokens/s and prefill steps of each round.
    paths = {}
    for path in sorted(out.glob("judge-paths-*.json")):
        got = _last_json(path)
        if got:
            paths[path.stem.rsplit("-", 1)[1]] = {
                name: {
                    "tokens_per_s": [m["tokens_per_s"] for m in row["runs"]],
                    "prefill_steps": [m["prefill_steps"] for m in row["runs"]],
                    "median_over_random": row["median_over_random"],
                }
                for name, row in got["paths"].items()
            }
    result["judge_paths"] = paths
    result["vmm_handover"] = {
        path.stem.split("-", 1)[1] + " GiB": _handover(_rows(path))
        for path in sorted(out.glob("vmm-*.jsonl"))
    }
    result["gc_pauses"] = _gc_pauses(out)
    skipped = out / "skipped.txt"
    result["skipped"] = skipped.read_text().splitlines() if skipped.exists() else []
    return result


def _handover(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """tools/vmm-probe.py --handover-only: medians (ms) of the taker's pool take and map, of a
    park (the release's unmap and park), and the chunks a pool was mapped with."""

    def ms(values: list[float]) -> float | None:
        return round(statistics.median(values) * 1e3, 2) if values else None

    takes = [r["pool"] for r in rows if r.get("who") == "B" and r.get("op") == "take"]
    parks = [r for r in rows if r.get("op") == "park"]
    backs = [r for r in rows if r.get("op") == "take back"]
    return {
        "chunks": takes[0].get("chunks") if takes else None,
        "take_ms": ms([t["take_seconds"] for t in takes]),
        "map_ms": ms([t["map_seconds"] for t in takes]),
        "park_ms": ms([r["s"] for r in parks]),
        # whether A read B's data after taking the pool back (None: no round came back)
        "data_kept": all(r.get("data_from_b") for r in backs) if backs else None,
    }


def _gc_pauses(out: Path) -> dict[str, Any]:
    """Each part's garbage-collection pauses of 20 ms or more (tools/gcprobe), by process:
    how many, their sum and the longest (ms); ``after_freeze``: the same over the pauses of
    processes that had frozen their start-up heap (an engine or a job serving)."""
    parts: dict[str, dict[str, float]] = {}
    try:
        for line in (out / "parts.txt").read_text().splitlines():
            name, at, what = line.split("\t")
            parts.setdefault(name, {})[what] = float(at)
    except (OSError, ValueError):
        return {}
    pauses = [p for p in _rows(out / "gc.jsonl") if p.get("ms", 0) >= 20]
    found: dict[str, Any] = {}
    for name, span in parts.items():
        begin, end = span.get("start"), span.get("end", float("inf"))
        if begin is None:
            continue
        by: dict[str, list[float]] = {}
        serving: list[float] = []  # of processes past their start-up freeze
        for p in pauses:
            if begin <= p["t"] <= end:
                cmd = p["cmd"]
                kind = next(
                    (k for k in ("relax_hf", "relax_core", "default_worker", "bench") if k in cmd),
                    "other",
                )
                by.setdefault(kind, []).append(p["ms"])
                if p.get("frozen", 0) > 0:
                    serving.append(p["ms"])
        by["after_freeze"] = serving
        found[name] = {
            k: {"count": len(v), "sum_ms": round(sum(v), 1), "max_ms": max(v, default=0.0)}
            for k, v in by.items()
        }
    return found


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]))))
