"""The report's charts as inline SVG, drawn here with no charting library: a page of a few
dozen kilobytes that any browser shows with no script (each point, bar and segment has a
``<title>``: the browser's tooltip on hover).

Two kinds of chart:

- :func:`step_chart`: values per step — :class:`Trace` lines (with error bars) and bars
  (grouped, or stacked), on a left axis and an optional right one;
- :func:`lane_chart`: segments on a time axis, one row per lane (:class:`Segment`).

Every trace or lane is one ``<g class="trace" data-name="…">``; the ``<svg>`` has
``class="chart-svg"``, and its legend follows it (``<div class="legend">``).
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import attrs

__all__ = ["COLOURS", "Segment", "Trace", "lane_chart", "step_chart"]

#: The traces' colours, in order (then again).
COLOURS = (
    "#4c78a8", "#f58518", "#54a24b", "#b279a2", "#e45756", "#72b7b2", "#9d755d", "#bab0ac",
    "#eeca3b", "#ff9da6", "#9ecae9", "#ffbf79", "#88d27a", "#d6a5c9", "#79706e", "#439894",
)  # fmt: skip

_W, _H = 1100, 360
_LEFT, _RIGHT, _TOP, _BOTTOM = 70, 70, 12, 44


@attrs.frozen
class Trace:
    """One series over the steps: ``values`` (``None``: the step has none), drawn as a
    ``line`` (markers, and ``errors`` as bars ± around each point) or a ``bar``; on the left
    axis or the right one (``right``)."""

    name: str
    values: Sequence[float | None]
    kind: str = "line"
    errors: Sequence[float | None] | None = None
    right: bool = False
    colour: str | None = None


@attrs.frozen
class Segment:
    """One interval of a lane chart: its row (``lane``), ``start`` and ``end`` (seconds),
    ``colour`` and its tooltip ``text`` (lines)."""

    lane: str
    start: float
    end: float
    colour: str
    text: str
    legend: str = ""


def _esc(text: object) -> str:
    return html.escape(str(text), quote=True)


def _num(value: float) -> str:
    return f"{value:.4g}"


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """About ``count`` round values covering ``[lo, hi]``."""
    if not hi > lo:
        hi = lo + 1.0
    raw = (hi - lo) / count
    step = 10 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if raw <= m * step:
            step *= m
            break
    first = math.floor(lo / step) * step
    ticks = []
    t = first
    while t < hi + step * 0.999:
        ticks.append(round(t, 12))
        t += step
    return ticks


def _range(values: Sequence[float]) -> tuple[float, float]:
    lo, hi = min([0.0, *values]), max([0.0, *values])
    ticks = _ticks(lo, hi)
    return ticks[0], ticks[-1]


def _legend(entries: Sequence[tuple[str, str]]) -> str:
    """The chart's legend: HTML under its SVG, wrapping as the page is narrow."""
    items = "".join(
        f'<span><i style="background:{colour}"></i>{_esc(name)}</span>' for name, colour in entries
    )
    return f'<div class="legend">{items}</div>'


def step_chart(
    steps: Sequence[int],
    traces: Sequence[Trace],
    *,
    y_title: str,
    y2_title: str | None = None,
    stacked: bool = False,
) -> str:
    """The ``<svg>`` of ``traces`` over ``steps`` (bars ``stacked`` or side by side)."""
    traces = [
        t if t.colour else attrs.evolve(t, colour=COLOURS[i % len(COLOURS)])
        for i, t in enumerate(traces)
    ]
    width = _W - _LEFT - _RIGHT
    height = _H - _TOP - _BOTTOM
    band = width / max(len(steps), 1)
    bars = [t for t in traces if t.kind == "bar"]

    def extent(right: bool) -> tuple[float, float]:
        values: list[float] = []
        if stacked:
            for i in range(len(steps)):
                values.append(sum(t.values[i] or 0.0 for t in bars if t.right == right))
        for t in traces:
            if t.right != right:
                continue
            for i, v in enumerate(t.values):
                if v is None:
                    continue
                e = (t.errors[i] or 0.0) if t.errors is not None else 0.0
                values += [v - e, v + e]
        return _range(values) if values else (0.0, 1.0)

    axes = {False: extent(False), True: extent(True)}

    def y(value: float, right: bool = False) -> float:
        lo, hi = axes[right]
        return _TOP + height - (value - lo) / (hi - lo) * height

    def x(i: int) -> float:
        return _LEFT + (i + 0.5) * band

    out = [
        f'<svg class="chart-svg" viewBox="0 0 {_W} {_H}" xmlns="http://www.w3.org/2000/svg" '
        f'role="img">'
    ]
    lo, hi = axes[False]
    for t in _ticks(lo, hi):
        out.append(
            f'<line x1="{_LEFT}" x2="{_W - _RIGHT}" y1="{y(t):.1f}" y2="{y(t):.1f}" '
            f'class="grid"/><text x="{_LEFT - 6}" y="{y(t) + 4:.1f}" class="tick" '
            f'text-anchor="end">{_num(t)}</text>'
        )
    if y2_title is not None:
        for t in _ticks(*axes[True]):
            at = y(t, True) + 4
            out.append(f'<text x="{_W - _RIGHT + 6}" y="{at:.1f}" class="tick">{_num(t)}</text>')
        out.append(
            f'<text class="axis" transform="translate({_W - 12},{_TOP + height / 2}) rotate(90)" '
            f'text-anchor="middle">{_esc(y2_title)}</text>'
        )
    out.append(
        f'<text class="axis" transform="translate(16,{_TOP + height / 2}) rotate(-90)" '
        f'text-anchor="middle">{_esc(y_title)}</text>'
    )
    for i, step in enumerate(steps):
        out.append(
            f'<text x="{x(i):.1f}" y="{_TOP + height + 18}" class="tick" '
            f'text-anchor="middle">{step}</text>'
        )
    out.append(
        f'<text x="{_LEFT + width / 2}" y="{_TOP + height + 36}" class="axis" '
        f'text-anchor="middle">step</text>'
    )
    base = [0.0] * len(steps)
    slot = band * 0.7 / (1 if stacked else max(len(bars), 1))
    for k, t in enumerate(bars):
        parts = [f'<g class="trace" data-name="{_esc(t.name)}" fill="{t.colour}">']
        for i, v in enumerate(t.values):
            if v is None:
                continue
            left = x(i) - band * 0.35 + (0 if stacked else k * slot)
            bottom = base[i] if stacked else 0.0
            top = bottom + v
            y0, y1 = y(bottom, t.right), y(top, t.right)
            parts.append(
                f'<rect x="{left:.1f}" y="{min(y0, y1):.1f}" width="{slot:.1f}" '
                f'height="{max(abs(y0 - y1), 0.5):.1f}"><title>{_esc(t.name)}, step {steps[i]}: '
                f"{_num(v)}</title></rect>"
            )
            if stacked:
                base[i] = top
        out.append("".join(parts) + "</g>")
    for t in traces:
        if t.kind == "bar":
            continue
        points = [(i, v) for i, v in enumerate(t.values) if v is not None]
        parts = [f'<g class="trace" data-name="{_esc(t.name)}" stroke="{t.colour}">']
        if len(points) > 1:
            path = " ".join(f"{x(i):.1f},{y(v, t.right):.1f}" for i, v in points)
            parts.append(f'<polyline points="{path}" fill="none" stroke-width="2"/>')
        for i, v in points:
            e = t.errors[i] if t.errors is not None else None
            tip = f"{t.name}, step {steps[i]}: {_num(v)}" + ("" if e is None else f" ± {_num(e)}")
            if e:
                parts.append(
                    f'<line x1="{x(i):.1f}" x2="{x(i):.1f}" y1="{y(v - e, t.right):.1f}" '
                    f'y2="{y(v + e, t.right):.1f}" stroke-width="1.5"/>'
                )
            parts.append(
                f'<circle cx="{x(i):.1f}" cy="{y(v, t.right):.1f}" r="4" fill="{t.colour}">'
                f"<title>{_esc(tip)}</title></circle>"
            )
        out.append("".join(parts) + "</g>")
    legend = [(t.name + (" (right axis)" if t.right else ""), str(t.colour)) for t in traces]
    return "".join(out) + "</svg>" + _legend(legend)


def lane_chart(segments: Sequence[Segment], *, x_title: str) -> str:
    """The ``<svg>`` of ``segments``: one row per lane, in the order lanes first appear."""
    lanes: list[str] = []
    for s in segments:
        if s.lane not in lanes:
            lanes.append(s.lane)
    left = 190
    row = 28
    height = row * len(lanes)
    total = _TOP + height + 44
    end = max((s.end for s in segments), default=1.0) or 1.0
    start = min([0.0, *(s.start for s in segments)])
    ticks = _ticks(start, end)
    lo, hi = ticks[0], ticks[-1]
    width = _W - left - 20

    def x(t: float) -> float:
        return left + (t - lo) / (hi - lo) * width

    out = [
        f'<svg class="chart-svg" viewBox="0 0 {_W} {total}" xmlns="http://www.w3.org/2000/svg" '
        f'role="img">'
    ]
    for t in ticks:
        out.append(
            f'<line x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{_TOP}" y2="{_TOP + height}" '
            f'class="grid"/><text x="{x(t):.1f}" y="{_TOP + height + 16}" class="tick" '
            f'text-anchor="middle">{_num(t)}</text>'
        )
    out.append(
        f'<text x="{left + width / 2}" y="{_TOP + height + 34}" class="axis" '
        f'text-anchor="middle">{_esc(x_title)}</text>'
    )
    for k, lane in enumerate(lanes):
        top = _TOP + k * row
        parts = [
            f'<g class="trace" data-name="{_esc(lane)}"><text x="{left - 8}" '
            f'y="{top + row / 2 + 4}" class="tick" text-anchor="end">{_esc(lane)}</text>'
        ]
        for s in segments:
            if s.lane != lane:
                continue
            w = max(x(s.end) - x(s.start), 1.5)
            parts.append(
                f'<rect x="{x(s.start):.1f}" y="{top + 4}" width="{w:.1f}" height="{row - 8}" '
                f'fill="{s.colour}"><title>{_esc(s.text)}</title></rect>'
            )
        out.append("".join(parts) + "</g>")
    legend: dict[str, str] = {}
    for s in segments:
        if s.legend:
            legend.setdefault(s.legend, s.colour)
    return "".join(out) + "</svg>" + _legend(list(legend.items()))
