"""Inline SVG charts for the report: no JavaScript library, no network, readable without a browser script.

Every piece of text and every attribute value goes through :func:`markupsafe.escape`, so engine and
scenario names (which come from the command line) cannot inject markup; the functions return
:class:`markupsafe.Markup` for the autoescaping template to embed as is.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from markupsafe import Markup, escape

#: series colours: the first three (a run's usual engines) sit far apart in hue (blue, orange, green), and every
#: pair is at least 38 apart in CIELAB (tests/kvbench/test_report_charts.py); past eight, dashes and marker
#: shapes tell series apart
PALETTE = ("#1f5fbf", "#e66100", "#2a9d3a", "#c2258e", "#404040", "#8b5cf6", "#b8860b", "#0aa3b5")
#: marker shapes, one per series of a chart with several: two series drawn on top of each other still show
#: both shapes, at different places along the line
SHAPES = ("circle", "square", "triangle", "diamond", "triangle-down", "cross")
#: how many markers a series without per-point dots carries along its length
MARKS_PER_LINE = 5
#: how far apart (px) the markers of series marked at every point are set at one x
DODGE_PX = 3.5
PREEMPT_COLORS = {"recompute": "#d9434e", "swap": "#7c4dff"}
#: how much wider each series beneath another is drawn, and the most it ever gets (px)
EXTRA_WIDTH, MAX_EXTRA_WIDTH = 1.0, 2.0
#: width of a legend key (px): long enough for two periods of the longest dash pattern
LEGEND_KEY_W = 28
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif"


@dataclass
class Line:
    """One series. ``ys`` may hold None (the line breaks there)."""

    name: str
    xs: Sequence[float]
    ys: Sequence[float | None]
    color: str = PALETTE[0]
    dash: str | None = None
    area: bool = False  # fill under the line (one series per chart looks best)
    step: bool = False  # draw as a step function (CDFs)
    dots: bool = False  # mark each point (sweeps: few points, each a measurement)
    width: float = 2.0
    #: (low, high) per point, drawn as an error bar (None: no bar at that point)
    errors: Sequence[tuple[float, float] | None] | None = None
    shape: str | None = None  # a marker shape of SHAPES; render() assigns one when a chart has several series


@dataclass
class VLine:
    x: float
    label: str
    color: str = "#444"


@dataclass
class Marker:
    """A tick on the top edge, e.g. a preemption at time ``x``."""

    x: float
    color: str
    tip: str


@dataclass
class Chart:
    title: str
    x_label: str
    y_label: str
    lines: list[Line] = field(default_factory=list)
    vlines: list[VLine] = field(default_factory=list)
    hlines: list[VLine] = field(default_factory=list)  # .x is the y value
    markers: list[Marker] = field(default_factory=list)
    marker_legend: dict[str, str] = field(default_factory=dict)  # label -> color
    y_format: Callable[[float], str] = lambda v: f"{v:g}"
    x_format: Callable[[float], str] = lambda v: f"{v:g}"
    y_min: float | None = 0.0
    y_max: float | None = None
    log_x: bool = False
    y_integer: bool = False  # counts (requests, preemptions): whole-number ticks only
    width: int = 620
    height: int = 280
    subtitle: str = ""


#: a timeline of polled samples (a server's ``/metrics``) is broken where two consecutive samples lie further
#: apart than this many times the series' median interval. The sampler polls at a fixed rate (10 Hz by
#: default): a scrape answered late, or a client held off the CPU for a moment, stretches an interval to two or
#: three; five or more is the polling itself stalled (a server too busy to answer, a starved client on a shared
#: machine), and across such a hole the queue or the pool may have done anything a straight line hides
POLL_GAP_FACTOR = 5.0


def polling_gaps(xs: Sequence[float | None], factor: float = POLL_GAP_FACTOR) -> tuple[list[tuple[float, float]],
                                                                                        float | None]:
    """((x0, x1) of every interval between consecutive samples longer than ``factor`` times the median interval,
    that threshold); ([], None) with fewer than three samples or no positive median."""
    pts = sorted(float(x) for x in xs if x is not None and math.isfinite(float(x)))
    steps = [b - a for a, b in itertools.pairwise(pts)]
    if len(steps) < 2 or statistics.median(steps) <= 0:
        return [], None
    limit = factor * statistics.median(steps)
    return [(a, b) for a, b in itertools.pairwise(pts) if b - a > limit], limit


def break_at_gaps(xs: Sequence[float], ys: Sequence[float | None],
                  factor: float = POLL_GAP_FACTOR) -> tuple[list[float], list[float | None], int]:
    """``(xs, ys)`` with a break (a None point) in every polling gap of :func:`polling_gaps`, so no segment is
    drawn across it, and how many there were."""
    gaps, _ = polling_gaps(xs, factor)
    if not gaps:
        return list(xs), list(ys), 0
    starts = {a for a, _ in gaps}
    out_x: list[float] = []
    out_y: list[float | None] = []
    for i, (x, y) in enumerate(zip(xs, ys, strict=False)):
        out_x.append(x)
        out_y.append(y)
        if x in starts and i + 1 < len(xs):
            out_x.append((x + xs[i + 1]) / 2)
            out_y.append(None)
    return out_x, out_y, len(gaps)


def gap_note(broken: int, factor: float = POLL_GAP_FACTOR) -> str:
    """A chart note on ``broken`` polling gaps ("" when none)."""
    if not broken:
        return ""
    return (f"the line breaks at {broken} polling gap{'s' if broken > 1 else ''} (no sample for more than "
            f"{factor:g}× the median interval between samples)")


def _attrs(attrs: dict[str, object]) -> str:
    return "".join(f' {k.rstrip("_").replace("_", "-")}="{escape(str(v))}"' for k, v in attrs.items()
                   if v is not None)


def tag(name: str, content: str | Markup = "", **attrs: object) -> Markup:
    """``<name attrs>content</name>``; ``content`` is escaped unless it is already Markup."""
    return Markup(f"<{name}{_attrs(attrs)}>{escape(content)}</{name}>")


def nice_ticks(lo: float, hi: float, n: int = 5, integer: bool = False) -> list[float]:
    """About ``n`` round tick values covering [lo, hi] (1, 2, 2.5, 5 x 10^k steps; with ``integer``,
    whole numbers only: steps of 1, 2, 5 x 10^k and never below 1, so a queue never ticks at 2.5)."""
    if not (math.isfinite(lo) and math.isfinite(hi)):
        return [0.0]
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / max(1, n)
    mag = 10 ** math.floor(math.log10(raw))
    mults = (1, 2, 5, 10) if integer else (1, 2, 2.5, 5, 10)
    step = next(m * mag for m in mults if m * mag >= raw)
    if integer:
        step = max(1.0, float(round(step)))
    start = math.floor(lo / step) * step
    # counted, not accumulated: adding a step far below lo's precision would never move past hi
    count = min(int((hi - start) / step * (1 + 1e-9)) + 1, 4 * max(1, n) + 2)
    ticks = [round(start + i * step, 12) for i in range(count)]
    if ticks[-1] < hi:
        ticks.append(round(start + count * step, 12))
    return ticks


def _log_ticks(lo: float, hi: float) -> list[float]:
    ticks: list[float] = []
    k = math.floor(math.log10(lo))
    while 10**k <= hi * 1.0001:
        for m in (1, 2, 5):
            if lo * 0.9999 <= m * 10**k <= hi * 1.0001:
                ticks.append(m * 10**k)
        k += 1
    return ticks or [lo, hi]


#: font sizes (px, in the chart's own units) of the CSS classes the text is estimated with: report.css keeps
#: the same sizes (a chart 440 units wide drawn about 395 px wide at 1400 px keeps ticks above 11 px)
TITLE_SIZE, SUB_SIZE, TICK_SIZE = 14.0, 12.5, 12.5
LINE_GAP = 3.0


def wrap(text: str, width: float, size: float) -> list[str]:
    """``text`` broken at spaces into lines no wider than ``width`` (by :func:`text_width` at ``size``); a
    single word wider than that stays whole on its own line."""
    lines: list[str] = []
    for word in text.split():
        if lines and text_width(f"{lines[-1]} {word}", size) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines


def _header(chart: Chart, w: int) -> tuple[list[Markup], float]:
    """The title and subtitle, wrapped to the chart's width (never cut off at its edge), and the height they take."""
    x, room, y = 10, w - 20, 0.0
    parts: list[Markup] = []
    for text, size, cls in ((chart.title, TITLE_SIZE, "c-title"), (chart.subtitle, SUB_SIZE, "c-sub")):
        for line in wrap(text, room, size) if text else []:
            y += size + LINE_GAP
            parts.append(tag("text", line, x=x, y=f"{y:.0f}", class_=cls))
    return parts, y


def _assign_shapes(lines: list[Line]) -> None:
    """One marker shape per series when a chart has more than one (a series given a shape keeps it)."""
    if len(lines) < 2:
        return
    for i, ln in enumerate(lines):
        if ln.shape is None:
            ln.shape = SHAPES[i % len(SHAPES)]


def render(chart: Chart, uid: str | None = None) -> Markup:
    """The chart as an inline ``<svg>`` that scales with its container.

    Every text stays outside the plotted area: title and subtitle wrap above it, the labels of reference
    lines (``vlines``, ``hlines``) go to the legend beneath it, so no label is ever drawn over the data.
    A chart of several series marks each with its own shape at different places along the line, so a
    series drawn exactly beneath another still shows."""
    w = chart.width
    header, head_h = _header(chart, w)
    # the header's extra lines make the chart taller rather than the plot smaller
    h = chart.height + max(0, round(head_h - 2 * (TITLE_SIZE + LINE_GAP)))
    left, right, top, bottom = 64, 16, head_h + 12 + (12 if chart.markers else 0), 46
    pw, ph = w - left - right, h - top - bottom
    lines = [dataclasses.replace(ln) for ln in chart.lines]  # shapes are assigned on copies
    _assign_shapes([ln for ln in lines if not ln.area])
    xs = [x for ln in lines for x, y in zip(ln.xs, ln.ys, strict=False) if y is not None]
    xs += [v.x for v in chart.vlines] + [m.x for m in chart.markers]
    ys = [y for ln in lines for y in ln.ys if y is not None] + [v.x for v in chart.hlines]
    ys += [e for ln in lines for pair in (ln.errors or []) if pair is not None for e in pair]
    parts: list[Markup] = [tag("title", chart.title), *header]
    if not xs or not ys:
        parts.append(tag("text", "no data", x=w / 2, y=h / 2, class_="c-empty", text_anchor="middle"))
        return _svg(parts, w, h, chart.title, Markup(""))

    y_lo = chart.y_min if chart.y_min is not None else min(ys)
    y_hi = chart.y_max if chart.y_max is not None else max(ys)
    yt = nice_ticks(min(y_lo, min(ys)) if chart.y_min is None else y_lo, max(y_hi, y_lo + 1e-12), 5,
                    integer=chart.y_integer)
    if chart.y_max is not None:
        yt = [t for t in yt if t <= chart.y_max + 1e-12] or yt
    y0, y1 = yt[0], max(yt[-1], chart.y_max or yt[-1])
    # the plot starts right of the widest y tick label, which starts right of the rotated axis title
    left = max(left, round(28 + max(text_width(chart.y_format(t), TICK_SIZE) for t in yt)))
    pw = w - left - right

    x_lo, x_hi = min(xs), max(xs)
    if chart.log_x and x_lo > 0:
        xt = _log_ticks(x_lo, x_hi)
        lx0, lx1 = math.log10(min(xt[0], x_lo)), math.log10(max(xt[-1], x_hi))
        lx1 = lx1 if lx1 > lx0 else lx0 + 1

        def sx(x: float) -> float:
            return left + (math.log10(max(x, 1e-12)) - lx0) / (lx1 - lx0) * pw
    else:
        # fewer ticks on a narrow chart: a tick label is up to five characters at TICK_SIZE
        xt = nice_ticks(x_lo, x_hi, 6 if pw > 420 else 5)
        # the axis ends at the data (a time axis padded to the next round tick looks like missing data)
        x0, x1 = xt[0], (x_hi if x_hi > xt[0] else xt[-1])
        xt = [t for t in xt if t <= x1 + 1e-12]

        def sx(x: float) -> float:
            return left + (x - x0) / (x1 - x0 or 1.0) * pw

    def sy(y: float) -> float:
        return top + ph - (y - y0) / (y1 - y0 or 1.0) * ph

    # grid and axes
    for t in yt:
        parts.append(tag("line", x1=left, x2=left + pw, y1=f"{sy(t):.1f}", y2=f"{sy(t):.1f}", class_="c-grid"))
        parts.append(tag("text", chart.y_format(t), x=left - 6, y=f"{sy(t) + 4:.1f}", class_="c-tick",
                         text_anchor="end"))
    last_right = -math.inf
    for t in xt:
        parts.append(tag("line", x1=f"{sx(t):.1f}", x2=f"{sx(t):.1f}", y1=top + ph, y2=top + ph + 4,
                         class_="c-axis"))
        text = chart.x_format(t)
        half = text_width(text, TICK_SIZE) / 2
        if sx(t) - half < last_right + 4:
            continue  # crowded (a log axis' 1, 2, 5 near its top): the tick stays, its label goes
        last_right = sx(t) + half
        parts.append(tag("text", text, x=f"{sx(t):.1f}", y=top + ph + 18, class_="c-tick", text_anchor="middle"))
    parts.append(tag("line", x1=left, x2=left + pw, y1=top + ph, y2=top + ph, class_="c-axis"))
    # a log axis says so: 2, 4, 8, 16 evenly spaced reads as linear otherwise
    x_label = chart.x_label if not chart.log_x or "log scale" in chart.x_label else f"{chart.x_label} (log scale)"
    parts.append(tag("text", x_label, x=left + pw / 2, y=h - 6, class_="c-label", text_anchor="middle"))
    parts.append(tag("text", chart.y_label, x=16, y=top + ph / 2, class_="c-label", text_anchor="middle",
                     transform=f"rotate(-90 16 {top + ph / 2:.1f})"))

    clip = "clip-" + (uid or hashlib.sha1(repr((chart.title, chart.subtitle, [ln.name for ln in lines],
                                                 len(ys))).encode()).hexdigest()[:10])
    parts.append(Markup(f'<defs><clipPath id="{clip}"><rect x="{left - 6}" y="{top - 6}" width="{pw + 12}" '
                        f'height="{ph + 12}"/></clipPath></defs>'))
    plot: list[Markup] = []
    for hl in chart.hlines:
        y = sy(hl.x)
        plot.append(tag("line", tag("title", hl.label), x1=left, x2=left + pw, y1=f"{y:.1f}", y2=f"{y:.1f}",
                        stroke=hl.color, class_="c-ref"))
    thin = [ln for ln in lines if not ln.area]
    # series marked at every point (sweeps) set their markers and error bars a few pixels apart ("dodged"), so
    # two series with equal values at a point both show there
    dotted = [ln for ln in lines if ln.dots]
    dodge = {id(ln): (k - (len(dotted) - 1) / 2) * DODGE_PX for k, ln in enumerate(dotted)} if len(dotted) > 1 else {}
    for i, ln in enumerate(lines):
        # Lines drawn earlier are drawn a little wider: where two series coincide, the one beneath still
        # shows as a rim around the one on top (their dash patterns, marker shapes and the legend tell them
        # apart). The widening stops at MAX_EXTRA_WIDTH: a dozen series once made 13 px blobs.
        extra = min(MAX_EXTRA_WIDTH, EXTRA_WIDTH * (len(thin) - 1 - thin.index(ln))) \
            if ln in thin and len(thin) > 1 else 0.0
        plot.extend(_line(ln, sx, sy, top + ph, extra, buckets=max(40, int(pw // 9))))
        shift = dodge.get(id(ln), 0.0)
        plot.extend(_error_bars(ln, lambda x, d=shift: sx(x) + d, sy))
        if ln.shape is not None:
            where = _dot_points(ln) if ln.dots else _mark_points(ln, thin.index(ln) if ln in thin else i,
                                                                  len(thin), x_lo, x_hi)
            # a sweep's dot is a measurement and says so on hover; a marker along a timeline only tells series
            # apart (no tooltip: a report has hundreds of them)
            plot.extend(_shape(ln.shape, sx(x) + shift, sy(y), ln.color,
                               f"{ln.name}: x={x:g}, y={y:.4g}" if ln.dots else "")
                        for x, y in where)
        elif ln.dots:
            plot.extend(tag("circle", tag("title", f"{ln.name}: x={x:g}, y={y:.4g}"), cx=f"{sx(x):.1f}",
                            cy=f"{sy(y):.1f}", r=3.5, fill="#fff", stroke=ln.color, class_="c-dot")
                        for x, y in _dot_points(ln))
    parts.append(tag("g", Markup("").join(plot), clip_path=f"url(#{clip})"))
    for x_val, color, label in _merge_vlines(chart.vlines):
        x = sx(x_val)
        parts.append(tag("line", tag("title", label), x1=f"{x:.1f}", x2=f"{x:.1f}", y1=top, y2=top + ph,
                         stroke=color, class_="c-vline"))
    for m in chart.markers:
        x = sx(m.x)
        parts.append(tag("path", tag("title", m.tip), d=f"M{x - 3.5:.1f},{top - 12} h7 l-3.5,6 z", fill=m.color,
                         class_="c-marker"))
    return _svg(parts, w, h, chart.title, _legend(chart, lines))


def _dot_points(ln: Line) -> list[tuple[float, float]]:
    return [(float(x), float(y)) for seg in _segments(ln) for x, y in seg]


def _mark_points(ln: Line, index: int, count: int, x_lo: float, x_hi: float) -> list[tuple[float, float]]:
    """Where series ``index`` of ``count`` carries its markers: MARKS_PER_LINE places spread over the x range,
    each series shifted along by its share of a stretch, so coinciding series mark different places."""
    points = _dot_points(ln)
    if not points:
        return []
    stretch = (x_hi - x_lo) / MARKS_PER_LINE
    out = []
    for k in range(MARKS_PER_LINE):
        target = x_lo + stretch * (k + (index + 1) / (count + 1))
        before = [p for p in points if p[0] <= target]
        if not before or target > points[-1][0]:
            continue
        if ln.step:
            out.append((target, before[-1][1]))  # a step line holds its last value until the next point
            continue
        after = next((p for p in points if p[0] >= target), before[-1])
        (xa, ya), (xb, yb) = before[-1], after
        out.append((target, ya if xb == xa else ya + (yb - ya) * (target - xa) / (xb - xa)))
    return out


def _shape(shape: str, x: float, y: float, color: str, tip: str = "", r: float = 4.0) -> Markup:
    """A marker of ``shape`` centred on (x, y): white inside, outlined in the series' colour (whole units:
    about a pixel each, and a third of the bytes of one decimal)."""
    x, y = round(x), round(y)
    a, b, c = round(r), round(r * .8), round(r * 1.2)
    paths = {
        "square": f"M{x - b},{y - b}h{2 * b}v{2 * b}h{-2 * b}z",
        "triangle": f"M{x},{y - c}L{x + a},{y + b}L{x - a},{y + b}z",
        "triangle-down": f"M{x},{y + c}L{x + a},{y - b}L{x - a},{y - b}z",
        "diamond": f"M{x},{y - c}L{x + a},{y}L{x},{y + c}L{x - a},{y}z",
        "cross": f"M{x - a},{y}h{2 * a}M{x},{y - a}v{2 * a}",
    }
    title = tag("title", tip) if tip else ""
    if shape in paths:
        return tag("path", title, d=paths[shape], fill="#fff", stroke=color, class_="c-dot", data_shape=shape)
    return tag("circle", title, cx=x, cy=y, r=f"{r * .9:g}", fill="#fff", stroke=color, class_="c-dot",
               data_shape="circle")


def _error_bars(ln: Line, sx: Callable[[float], float], sy: Callable[[float], float]) -> list[Markup]:
    """A vertical bar with caps from each point's low to its high (the repeats' range)."""
    out = []
    for x, pair in zip(ln.xs, ln.errors or [], strict=False):
        if pair is None or x is None:
            continue
        lo, hi = sorted(pair)
        px, y_lo, y_hi = sx(float(x)), sy(lo), sy(hi)
        out.append(tag("path", tag("title", f"{ln.name}: {lo:.4g} to {hi:.4g} over the repeats"),
                       d=f"M{px:.1f},{y_lo:.1f}V{y_hi:.1f}M{px - 4:.1f},{y_lo:.1f}h8M{px - 4:.1f},{y_hi:.1f}h8",
                       stroke=ln.color, class_="c-err"))
    return out


def _merge_vlines(vlines: list[VLine]) -> list[tuple[float, str, str]]:
    """Lines at the same x become one, their labels joined: "knee 16 (a)", "knee 16 (b)" -> "knee 16 (a, b)"."""
    merged: dict[float, list[VLine]] = {}
    for v in vlines:
        merged.setdefault(round(v.x, 9), []).append(v)
    out = []
    for x, group in sorted(merged.items()):
        labels = [v.label for v in group]
        heads = {lbl.split(" (")[0] for lbl in labels}
        if len(group) > 1 and len(heads) == 1 and all(" (" in lbl for lbl in labels):
            label = f"{heads.pop()} (" + ", ".join(lbl.split(" (", 1)[1].rstrip(")") for lbl in labels) + ")"
            color = "#444"
        else:
            label, color = " / ".join(labels), group[0].color
        out.append((x, color, label))
    return out


def _svg(parts: list[Markup], w: int, h: int, label: str, legend: Markup) -> Markup:
    # no xmlns attribute: inline SVG in HTML does not need one, and the report holds no URL at all
    svg = Markup(f'<svg class="chart" viewBox="0 0 {w} {h}" role="img" aria-label="{escape(label)}">')
    return tag("figure", svg + Markup("").join(parts) + Markup("</svg>") + legend, class_="chart-fig")


def _segments(ln: Line) -> list[list[tuple[float, float]]]:
    segs: list[list[tuple[float, float]]] = [[]]
    for x, y in zip(ln.xs, ln.ys, strict=False):
        if y is None or x is None or not math.isfinite(y):
            if segs[-1]:
                segs.append([])
            continue
        segs[-1].append((float(x), float(y)))
    return [s for s in segs if s]


def decimate(seg: list[tuple[float, float]], sx: Callable[[float], float], buckets: int) -> list[tuple[float, float]]:
    """At most two points per bucket of a few pixels (its lowest and highest, in x order) plus the ends,
    when a segment has more than that: the drawing looks the same at the chart's size, spikes included,
    and a report of a hundred long charts stays a page a browser opens at once (its size with and
    without: docs/journal/measurements.md#report-size-and-chart-decimation)."""
    if len(seg) <= 2 * buckets:
        return seg
    x0, x1 = sx(seg[0][0]), sx(seg[-1][0])
    width = (x1 - x0) or 1.0
    groups: dict[int, list[tuple[float, float]]] = {}
    for pt in seg:
        groups.setdefault(min(buckets - 1, int((sx(pt[0]) - x0) / width * buckets)), []).append(pt)
    out: list[tuple[float, float]] = []
    for _, pts in sorted(groups.items()):
        keep = {min(range(len(pts)), key=lambda i: pts[i][1]), max(range(len(pts)), key=lambda i: pts[i][1])}
        out.extend(pts[i] for i in sorted(keep))
    if out[0] != seg[0]:
        out.insert(0, seg[0])
    if out[-1] != seg[-1]:
        out.append(seg[-1])
    return out


def _without_redundant_points(points: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The same drawing with fewer points: repeats dropped, and the middle of three points on one
    horizontal or vertical run when it lies between the other two (a step line's flat stretches, once
    rounded to whole units). A point that sticks out of its run (a spike within one pixel column) stays."""
    out: list[tuple[int, int]] = []
    for p in points:
        if out and p == out[-1]:
            continue
        if len(out) >= 2:
            (ax, ay), (bx, by) = out[-2], out[-1]
            vertical = ax == bx == p[0] and min(ay, p[1]) <= by <= max(ay, p[1])
            horizontal = ay == by == p[1] and min(ax, p[0]) <= bx <= max(ax, p[0])
            if vertical or horizontal:
                out[-1] = p  # b lies on the straight run from a to p
                continue
        out.append(p)
    return out


def _line(ln: Line, sx: Callable[[float], float], sy: Callable[[float], float], base: float, extra: float = 0.0,
          buckets: int = 300) -> list[Markup]:
    out = []
    for seg in _segments(ln):
        if not ln.step:  # a step line (a CDF) must keep each step's corner
            seg = decimate(seg, sx, buckets)
        raw: list[tuple[int, int]] = []
        for i, (x, y) in enumerate(seg):
            # whole viewBox units (about a pixel each): a decimal per coordinate was a third of the file
            if ln.step and i:
                raw.append((round(sx(x)), round(sy(seg[i - 1][1]))))
            raw.append((round(sx(x)), round(sy(y))))
        pts = [f"{x},{y}" for x, y in _without_redundant_points(raw)]
        if ln.area:
            poly = f"{sx(seg[0][0]):.0f},{base:.0f} " + " ".join(pts) + f" {sx(seg[-1][0]):.0f},{base:.0f}"
            out.append(tag("polygon", points=poly, fill=ln.color, class_="c-area"))
        out.append(tag("polyline", tag("title", ln.name), points=" ".join(pts), stroke=ln.color,
                       stroke_width=f"{ln.width + extra:g}", stroke_dasharray=ln.dash, class_="c-line"))
    return out


def legend_key(ln: Line) -> Markup:
    """A line's legend key: a short stretch of the line itself, in its colour and its own dash pattern
    (a CSS border draws every pattern alike), with its marker shape in the middle."""
    line = tag("line", x1=0, y1=6, x2=LEGEND_KEY_W, y2=6, stroke=ln.color, stroke_width=2.5,
               stroke_dasharray=ln.dash)
    mark = _shape(ln.shape, LEGEND_KEY_W / 2, 6, ln.color, r=3.5) if ln.shape else Markup("")
    return tag("svg", line + mark, class_="lg-key", width=LEGEND_KEY_W, height=12,
               viewBox=f"0 0 {LEGEND_KEY_W} 12", aria_hidden="true")


def _ref_key(color: str, vertical: bool) -> Markup:
    """The legend key of a reference line: a short dashed stroke, upright for a vline."""
    coords = {"x1": 7, "y1": 0, "x2": 7, "y2": 12} if vertical else {"x1": 0, "y1": 6, "x2": 14, "y2": 6}
    return tag("svg", tag("line", **coords, stroke=color, stroke_width=2, stroke_dasharray="3 2"),
               class_="lg-key", width=14, height=12, viewBox="0 0 14 12", aria_hidden="true")


def _legend(chart: Chart, lines: list[Line] | None = None) -> Markup:
    """The legend as HTML under the chart: it wraps on narrow screens and long names never overlap. It also
    names the reference lines (a surge's start, a knee, "equal cost"), whose labels stay off the plot."""
    lines = chart.lines if lines is None else lines
    items = [tag("span", legend_key(ln) + escape(ln.name), class_="lg-line") for ln in lines] \
        if len(lines) > 1 or any(ln.shape for ln in lines) else []
    items += [tag("span", _ref_key(color, True) + escape(label), class_="lg-ref")
              for _, color, label in _merge_vlines(chart.vlines)]
    items += [tag("span", _ref_key(hl.color, False) + escape(hl.label), class_="lg-ref") for hl in chart.hlines]
    items += [tag("span", tag("i", "", style=f"border-top-color: {color}") + escape(label), class_="lg-marker")
              for label, color in chart.marker_legend.items()]
    if not items:
        return Markup("")
    return tag("figcaption", Markup("").join(items), class_="legend")


@dataclass
class Bar:
    """One ratio bar: ``label`` (left), ``ratio`` (None: not comparable), ``good`` colours it."""

    label: str
    ratio: float | None
    good: bool | None  # None: no better/worse reading (about equal)
    tip: str = ""
    text: str = ""  # the value as written beside the bar (default: two decimals)


#: average advance of a character of the charts' 12 px label font (system-ui), in px: text width estimates
CHAR_W = 7.0


def text_width(text: str, size: float = 12.0) -> float:
    """A generous estimate of ``text``'s rendered width (SVG has no layout before a browser draws it)."""
    return len(text) * CHAR_W * size / 12.0


def ratio_bars(title: str, bars: Sequence[Bar], subtitle: str = "", width: int = 900,
               axis_label: str = "ratio (log scale)") -> Markup:
    """Horizontal bars of ratios on a log scale centred on 1× (0.25× .. 4×, clipped beyond).

    The label column is as wide as the longest label (never clipped); a value is written beside its
    bar's end, or beside the 1× axis when the bar runs so far left that it would cover the labels."""
    header, head_h = _header(Chart(title, "", "", subtitle=subtitle), width)
    row_h, top = 22, head_h + 14
    label_w = int(min(width * 0.55, max([120.0] + [text_width(b.label) + 22 for b in bars])))
    h = int(top + row_h * max(1, len(bars)) + 44)
    left, right = label_w, width - 70
    span = math.log2(4.0)

    def sx(r: float) -> float:
        v = max(-span, min(span, math.log2(max(r, 1e-9))))  # 0x and beyond 4x sit at the ends
        return left + (v + span) / (2 * span) * (right - left)

    parts: list[Markup] = [tag("title", title), *header]
    bottom = top + row_h * len(bars)
    parts.append(tag("text", axis_label, x=f"{sx(1.0):.1f}", y=bottom + 36, class_="c-label", text_anchor="middle"))
    for r in (0.25, 0.5, 1.0, 2.0, 4.0):
        x = sx(r)
        parts.append(tag("line", x1=f"{x:.1f}", x2=f"{x:.1f}", y1=top - 4, y2=bottom,
                         class_="c-axis" if r == 1.0 else "c-grid"))
        parts.append(tag("text", f"{r:g}×", x=f"{x:.1f}", y=bottom + 16, class_="c-tick", text_anchor="middle"))
    for i, bar in enumerate(bars):
        y = top + i * row_h
        parts.append(tag("text", bar.label, x=label_w - 10, y=y + row_h / 2 + 4, class_="c-legend",
                         text_anchor="end"))
        if bar.ratio is None or not math.isfinite(bar.ratio) or bar.ratio < 0:
            parts.append(tag("text", "n/a", x=f"{sx(1.0) + 6:.1f}", y=y + row_h / 2 + 4, class_="c-tick"))
            continue
        x0, x1 = sorted((sx(1.0), sx(bar.ratio)))
        color = "#8a94a6" if bar.good is None else ("#2e9d6a" if bar.good else "#d9434e")
        parts.append(tag("rect", tag("title", bar.tip or f"{bar.label}: {bar.ratio:.2f}×"), x=f"{x0:.1f}",
                         y=y + 4, width=f"{max(x1 - x0, 1.5):.1f}", height=row_h - 8, rx=3, fill=color))
        value = bar.text or f"{bar.ratio:.2f}×"
        tx, anchor = sx(bar.ratio) + (6 if bar.ratio >= 1 else -6), "start" if bar.ratio >= 1 else "end"
        if anchor == "end" and tx - text_width(value, 11) < label_w + 2:
            tx, anchor = sx(1.0) + 6, "start"  # no room left of the bar: write it right of the 1× axis
        parts.append(tag("text", value, x=f"{tx:.1f}", y=y + row_h / 2 + 4, class_="c-value",
                         text_anchor=anchor, fill=color))
    svg = Markup(f'<svg class="chart" viewBox="0 0 {width} {h}" role="img" aria-label="{escape(title)}">')
    return tag("figure", svg + Markup("").join(parts) + Markup("</svg>"), class_="chart-fig")


def share_bars(title: str, items: Sequence[tuple[str, float, str]], subtitle: str = "", width: int = 440) -> Markup:
    """Horizontal bars of shares (0 to 1, written as %): ``items`` are (label, share, colour). A share is a
    measured value; an item without one does not belong here (the caller leaves it out, never draws 0)."""
    header, head_h = _header(Chart(title, "", "", subtitle=subtitle), width)
    row_h, top = 24, head_h + 14
    label_w = int(min(width * 0.5, max([80.0] + [text_width(label) + 16 for label, _, _ in items])))
    left, right = label_w, width - 52
    bottom = top + row_h * max(1, len(items))
    h = int(bottom + 44)

    def sx(v: float) -> float:
        return left + max(0.0, min(1.0, v)) * (right - left)

    parts: list[Markup] = [tag("title", title), *header]
    for t in (0.0, 0.25, 0.5, 0.75, 1.0):
        parts.append(tag("line", x1=f"{sx(t):.1f}", x2=f"{sx(t):.1f}", y1=top - 4, y2=bottom,
                         class_="c-axis" if t == 0 else "c-grid"))
        parts.append(tag("text", f"{t * 100:g}", x=f"{sx(t):.1f}", y=bottom + 18, class_="c-tick",
                         text_anchor="middle"))
    parts.append(tag("text", "share of requests (%)", x=f"{(left + right) / 2:.1f}", y=bottom + 38, class_="c-label",
                     text_anchor="middle"))
    for i, (label, share, color) in enumerate(items):
        y = top + i * row_h
        parts.append(tag("text", label, x=label_w - 8, y=y + row_h / 2 + 4, class_="c-legend", text_anchor="end"))
        parts.append(tag("rect", tag("title", f"{label}: {share:.1%}"), x=f"{left:.1f}", y=y + 4,
                         width=f"{max(sx(share) - left, 1.5):.1f}", height=row_h - 8, rx=3, fill=color))
        parts.append(tag("text", f"{share:.0%}", x=f"{sx(share) + 5:.1f}", y=y + row_h / 2 + 4, class_="c-value",
                         fill=color))
    svg = Markup(f'<svg class="chart" viewBox="0 0 {width} {h}" role="img" aria-label="{escape(title)}">')
    return tag("figure", svg + Markup("").join(parts) + Markup("</svg>"), class_="chart-fig")
