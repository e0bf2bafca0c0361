"""The report page: one self-contained HTML file drawn from
:func:`~relax_report.data.report_data`, its charts inline SVG (:mod:`relax_report.svg`: no
charting library, no script to draw them, nothing fetched when it is viewed; a few dozen
kilobytes besides the run's data and samples).

Charts, each a ``<div class="chart">`` with its ``data-chart`` name and ``data-traces`` (how
many traces or lanes it draws, each a ``<g class="trace">``): ``rewards`` (mean ± std and each
reward adapter's mean per step), ``teacher-kl``, ``tokens`` (response tokens, the policy's and
the environment's stacked when an environment wrote any, and the mean response length),
``parse-failures``, ``rollout`` (each number a rollout reported per sample: its mean and max
per step), ``phases`` (each step's phase seconds, stacked) and ``residency`` (on one time axis:
a lane per role of each shared slice — when it held the GPUs, every switch with its seconds and
bytes —, the weight pushes, and the staleness of what each step trained on); then the sample
table (``<table id="samples">``, filtered as you type). The data drawn is embedded as JSON
(``<script type="application/json" id="relax-report-data">``).
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from relax_report.svg import COLOURS, Segment, Trace, lane_chart, step_chart

__all__ = ["CHARTS", "render_page"]

#: Every chart of the page, in order (a chart whose data the run lacks is left out).
CHARTS = ("rewards", "teacher-kl", "tokens", "parse-failures", "rollout", "phases", "residency")

#: The ``rollout`` numbers the tokens chart draws (the rollout chart draws the others).
_TOKEN_SPLIT = ("policy_tokens", "environment_tokens")
_ROLLOUT_MEAN = re.compile(r"rollout/(.+)/mean")
_SWITCH_COLOUR = "#222222"
_PUSH_COLOUR = "#e45756"
_STALENESS_COLOURS = ("#54a24b", "#f58518", "#e45756")


def _values(series: Mapping[str, Sequence[Any]], name: str) -> list[Any] | None:
    values = series.get(name)
    if values is None or all(v is None for v in values):
        return None
    return list(values)


def _figures(data: Mapping[str, Any]) -> list[tuple[str, str, int, str]]:
    """``(chart name, title, traces, svg)`` of every chart the data has."""
    steps, series = data["steps"], data["series"]
    out: list[tuple[str, str, int, str]] = []

    def chart(name: str, title: str, traces: list[Trace], y: str, **kw: Any) -> None:
        out.append((name, title, len(traces), step_chart(steps, traces, y_title=y, **kw)))

    mean, std = _values(series, "reward/mean"), _values(series, "reward/std")
    if mean is not None:
        traces = [Trace("reward mean ± std", mean, errors=std)]
        keys = [
            k for k in series if k.startswith("reward/") and k not in ("reward/mean", "reward/std")
        ]
        traces += [Trace(key[len("reward/") :], series[key]) for key in keys]
        chart("rewards", "Reward per step (each adapter's mean)", traces, "reward")
    kl = _values(series, "teacher/kl")
    if kl is not None:
        chart("teacher-kl", "KL to the teacher", [Trace("teacher KL", kl)], "KL")
    tokens, length = _values(series, "tokens"), _values(series, "response_length/mean")
    if tokens is not None:
        policy = _values(series, "rollout/policy_tokens/total")
        env = _values(series, "rollout/environment_tokens/total")
        if policy is not None and env is not None and any(env):
            traces = [
                Trace("policy tokens", policy, "bar"),
                Trace("environment tokens", env, "bar"),
            ]
        else:
            traces = [Trace("response tokens", tokens, "bar")]
        y2 = None
        if length is not None:
            traces.append(Trace("mean response length", length, right=True))
            y2 = "tokens per response"
        chart("tokens", "Tokens and response length", traces, "tokens", y2_title=y2,
              stacked=True)  # fmt: skip
    failures = _values(series, "parse_failures")
    if failures is not None:
        traces = [Trace("parse failures", failures, "bar")]
        samples = _values(series, "samples")
        if samples is not None:
            traces.append(Trace("samples", samples))
        chart("parse-failures", "Judge answers without a verdict", traces, "samples")
    reported = [
        m.group(1)
        for k in series
        if (m := _ROLLOUT_MEAN.fullmatch(k)) and m.group(1) not in _TOKEN_SPLIT
    ]
    if reported:
        traces = []
        for i, name in enumerate(reported):
            colour = COLOURS[i % len(COLOURS)]
            seconds = name.endswith("seconds")
            traces.append(Trace(f"{name} mean", series[f"rollout/{name}/mean"], colour=colour,
                                right=seconds))  # fmt: skip
            top = series.get(f"rollout/{name}/max")
            if top is not None:
                traces.append(Trace(f"{name} max", top, "bar", colour=colour, right=seconds))
        right = any(t.right for t in traces)
        chart("rollout", "What the rollout reported per sample (mean, max)", traces,
              "per sample", y2_title="seconds" if right else None)  # fmt: skip
    if data["phases"]:
        traces = [Trace(phase, secs, "bar") for phase, secs in data["phases"].items()]
        chart("phases", "Seconds per phase of each step", traces, "seconds", stacked=True)
    segments = [
        *_residency(data["lanes"]),
        *_pushes(data.get("pushes") or ()),
        *_staleness(data.get("staleness") or ()),
    ]
    if segments:
        svg = lane_chart(segments, x_title="seconds since the first phase")
        title = "GPU residency of each shared slice, weight pushes and staleness"
        out.append(("residency", title, len({s.lane for s in segments}), svg))
    return out


def _bytes(n: Any) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def _residency(lanes: Sequence[Mapping[str, Any]]) -> list[Segment]:
    """The residency segments: a role's colour while it held the slice, dark for a switch."""
    roles = sorted({seg["role"] for seg in lanes})
    colour = {r: COLOURS[i % len(COLOURS)] for i, r in enumerate(roles)}
    out = []
    for s in lanes:
        role, kind = s["role"], s["kind"]
        what = f"{role} {kind}" + ("" if s["step"] is None else f", step {s['step']}")
        text = f"{what}\n{s['start']:.2f}s → {s['end']:.2f}s ({s['end'] - s['start']:.3f}s)"
        if kind != "held":
            text += f"\nweights {_bytes(s.get('weight_bytes'))}, KV cache "
            text += _bytes(s.get("kv_cache_bytes"))
        if s.get("planned_gib") is not None:
            text += f"\nplanned {s['planned_gib']:.3f} GiB"
        out.append(
            Segment(
                f"{s['slice']} · {role}", s["start"], s["end"],
                colour[role] if kind == "held" else _SWITCH_COLOUR, text,
                legend=role if kind == "held" else "switch (onload, offload)",
            )
        )  # fmt: skip
    return out


def _pushes(pushes: Sequence[Mapping[str, Any]]) -> list[Segment]:
    """A lane of the weight pushes, each with its step and seconds."""
    return [
        Segment(
            "weight pushes", p["start"], p["end"], _PUSH_COLOUR,
            f"weight push before step {p['step']}: {p['seconds']:.3f}s"
            + (" FAILED" if p.get("failed") else ""),
            legend="weight push",
        )
        for p in pushes
    ]  # fmt: skip


def _staleness(steps: Sequence[Mapping[str, Any]]) -> list[Segment]:
    """A lane of what each step trained on, over its training: green when every sample was
    of the current weights, orange at staleness 1, red beyond."""
    out = []
    for s in steps:
        worst = int(s["max"])
        hist = ", ".join(f"{n} at {k}" for k, n in s["histogram"].items())
        out.append(
            Segment(
                "staleness", s["start"], s["end"],
                _STALENESS_COLOURS[min(worst, len(_STALENESS_COLOURS) - 1)],
                f"step {s['step']} trained on samples of staleness {hist or 'unknown'} "
                f"(max {worst})",
                legend=f"staleness {worst if worst < 2 else '≥ 2'}",
            )
        )  # fmt: skip
    return out


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, Mapping):
        return "<br>".join(f"{html.escape(str(k))}: {_cell(v)}" for k, v in value.items())
    return html.escape("" if value is None else str(value))


_COLUMNS = (
    "step",
    "id",
    "reward",
    "rewards",
    "teacher_kl",
    "response_tokens",
    "prompt",
    "response",
)

_STYLE = """
body { font-family: system-ui, sans-serif; margin: 1.5rem auto; max-width: 1200px; color: #222; }
h1 { font-size: 1.4rem; } h2 { font-size: 1.1rem; margin-top: 2rem; }
.meta { color: #555; } .chart svg { width: 100%; height: auto; display: block; }
.chart text { font-family: system-ui, sans-serif; } .tick { font-size: 11px; fill: #555; }
.axis { font-size: 12px; fill: #222; } .grid { stroke: #e8e8e8; }
.legend { display: flex; flex-wrap: wrap; gap: 4px 14px; font-size: 12px; margin: 2px 0 0 70px; }
.legend i { display: inline-block; width: 12px; height: 12px; margin-right: 4px;
  vertical-align: -2px; }
table { border-collapse: collapse; width: 100%; font-size: 0.85rem; }
th, td { border: 1px solid #ddd; padding: 4px 6px; vertical-align: top; text-align: left; }
th { background: #f4f4f4; position: sticky; top: 0; }
td.text { white-space: pre-wrap; max-width: 420px; }
#filter { margin: 0.5rem 0; padding: 4px; width: 320px; }
"""

_SCRIPT = """
document.getElementById("filter").addEventListener("input", function (event) {
  var needle = event.target.value.toLowerCase();
  document.querySelectorAll("#samples tbody tr").forEach(function (row) {
    row.style.display = row.textContent.toLowerCase().indexOf(needle) === -1 ? "none" : "";
  });
});
"""


def _summary_line(data: Mapping[str, Any]) -> str:
    summary = data.get("summary")
    steps = len(data["steps"])
    if summary is None:
        return f"{steps} committed step(s); the run left no summary (it was stopped abruptly)"
    text = f"{summary.get('steps_committed')} of {summary.get('steps')} steps committed"
    if summary.get("interrupted"):
        text += f", interrupted in step {summary.get('interrupted_step')}"
    elif summary.get("failed_step") is not None:
        text += f", step {summary['failed_step']} failed"
    versions = summary.get("weight_versions") or []
    if versions:
        text += "; rollout weights " + " → ".join(str(v) for v in versions)
    return text


def render_page(data: Mapping[str, Any]) -> str:
    """The report page of ``data`` (:func:`~relax_report.data.report_data`)."""
    parts = [
        f'<h2>{html.escape(title)}</h2>\n<div class="chart" data-chart="{name}" '
        f'data-traces="{traces}">{svg}</div>'
        for name, title, traces, svg in _figures(data)
    ]
    head = "".join(f"<th>{c}</th>" for c in _COLUMNS)
    rows = "\n".join(
        "<tr>"
        + "".join(
            f'<td class="text">{_cell(s.get(c))}</td>'
            if c in ("prompt", "response")
            else f"<td>{_cell(s.get(c))}</td>"
            for c in _COLUMNS
        )
        + "</tr>"
        for s in data["samples"]
    )
    # </script> inside the JSON would end its element early: escape every "<".
    embedded = json.dumps(data, default=str).replace("<", "\\u003c")
    job = html.escape(str(data.get("job") or "relax run"))
    return f"""<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>relax run {job}</title><style>{_STYLE}</style></head>
<body>
<h1>relax run {job}</h1>
<p class="meta">{html.escape(_summary_line(data))}</p>
{"".join(parts)}
<h2>Samples</h2>
<input id="filter" type="search" placeholder="filter samples (any text)">
<table id="samples"><thead><tr>{head}</tr></thead><tbody>
{rows}
</tbody></table>
<script type="application/json" id="relax-report-data">{embedded}</script>
<script>{_SCRIPT}</script>
</body>
</html>
"""
