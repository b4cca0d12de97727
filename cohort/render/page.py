"""A run as one self-contained HTML page: plots and markers on a shared time axis.

`render(data, title)` draws what `cohort.coordinator.series` extracted from a run as
inline SVG, with no network access at view time (no scripts, styles or fonts from
elsewhere). Every text that reaches the page is escaped: worker names, reasons and
device names come from untrusted input.
"""

from __future__ import annotations

import html
import itertools
import math
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from cohort.coordinator.series import Marker, Point, ReportData, Series

WIDTH = 960
HEIGHT = 240
LEFT = 88
RIGHT = 16
TOP = 28
BOTTOM = 36
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
JOB_COLORS = {"active ranks": "#1f77b4", "members": "#555555"}
MARKER_COLORS = {
    "failure": "#d62728",
    "leader": "#9467bd",
    "world": "#999999",
    "promotion": "#2ca02c",
    "pause": "#ff7f0e",
    "resume": "#2ca02c",
    "straggler": "#bcbd22",
    "diverged": "#e377c2",
    "advice": "#ff7f0e",
    "advice-cleared": "#17becf",
    "checkpoint": "#1f77b4",
    "rewind": "#8c564b",
    "lost": "#d62728",
    "finished": "#2ca02c",
}
LANES = (
    ("failure", ("failure",)),
    ("leader", ("leader",)),
    ("world", ("world",)),
    ("spares", ("promotion",)),
    ("paused", ("pause", "resume", "finished")),
    ("straggler", ("straggler",)),
    ("diverged", ("diverged",)),
    ("GPU advice", ("advice", "advice-cleared")),
    ("checkpoints", ("checkpoint", "rewind", "lost")),
)
LEGEND_MAX = 24
LABEL_CHAR_PX = 6.5  # width of one 11px character, near enough to avoid overlaps
GAP_FACTOR, GAP_MIN_S = 5.0, 2.0
"""A line is broken where its samples stop for over GAP_FACTOR times their median spacing
and at least GAP_MIN_S seconds."""


def _escaped(text: object) -> str:
    """`text` safe inside HTML text and quoted attributes: it may come from untrusted input."""
    return html.escape(str(text), quote=True)


def _color(worker: str, order: dict[str, int]) -> str:
    index = order.get(worker, 0)
    if index < len(PALETTE):
        return PALETTE[index]
    return f"hsl({(index * 137.508) % 360:.1f},65%,45%)"  # golden angle: neighbours differ


@dataclass(frozen=True)
class _Axis:
    """The shared time axis: every plot maps time to x the same way."""

    t0: float
    t1: float

    def x(self, at: float) -> float:
        return LEFT + (at - self.t0) / (self.t1 - self.t0) * (WIDTH - LEFT - RIGHT)


def _nice_step(span: float, target: int = 5) -> float:
    if span <= 0 or not math.isfinite(span):
        return 1.0
    raw = span / target
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if raw <= factor * power:
            return factor * power
    return 10 * power


def _time_step(span: float) -> float:
    for step in (0.1, 0.2, 0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600):
        if span / step <= 8:
            return step
    return 3600 * _nice_step(span / 3600, 8)


def _fmt_rel(seconds: float) -> str:
    if seconds < 60:
        return f"{round(seconds, 3):g}s"
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _fmt_abs(at: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(at)) + f".{int(at * 1000) % 1000:03d}Z"


def _frame(plot_id: str, title: str, unit: str, axis: _Axis, height: int = HEIGHT) -> list[str]:
    bottom = height - BOTTOM
    out = [
        f'<svg id="{_escaped(plot_id)}" class="plot" role="img" width="{WIDTH}" height="{height}" '
        f'viewBox="0 0 {WIDTH} {height}" data-t0="{axis.t0!r}" data-t1="{axis.t1!r}">',
        f"<title>{_escaped(title)}</title>",
        f'<text class="plot-title" x="{LEFT}" y="16">{_escaped(title)}'
        + (f' <tspan class="unit">({_escaped(unit)})</tspan>' if unit else "")
        + "</text>",
        f'<rect class="area" x="{LEFT}" y="{TOP}" width="{WIDTH - LEFT - RIGHT}" '
        f'height="{bottom - TOP}"/>',
    ]
    step = _time_step(axis.t1 - axis.t0)
    tick = 0.0
    while axis.t0 + tick <= axis.t1 + 1e-9:
        x = axis.x(axis.t0 + tick)
        out.append(
            f'<line class="grid" x1="{x:.1f}" y1="{TOP}" x2="{x:.1f}" y2="{bottom}"/>'
            f'<text class="tick" x="{x:.1f}" y="{bottom + 14}" text-anchor="middle">'
            f"{_escaped(_fmt_rel(tick))}</text>"
        )
        tick += step
    return out


def _markers(axis: _Axis, markers: Iterable[Marker], y0: float, y1: float) -> list[str]:
    out = []
    for m in markers:
        x = axis.x(m.at)
        out.append(
            f'<line class="marker marker-{_escaped(m.kind)}" data-kind="{_escaped(m.kind)}" '
            f'x1="{x:.1f}" y1="{y0:.1f}" x2="{x:.1f}" y2="{y1:.1f}" '
            f'stroke="{MARKER_COLORS.get(m.kind, "#999")}">'
            f"<title>{_escaped(_fmt_rel(m.at - axis.t0))} {_escaped(m.label)} "
            f"[{_escaped(m.entry_id)}]</title>"
            "</line>"
        )
    return out


def _line_plot(
    plot_id: str,
    title: str,
    unit: str,
    lines: Sequence[Series],
    axis: _Axis,
    markers: Sequence[Marker],
    order: dict[str, int],
    zero_based: bool = True,
) -> str:
    out = _frame(plot_id, title, unit, axis)
    bottom = HEIGHT - BOTTOM
    values = [v for s in lines for _, v in s.points]
    out.extend(_markers(axis, markers, TOP, bottom))
    if not values:
        out.append(
            f'<text class="no-data" x="{WIDTH / 2:.0f}" y="{(TOP + bottom) / 2:.0f}" '
            'text-anchor="middle">no data</text></svg>'
        )
        return "\n".join(out)
    lo, hi = min(values), max(values)
    if zero_based:
        lo = min(lo, 0.0)
    step = _nice_step(hi - lo if hi > lo else abs(hi) or 1.0)
    lo = math.floor(lo / step) * step
    hi = math.ceil(hi / step) * step
    if hi <= lo:
        hi = lo + step

    def y(value: float) -> float:
        return bottom - (value - lo) / (hi - lo) * (bottom - TOP)

    tick = lo
    while tick <= hi + step / 1e6:
        out.append(
            f'<line class="grid" x1="{LEFT}" y1="{y(tick):.1f}" x2="{WIDTH - RIGHT}" '
            f'y2="{y(tick):.1f}"/><text class="tick" x="{LEFT - 6}" y="{y(tick) + 4:.1f}" '
            f'text-anchor="end">{_escaped(f"{round(tick, 10):g}")}</text>'
        )
        tick += step
    out.extend(_drawn(lines, axis, y, order, [m.at for m in markers if m.kind == "rewind"]))
    if plot_id == "plot-loss":
        rewinds = [m for m in markers if m.kind == "rewind"]
        out.extend(_lane_labels(axis, rewinds, "rewind", TOP + 12))
    out.append("</svg>")
    return "\n".join(out)


def _drawn(
    lines: Sequence[Series],
    axis: _Axis,
    y: Callable[[float], float],
    order: dict[str, int],
    cuts: Sequence[float],
) -> list[str]:
    """Each line as polylines (cut by `_pieces`), a dot where a piece is one sample."""
    out = []
    for s in lines:
        color = JOB_COLORS.get(s.label, "#333") if not s.worker else _color(s.worker, order)
        dash = ' stroke-dasharray="6 3"' if s.dashed else ""
        tip = _escaped(s.tooltip or s.label)
        # job-wide lines (membership) are stairs: held between changes, never gaps
        for piece in _pieces(s.points, cuts) if s.worker else [list(s.points)]:
            points = " ".join(f"{axis.x(t):.1f},{y(v):.1f}" for t, v in piece)
            out.append(
                f'<polyline class="series" data-worker="{_escaped(s.worker or s.label)}" '
                f'points="{points}" stroke="{color}"{dash}><title>{tip}</title></polyline>'
            )
            if len(piece) == 1:
                t, v = piece[0]
                out.append(
                    f'<circle class="dot" cx="{axis.x(t):.1f}" cy="{y(v):.1f}" r="3" '
                    f'fill="{color}"><title>{tip}</title></circle>'
                )
    return out


def _pieces(points: Sequence[Point], cuts: Sequence[float] = ()) -> list[list[Point]]:
    """`points` cut where samples stopped (a gap of over GAP_FACTOR times the line's median
    spacing, and at least GAP_MIN_S) and at each of `cuts` (rewinds: the line goes back in
    training, not on in time): a stall or failover shows as a gap, not a straight line."""
    if len(points) < 3:
        return [list(points)] if points else []
    gaps = sorted(b[0] - a[0] for a, b in itertools.pairwise(points))
    longest = max(GAP_FACTOR * gaps[len(gaps) // 2], GAP_MIN_S)
    out: list[list[Point]] = [[points[0]]]
    for before, point in itertools.pairwise(points):
        cut = any(before[0] < at <= point[0] for at in cuts)
        if cut or point[0] - before[0] > longest:
            out.append([])
        out[-1].append(point)
    return out


def _events_plot(axis: _Axis, markers: Sequence[Marker]) -> str:
    lane_height = 22
    height = TOP + lane_height * len(LANES) + BOTTOM
    out = _frame("plot-events", "Events", "", axis, height)
    for lane, (name, kinds) in enumerate(LANES):
        y0 = TOP + lane * lane_height
        out.append(
            f'<text class="lane" x="{LEFT - 6}" y="{y0 + 15}" text-anchor="end">'
            f"{_escaped(name)}</text>"
        )
        mine = [m for m in markers if m.kind in kinds]
        out.extend(_markers(axis, mine, y0 + 3, y0 + lane_height - 3))
        if kinds[0] in ("failure", "leader", "promotion", "advice"):
            out.extend(_lane_labels(axis, mine, kinds[0], y0 + 15))
    if not markers:
        out.append(
            f'<text class="no-data" x="{WIDTH / 2:.0f}" y="{height / 2:.0f}" '
            'text-anchor="middle">no events</text>'
        )
    out.append("</svg>")
    return "\n".join(out)


def _lane_labels(axis: _Axis, markers: Sequence[Marker], kind: str, y: float) -> list[str]:
    """Labels beside a lane's markers of `kind`, each cut to the room before the next
    marker; markers of `kind` drawn at one place (failures at once) share one label."""
    together: list[tuple[float, str, list[str]]] = []  # (x, kind, labels)
    for m in markers:
        x = axis.x(m.at) + 4
        if together and m.kind == kind == together[-1][1] and x - together[-1][0] < 2:
            together[-1][2].append(m.label)
        else:
            together.append((x, m.kind, [m.label]))
    xs = [x for x, _, _ in together] + [float(WIDTH - RIGHT)]
    out = []
    for (x, of, labels), following in zip(together, xs[1:], strict=False):
        room = int((following - x - 6) / LABEL_CHAR_PX)
        label = "; ".join(labels)
        if of != kind:
            continue
        last, before = following == xs[-1], int((x - 8 - LEFT) / LABEL_CHAR_PX)
        if last and room < len(label) <= before:  # near the right edge: written leftwards
            out.append(
                f'<text class="marker-label" x="{x - 8:.1f}" y="{y:.1f}" text-anchor="end">'
                f"{_escaped(label)}</text>"
            )
            continue
        if room < 4:
            continue
        text = label if len(label) <= room else label[: room - 1] + "…"
        out.append(f'<text class="marker-label" x="{x:.1f}" y="{y:.1f}">{_escaped(text)}</text>')
    return out


def _legend(lines: Sequence[Series], order: dict[str, int]) -> str:
    if not lines:
        return ""
    items = []
    for s in lines[:LEGEND_MAX]:
        color = JOB_COLORS.get(s.label, "#333") if not s.worker else _color(s.worker, order)
        style = "dashed" if s.dashed else "solid"
        items.append(
            f'<li class="legend-item" data-worker="{_escaped(s.worker or s.label)}">'
            f'<span class="swatch {style}" style="border-color:{color}"></span>'
            f"{_escaped(s.label)}</li>"
        )
    if len(lines) > LEGEND_MAX:
        items.append(f"<li>and {len(lines) - LEGEND_MAX} more</li>")
    return '<ul class="legend">' + "".join(items) + "</ul>"


STYLE = """
body{font:14px system-ui,sans-serif;margin:24px;color:#222;background:#fff}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:24px 0 8px}
.meta,.note{color:#666}
figure{margin:0 0 12px}
svg.plot{display:block;background:#fff}
svg .area{fill:#fafafa;stroke:#ccc}
svg .grid{stroke:#e4e4e4}
svg .tick,svg .lane,svg .marker-label{font-size:11px;fill:#666}
svg .unit{font-weight:400;fill:#666}
svg .plot-title{font-size:13px;font-weight:600;fill:#222}
svg .no-data{font-size:14px;fill:#999}
svg .series{fill:none;stroke-width:1.6}
svg .marker{stroke-width:1.5;opacity:.55}
svg .marker-world{stroke-width:1;opacity:.35}
#plot-events .marker{stroke-width:3;opacity:.9}
body.highlighting svg .series:not(.hl){opacity:.12}
.legend{list-style:none;padding:0;margin:4px 0 0 88px;display:flex;flex-wrap:wrap;gap:4px 14px}
.legend-item{cursor:default}
.swatch{display:inline-block;width:18px;margin-right:5px;vertical-align:middle;
border-top:3px solid}
.swatch.dashed{border-top-style:dashed}
table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;vertical-align:top}
td.num{text-align:right}
code{font-size:12px;white-space:nowrap}
"""

# Not required: the page reads the same without it. It highlights a worker's lines when
# its legend entry is hovered, and marks the page as scripted-ok for the browser test.
SCRIPT = """
(function () {
  var lines = document.querySelectorAll("svg .series");
  function highlight(worker) {
    for (var i = 0; i < lines.length; i++) {
      lines[i].classList.toggle("hl", lines[i].getAttribute("data-worker") === worker);
    }
    document.body.classList.toggle("highlighting", worker !== null);
  }
  var items = document.querySelectorAll(".legend-item");
  for (var i = 0; i < items.length; i++) {
    items[i].addEventListener("mouseenter", function (e) {
      highlight(e.currentTarget.getAttribute("data-worker"));
    });
    items[i].addEventListener("mouseleave", function () { highlight(null); });
  }
  document.body.dataset.ok = "1";
})();
"""


NO_GPU = (
    '<p class="note" id="no-gpu">No GPU readings in this run: its workers sent none (no '
    "GPU, no NVML, or <code>--gpu-interval 0</code>), so there are no GPU memory or "
    "temperature plots.</p>"
)


def _summary_table(data: ReportData) -> str:
    s = data.summary
    rows = (
        ("facts", s.facts),
        ("steps committed", s.steps_committed),
        ("epochs finished", s.epochs_finished),
        ("workers joined", s.joined),
        ("workers failed", s.failed),
        ("workers left", s.left),
        ("spares promoted", s.promotions),
        ("joins refused", s.refused),
        ("leader elections", s.elections),
        ("world changes", s.world_changes),
        ("final world size", s.final_world_size),
        ("weight divergences", s.divergences),
        ("checkpoints saved", s.checkpoints),
        ("rewinds", s.rewinds),
        ("committed steps discarded by rewinds", s.discarded_steps),
        ("dead letters (retained)", s.dead_letters),
        ("inbox entries refused (journaled)", sum(r[3] for r in data.refused)),
        ("of them forged", sum(r[3] for r in data.refused if r[2] == "forged")),
        ("inbox repairs", s.inbox_repairs),
        ("inbox entries retained", s.inbox_entries),
        ("inbox entries not decodable (skipped)", s.inbox_skipped),
    )
    body = "".join(f'<tr><th>{_escaped(k)}</th><td class="num">{v}</td></tr>' for k, v in rows)
    return f'<table id="summary">{body}</table>'


def _refused_table(data: ReportData) -> str:
    """What the leaders refused at the inbox, by sender (empty: nothing was)."""
    if not data.refused:
        return ""
    rows = "".join(
        f"<tr><td>{_escaped(sender)}</td><td>{'its signature' if proven else 'claimed'}</td>"
        f'<td>{_escaped(kind)}</td><td class="num">{count}</td><td class="num">{size}</td></tr>'
        for sender, proven, kind, count, size in data.refused
    )
    return (
        "<h2>Refused at the inbox</h2>"
        '<table id="refused"><thead><tr><th>sender</th><th>proven by</th><th>kind</th>'
        f"<th>entries</th><th>bytes</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def _timeline_table(data: ReportData) -> str:
    note = ""
    if data.timeline_total > len(data.timeline):
        note = (
            f'<p class="note">Showing the last lines of {data.timeline_total} and every '
            "membership fact before them; <code>cohort replay</code> prints every fact.</p>"
        )
    rows = "".join(
        f"<tr><td><code>{_escaped(r.entry_id)}</code></td>"
        f"<td>{_escaped(_fmt_rel(r.at - data.start))}</td>"
        f"<td>{_escaped(r.type)}</td><td>{_escaped(r.text)}</td></tr>"
        for r in data.timeline
    )
    return (
        note + '<table id="timeline"><thead><tr><th>entry</th><th>time</th><th>fact</th>'
        f"<th>what</th></tr></thead><tbody>{rows}</tbody></table>"
    )


def render(data: ReportData, title: str) -> str:
    """One self-contained HTML document: plots on one time axis, a summary, the timeline."""
    span = data.end - data.start
    axis = _Axis(data.start, data.end if span > 0 else data.start + 1.0)
    order = _worker_order(data)
    figures = [
        "<figure>"
        + _line_plot(pid, name, unit, lines, axis, data.markers, order, zero_based)
        + _legend(lines, order)
        + "</figure>"
        for pid, name, unit, lines, zero_based in _plots(data)
    ]
    if not (data.gpu_memory or data.gpu_temperature):
        figures.append(NO_GPU)
    figures.append("<figure>" + _events_plot(axis, data.markers) + "</figure>")
    return _document(data, title, span, "".join(figures))


_Plot = tuple[str, str, str, Sequence[Series], bool]
"""(element id, title, unit, lines, whether the y axis starts at zero) of one line plot."""


def _worker_order(data: ReportData) -> dict[str, int]:
    """Each worker's place in the palette, the same in every plot."""
    groups = (
        data.step_time,
        data.loss,
        *(lines for _, lines in data.figures),
        data.evaluation,
        data.gpu_memory,
        data.gpu_temperature,
        data.transfers,
    )
    workers = sorted({s.worker for group in groups for s in group})
    return {w: i for i, w in enumerate(workers)}


def _plots(data: ReportData) -> list[_Plot]:
    """The line plots of a run, in page order; those a run has no data for are left out."""
    plots: list[_Plot] = [
        ("plot-membership", "Membership", "workers", data.membership, True),
        ("plot-step-time", "Step time per worker", "seconds", data.step_time, True),
        ("plot-loss", "Loss per worker", "loss", data.loss, False),
    ]
    plots += [
        (f"plot-figure-{index}", f"{name} per worker", name, lines, False)
        for index, (name, lines) in enumerate(data.figures)
    ]
    if data.evaluation:
        plots.append(("plot-evaluation", "Evaluations", "metric", data.evaluation, False))
    if data.transfers:
        plots.append(("plot-transfers", "Transfers waiting", "transfers", data.transfers, True))
    if data.gpu_memory or data.gpu_temperature:
        plots += [
            ("plot-gpu-memory", "GPU memory used", "%", data.gpu_memory, True),
            ("plot-gpu-temperature", "GPU temperature", "°C", data.gpu_temperature, False),
        ]
    return plots


def _document(data: ReportData, title: str, span: float, figures: str) -> str:
    """The page around the figures: head, run line, summary and timeline."""
    heading = _escaped(title)
    job = _escaped(data.job or "?")
    started = _escaped(_fmt_abs(data.start) if data.timeline_total or data.end else "-")
    lasted = _escaped(_fmt_rel(max(span, 0.0)))
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{heading}</title>
<style>{STYLE}</style>
</head>
<body>
<h1>{heading}</h1>
<p class="meta">job <b>{job}</b> &middot; first event {started} (UTC)
&middot; span {lasted} &middot; time axis: since the first event</p>
<p class="note">Step times, losses and GPU readings come from the retained inbox, which is
trimmed to its retention window: older samples may be missing. Vertical lines mark events;
hover one for what happened.</p>
{figures}
<h2>Summary</h2>
{_summary_table(data)}
{_refused_table(data)}
<h2>Timeline</h2>
{_timeline_table(data)}
<script>{SCRIPT}</script>
</body>
</html>
"""
