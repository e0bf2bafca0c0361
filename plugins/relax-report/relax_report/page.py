"""The report page: one self-contained HTML file (plotly.js inlined, nothing fetched when it is
viewed) drawn from :func:`~relax_report.data.report_data` with plotly.

Charts, each a ``<div class="chart">`` with its ``data-chart`` name: ``rewards`` (mean ± std
and each reward adapter's mean per step), ``teacher-kl``, ``tokens`` (tokens and mean response
length), ``parse-failures``, ``phases`` (each step's phase seconds, stacked) and ``residency``
(one lane per role of each shared slice: when it held the GPUs, every switch with its seconds
and bytes); then the sample table (``<table id="samples">``, filtered as you type). The data
drawn is embedded as JSON (``<script type="application/json" id="relax-report-data">``).

plotly is imported here only (``relax-report``): ``import relax_core`` never loads it.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["CHARTS", "render_page"]

#: Every chart of the page, in order (a chart whose data the run lacks is left out).
CHARTS = ("rewards", "teacher-kl", "tokens", "parse-failures", "phases", "residency")

_ROLE_COLOURS = ("#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#9d755d")


def _values(series: Mapping[str, Sequence[Any]], name: str) -> list[Any] | None:
    values = series.get(name)
    if values is None or all(v is None for v in values):
        return None
    return list(values)


def _figures(data: Mapping[str, Any]) -> list[tuple[str, str, Any]]:
    """``(chart name, title, figure)`` of every chart the data has."""
    import plotly.graph_objects as go

    steps, series = data["steps"], data["series"]
    out: list[tuple[str, str, Any]] = []

    def layout(fig: Any, y: str) -> Any:
        fig.update_layout(
            xaxis_title="step", yaxis_title=y, margin={"l": 60, "r": 20, "t": 30, "b": 50},
            legend={"orientation": "h", "y": -0.2}, template="plotly_white",
        )  # fmt: skip
        fig.update_xaxes(tickmode="array", tickvals=steps)
        return fig

    mean, std = _values(series, "reward/mean"), _values(series, "reward/std")
    if mean is not None:
        fig = go.Figure()
        fig.add_trace(
            go.Scatter(
                x=steps, y=mean, name="reward mean ± std", mode="lines+markers",
                error_y={"type": "data", "array": std or [0] * len(steps), "visible": True},
            )
        )  # fmt: skip
        keys = [
            k for k in series if k.startswith("reward/") and k not in ("reward/mean", "reward/std")
        ]
        for key in keys:
            fig.add_trace(
                go.Scatter(x=steps, y=series[key], name=key[len("reward/") :], mode="lines+markers")
            )
        out.append(("rewards", "Reward per step (each adapter's mean)", layout(fig, "reward")))
    kl = _values(series, "teacher/kl")
    if kl is not None:
        fig = go.Figure(go.Scatter(x=steps, y=kl, name="teacher KL", mode="lines+markers"))
        out.append(("teacher-kl", "KL to the teacher", layout(fig, "KL")))
    tokens, length = _values(series, "tokens"), _values(series, "response_length/mean")
    if tokens is not None:
        fig = go.Figure(go.Bar(x=steps, y=tokens, name="response tokens"))
        if length is not None:
            fig.add_trace(
                go.Scatter(x=steps, y=length, name="mean response length", yaxis="y2",
                           mode="lines+markers")
            )  # fmt: skip
            fig.update_layout(yaxis2={"title": "tokens per response", "overlaying": "y",
                                      "side": "right"})  # fmt: skip
        out.append(("tokens", "Tokens and response length", layout(fig, "tokens")))
    failures = _values(series, "parse_failures")
    if failures is not None:
        fig = go.Figure(go.Bar(x=steps, y=failures, name="parse failures"))
        samples = _values(series, "samples")
        if samples is not None:
            fig.add_trace(go.Scatter(x=steps, y=samples, name="samples", mode="lines+markers"))
        out.append(("parse-failures", "Judge answers without a verdict", layout(fig, "samples")))
    if data["phases"]:
        fig = go.Figure(
            [go.Bar(x=steps, y=secs, name=phase) for phase, secs in data["phases"].items()]
        )
        fig.update_layout(barmode="stack")
        out.append(("phases", "Seconds per phase of each step", layout(fig, "seconds")))
    if data["lanes"]:
        out.append(("residency", "GPU residency of each shared slice", _lanes(data["lanes"])))
    return out


def _bytes(n: Any) -> str:
    return "-" if n is None else f"{n / 1e6:.1f} MB"


def _lanes(lanes: Sequence[Mapping[str, Any]]) -> Any:
    import plotly.graph_objects as go

    fig = go.Figure()
    roles = sorted({seg["role"] for seg in lanes})
    colour = {r: _ROLE_COLOURS[i % len(_ROLE_COLOURS)] for i, r in enumerate(roles)}
    for role in roles:
        for kind in ("held", "onload", "offload"):
            segs = [s for s in lanes if s["role"] == role and s["kind"] == kind]
            if not segs:
                continue
            text = []
            for s in segs:
                what = f"{role} {kind}" + ("" if s["step"] is None else f", step {s['step']}")
                line = (
                    f"{what}<br>{s['start']:.2f}s → {s['end']:.2f}s ({s['end'] - s['start']:.3f}s)"
                )
                if kind != "held":
                    line += f"<br>weights {_bytes(s.get('weight_bytes'))}, KV cache "
                    line += _bytes(s.get("kv_cache_bytes"))
                if s.get("planned_gib") is not None:
                    line += f"<br>planned {s['planned_gib']:.3f} GiB"
                text.append(line)
            fig.add_trace(
                go.Bar(
                    x=[max(s["end"] - s["start"], 1e-3) for s in segs],
                    base=[s["start"] for s in segs],
                    y=[f"{s['slice']} · {role}" for s in segs],
                    orientation="h",
                    name=f"{role} {kind}" if kind != "held" else role,
                    marker={
                        "color": colour[role] if kind == "held" else "#222222",
                        "opacity": 0.85 if kind == "held" else 1.0,
                    },
                    hovertext=text,
                    hoverinfo="text",
                )
            )
    fig.update_layout(
        barmode="overlay", xaxis_title="seconds since the first phase", template="plotly_white",
        margin={"l": 140, "r": 20, "t": 30, "b": 50}, legend={"orientation": "h", "y": -0.25},
    )  # fmt: skip
    return fig


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
.meta { color: #555; } .chart { height: 380px; }
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
    import plotly.io as pio

    parts = []
    for i, (name, title, fig) in enumerate(_figures(data)):
        div = pio.to_html(
            fig, full_html=False, include_plotlyjs=i == 0, default_height="380px",
            default_width="100%", div_id=f"chart-{name}", config={"displaylogo": False},
        )  # fmt: skip
        parts.append(
            f'<h2>{html.escape(title)}</h2>\n<div class="chart" data-chart="{name}">{div}</div>'
        )
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
