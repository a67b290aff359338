"""Incidents drawn as HTML with an inline SVG timeline, and small line charts: markup built
here, on the server, so the dashboard's incidents page and `gpumesh sim run --html` draw the
same picture from the same model (gateway/ui/incidents.py) with no script and no library.

Every text from the fleet (node, replica and gateway ids, reasons, details) goes through
`html.escape`; colours are SVG presentation attributes and classes, never `style` attributes,
so the dashboard's Content-Security-Policy (style-src 'self') holds.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from html import escape
from typing import Final

from .incidents import Incident, Mark, Move

TimeLabel = Callable[[int], str]  # ns -> how the page writes that instant

WIDTH: Final = 960
LABEL_W: Final = 190  # the lanes' names
RIGHT_PAD: Final = 16
LANE_H: Final = 26
AXIS_H: Final = 24
STRIP_H: Final = 46  # the requests strip, when there is one

COLOURS: Final = {
    "healthy": "#1a7f37",
    "suspect": "#bf8700",
    "degraded": "#bf8700",
    "unhealthy": "#c62828",
    "offline": "#c62828",
    "removed": "#6e7781",
    "heartbeat": "#6e7781",
    "ejected": "#8250df",
    "failed": "#c62828",
    "placed": "#2454c5",
    "ready": "#1a7f37",
}
WORDS: Final = {
    "heartbeat": "last heartbeat",
    "suspect": "suspect",
    "degraded": "degraded",
    "unhealthy": "unhealthy",
    "offline": "offline",
    "healthy": "healthy again",
    "removed": "removed",
    "ejected": "ejected by a gateway",
    "failed": "failed",
    "placed": "placed again",
    "ready": "ready",
}


@dataclass(frozen=True, slots=True)
class Bin:
    """Requests in [at_ns, at_ns + width): what the incident cost clients (optional)."""

    at_ns: int
    ok: int
    failed: int
    retried: int = 0


def utc_label(ns: int) -> str:
    from datetime import UTC, datetime

    moment = datetime.fromtimestamp(ns / 1e9, tz=UTC)
    return moment.strftime("%H:%M:%S.") + f"{moment.microsecond // 1000:03d} UTC"


def incident_html(
    incident: Incident,
    *,
    label: TimeLabel = utc_label,
    requests: Sequence[Bin] = (),
    bin_ns: int = 1_000_000_000,
) -> str:
    """One incident: a heading with its figures, the timeline, and its events as a table."""
    moved = len(incident.moves)
    state = "resolved" if incident.resolved else "ongoing"
    figures = [
        f'<span class="badge h-{escape(incident.state)}">{escape(incident.state)}</span>',
        f"<span>{escape(incident.reason)}</span>",
        f'<span class="muted">{escape(label(incident.start_ns))}</span>',
        f"<span>{moved} replica{'s' if moved != 1 else ''} moved</span>",
    ]
    if incident.detection_s is not None:
        figures.append(
            f'<span title="from the last heartbeat to the first health change">'
            f"detected in {incident.detection_s:.2f} s</span>"
        )
    if incident.replacement_s is not None:
        figures.append(
            '<span title="from the first health change until every moved replica is ready">'
            f"replaced in {incident.replacement_s:.2f} s</span>"
        )
    if incident.ejections:
        figures.append(f"<span>{incident.ejections} gateway ejection(s)</span>")
    if requests:
        failed = sum(b.failed for b in requests)
        retried = sum(b.retried for b in requests)
        figures.append(
            f'<span class="{"error" if failed else "muted"}">{failed} request(s) failed, '
            f"{retried} retried</span>"
        )
    figures.append(f'<span class="state-{state}">{state}</span>')
    rows = "".join(
        f"<tr><td class=num>{m.position or ''}</td><td>{escape(label(m.at_ns))}</td>"
        f"<td class=num>{(m.at_ns - incident.start_ns) / 1e9:+.3f} s</td>"
        f"<td>{escape(WORDS[m.kind])}</td><td>{escape(_subject(m))}</td>"
        f"<td>{escape(m.detail)}</td></tr>"
        for m in incident.marks
    )
    return (
        f'<section class="incident" id="incident-{escape(incident.id)}" '
        f'data-id="{escape(incident.id)}" data-node="{escape(incident.node_id)}" '
        f'data-state="{state}">'
        f"<header><h2>{escape(incident.node_id)}</h2>{''.join(figures)}</header>"
        f"{timeline_svg(incident, label=label, requests=requests, bin_ns=bin_ns)}"
        "<details><summary>its events</summary>"
        '<table class="grid"><thead><tr><th class=num>Position</th><th>Time</th>'
        "<th class=num>From start</th><th>What</th><th>Of</th><th>Detail</th></tr></thead>"
        f"<tbody>{rows}</tbody></table></details></section>"
    )


def _subject(m: Mark) -> str:
    if m.replica_id:
        where = f" on {m.node_id}" if m.node_id else ""
        return f"{m.replica_id} epoch {m.epoch}{where}"
    return m.node_id


def timeline_svg(
    incident: Incident,
    *,
    label: TimeLabel = utc_label,
    requests: Sequence[Bin] = (),
    bin_ns: int = 1_000_000_000,
) -> str:
    """The node's lane (its health over time), a lane per moved replica (down, starting, ready
    again, the gateway's ejections), and the requests strip when `requests` is given; the axis
    in seconds from the first health change."""
    begin = incident.begin_ns
    end = _focus_end(incident)
    requests = [b for b in requests if begin - bin_ns <= b.at_ns <= end]
    if requests:
        begin = min(begin, requests[0].at_ns)
        end = max(end, requests[-1].at_ns + bin_ns)
    span = end - begin
    pad = span // 25 + 1
    lo, hi = begin - pad, end + pad
    x0, x1 = LABEL_W, WIDTH - RIGHT_PAD

    def x(ns: int) -> float:
        # A node back long after its replicas moved is drawn at the edge (its title says when).
        return round(x0 + (x1 - x0) * (min(ns, hi) - lo) / (hi - lo), 1)

    moves = list(incident.moves)
    lanes: list[tuple[str, list[Mark], Move | None]] = [
        (incident.node_id, [m for m in incident.marks if not m.replica_id], None)
    ]
    for move in moves:
        mine = [m for m in incident.marks if m.replica_id == move.replica_id]
        to = f" → {move.new_node}" if move.new_node else ""
        lanes.append((f"{move.replica_id} @{move.epoch}{to}", mine, move))
    stray = [
        m
        for m in incident.marks
        if m.kind == "ejected" and not any(mv.replica_id == m.replica_id for mv in moves)
    ]
    if stray:
        lanes.append(("gateway ejections", stray, None))
    height = AXIS_H + LANE_H * len(lanes) + (STRIP_H if requests else 0) + 6
    out = [
        f'<svg class="timeline" viewBox="0 0 {WIDTH} {height}" width="100%" '
        f'role="img" aria-label="timeline of the incident on {escape(incident.node_id)}" '
        'font-family="system-ui, sans-serif" font-size="11">'
    ]
    out += _axis(incident.start_ns, lo, hi, x, height, label)
    for index, (name, marks, lane_move) in enumerate(lanes):
        top = AXIS_H + index * LANE_H
        mid = top + LANE_H // 2
        out.append(
            f'<text x="8" y="{mid + 4}" fill="#1d2430">{escape(_clip(name, 28))}'
            f"<title>{escape(name)}</title></text>"
        )
        out.append(
            f'<line x1="{x0}" y1="{mid}" x2="{x1}" y2="{mid}" stroke="#e3e6eb" stroke-width="1"/>'
        )
        if lane_move is not None:
            out += _move_band(lane_move, mid, x, hi)
        elif index == 0:
            out += _node_band(incident, marks, mid, x, hi)
        out += [_marker(m, mid, x, incident.start_ns) for m in marks]
    if requests:
        out += _strip(requests, AXIS_H + LANE_H * len(lanes) + 4, x, bin_ns)
    out.append("</svg>")
    return "".join(out)


def _focus_end(incident: Incident) -> int:
    """Where the picture ends: the last mark, unless that is the node coming back long after
    its replicas moved (a node powered on 90 s later): then the moves fill the picture, and
    the node's return sits at its right edge."""
    end = incident.begin_ns + 1_000_000_000
    late = 0
    for m in incident.marks:
        if m.kind in ("healthy", "removed"):
            late = max(late, m.at_ns)
        else:
            end = max(end, m.at_ns)
    span = end - incident.begin_ns
    if late and late - end <= max(span, 5_000_000_000):
        end = late
    return end


def _axis(
    origin: int, lo: int, hi: int, x: Callable[[int], float], height: int, label: TimeLabel
) -> list[str]:
    step = _nice_step((hi - lo) / 1e9 / 8)
    first = math.ceil((lo - origin) / 1e9 / step)
    last = math.floor((hi - origin) / 1e9 / step)
    out = []
    for k in range(first, last + 1):
        seconds = k * step
        at = origin + round(seconds * 1e9)
        px = x(at)
        text = f"{seconds:+g} s" if seconds else "0"
        out.append(
            f'<line x1="{px}" y1="{AXIS_H - 4}" x2="{px}" y2="{height - 4}" '
            f'stroke="{"#9aa4b2" if seconds == 0 else "#eef1f5"}" stroke-width="1"/>'
            f'<text x="{px}" y="{AXIS_H - 8}" text-anchor="middle" fill="#667085">{text}'
            f"<title>{escape(label(at))}</title></text>"
        )
    return out


def _nice_step(raw: float) -> float:
    """1, 2 or 5 times a power of ten, at least `raw` (seconds between ticks)."""
    if raw <= 0:
        return 1.0
    power = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 5, 10):
        if factor * power >= raw:
            return float(factor * power)
    return float(10 * power)


def _node_band(
    incident: Incident, marks: list[Mark], mid: int, x: Callable[[int], float], hi: int
) -> list[str]:
    """The node's health as coloured segments, from its first health change on."""
    out = []
    changes = [m for m in marks if m.kind in COLOURS and m.kind not in ("heartbeat", "removed")]
    for here, after in zip(changes, [*changes[1:], None], strict=True):
        until = after.at_ns if after is not None else hi
        colour = COLOURS[here.kind]
        out.append(
            f'<line x1="{x(here.at_ns)}" y1="{mid}" x2="{x(until)}" y2="{mid}" '
            f'stroke="{colour}" stroke-width="6" stroke-opacity="0.35"/>'
        )
    if incident.last_heartbeat_ns:
        out.append(
            f'<line x1="{x(incident.last_heartbeat_ns)}" y1="{mid}" x2="{x(incident.start_ns)}" '
            f'y2="{mid}" stroke="#6e7781" stroke-width="2" stroke-dasharray="3 3"/>'
        )
    return out


def _move_band(move: Move, mid: int, x: Callable[[int], float], hi: int) -> list[str]:
    """Down from the failure until placed, starting until ready, serving after."""
    placed = move.placed_ns or hi
    out = [
        f'<line x1="{x(move.failed_ns)}" y1="{mid}" x2="{x(placed)}" y2="{mid}" '
        f'stroke="{COLOURS["failed"]}" stroke-width="6" stroke-opacity="0.35"/>'
    ]
    if move.placed_ns:
        ready = move.ready_ns or hi
        out.append(
            f'<line x1="{x(move.placed_ns)}" y1="{mid}" x2="{x(ready)}" y2="{mid}" '
            f'stroke="{COLOURS["suspect"]}" stroke-width="6" stroke-opacity="0.35"/>'
        )
    if move.ready_ns:
        out.append(
            f'<line x1="{x(move.ready_ns)}" y1="{mid}" x2="{x(hi)}" y2="{mid}" '
            f'stroke="{COLOURS["ready"]}" stroke-width="6" stroke-opacity="0.35"/>'
        )
    return out


def _marker(m: Mark, mid: int, x: Callable[[int], float], origin: int) -> str:
    px = x(m.at_ns)
    colour = COLOURS[m.kind]
    title = escape(
        f"{WORDS[m.kind]} {(m.at_ns - origin) / 1e9:+.3f} s"
        + (f" · {_subject(m)}" if m.replica_id else "")
        + (f" · {m.detail}" if m.detail else "")
        + (f" · position {m.position}" if m.position else "")
    )
    attrs = f'class="mark m-{m.kind}" data-kind="{m.kind}" fill="{colour}"'
    if m.kind == "ejected":
        shape = f'<path {attrs} d="M{px - 5},{mid - 9} L{px + 5},{mid - 9} L{px},{mid - 1} Z">'
    elif m.kind in ("failed", "offline", "unhealthy"):
        shape = f'<rect {attrs} x="{px - 5}" y="{mid - 5}" width="10" height="10">'
    elif m.kind == "heartbeat":
        shape = f'<circle {attrs} cx="{px}" cy="{mid}" r="3.5">'
    else:
        diamond = f"M{px},{mid - 6} L{px + 6},{mid} L{px},{mid + 6} L{px - 6},{mid} Z"
        shape = f'<path {attrs} d="{diamond}">'
    closing = shape.split(" ", 1)[0][1:]
    return f"{shape}<title>{title}</title></{closing}>"


def _strip(requests: Sequence[Bin], top: int, x: Callable[[int], float], bin_ns: int) -> list[str]:
    """Requests per bin, failed in red and retried in amber over those answered."""
    peak = max((b.ok + b.failed for b in requests), default=0) or 1
    base = top + STRIP_H - 10
    scale = (STRIP_H - 14) / peak
    out = [
        f'<text x="8" y="{top + STRIP_H // 2}" fill="#1d2430">requests'
        f"<title>per {bin_ns / 1e9:g} s: answered (grey), failed (red), retried (amber); "
        f"the highest bar is {peak}</title></text>",
        f'<line x1="{LABEL_W}" y1="{base}" x2="{WIDTH - RIGHT_PAD}" y2="{base}" '
        'stroke="#c9ced6" stroke-width="1"/>',
    ]
    for b in requests:
        left, right = x(b.at_ns), x(b.at_ns + bin_ns)
        w = max(1.0, round(right - left - 0.5, 1))
        ok_h = round(b.ok * scale, 1)
        bad_h = round(b.failed * scale, 1)
        tip = f"<title>{b.ok} answered, {b.failed} failed, {b.retried} retried</title>"
        if ok_h:
            out.append(
                f'<rect x="{left}" y="{base - ok_h}" width="{w}" height="{ok_h}" '
                f'fill="#c9ced6">{tip}</rect>'
            )
        if bad_h:
            out.append(
                f'<rect class="failed-requests" x="{left}" y="{base - ok_h - bad_h}" width="{w}" '
                f'height="{bad_h}" fill="#c62828">{tip}</rect>'
            )
        if b.retried:
            out.append(
                f'<rect x="{left}" y="{base + 2}" width="{w}" height="4" fill="#bf8700">'
                f"{tip}</rect>"
            )
    return out


def _clip(text: str, most: int) -> str:
    return text if len(text) <= most else text[: most - 1] + "…"


def line_chart(
    series: Sequence[tuple[str, str, Sequence[tuple[float, float | None]]]],
    *,
    x_range: tuple[float, float],
    x_label: Callable[[float], str],
    unit: str,
    title: str,
    width: int = 460,
    height: int = 150,
    marks: Sequence[tuple[float, float, str]] = (),
) -> str:
    """A small line chart as inline SVG: `series` of (name, colour, [(x, y or None)]), a gap
    where y is None. The y axis starts at 0 and ends at a round number over the highest y.
    `marks`: (from x, to x, what) shaded behind the lines (a fault while it lasted)."""
    left, right, top, bottom = 46, 10, 20, 22
    lo, hi = x_range
    hi = hi if hi > lo else lo + 1
    peak = max((y for _, _, points in series for _, y in points if y is not None), default=0.0)
    y_top = _round_up(peak)

    def px(v: float) -> float:
        return round(left + (width - left - right) * (v - lo) / (hi - lo), 1)

    def py(v: float) -> float:
        return round(height - bottom - (height - top - bottom) * v / y_top, 1)

    out = [
        f'<svg class="chart" viewBox="0 0 {width} {height}" width="100%" role="img" '
        f'aria-label="{escape(title)}" '
        'font-family="system-ui, sans-serif" font-size="10">',
        f'<text x="{left}" y="12" font-size="11" font-weight="600" fill="#1d2430">'
        f"{escape(title)}</text>",
    ]
    for start, until, what in marks:
        a, b = px(max(lo, start)), px(min(hi, max(start, until)))
        out.append(
            f'<rect class="fault" x="{a}" y="{top}" width="{max(1.0, round(b - a, 1))}" '
            f'height="{height - top - bottom}" fill="#c62828" fill-opacity="0.08">'
            f"<title>{escape(what)}</title></rect>"
        )
    for k in range(3):
        v = y_top * k / 2
        out.append(
            f'<line x1="{left}" y1="{py(v)}" x2="{width - right}" y2="{py(v)}" stroke="#eef1f5"/>'
            f'<text x="{left - 4}" y="{py(v) + 3}" text-anchor="end" fill="#667085">'
            f"{_short(v)}{escape(unit)}</text>"
        )
    for k in range(5):
        v = lo + (hi - lo) * k / 4
        anchor = "start" if k == 0 else "end" if k == 4 else "middle"
        out.append(
            f'<text x="{px(v)}" y="{height - 6}" text-anchor="{anchor}" fill="#667085">'
            f"{escape(x_label(v))}</text>"
        )
    legend_x = width - right
    for name, colour, points in reversed(series):
        path: list[str] = []
        pen_up = True
        for vx, vy in points:
            if vy is None:
                pen_up = True
                continue
            path.append(f"{'M' if pen_up else 'L'}{px(vx)},{py(vy)}")
            pen_up = False
        if path:
            out.append(
                f'<path class="series" data-series="{escape(name)}" d="{" ".join(path)}" '
                f'fill="none" stroke="{colour}" stroke-width="1.5" stroke-linejoin="round">'
                f"<title>{escape(name)}</title></path>"
            )
        out.append(
            f'<text x="{legend_x}" y="12" text-anchor="end" fill="{colour}">{escape(name)}</text>'
        )
        legend_x -= 8 + 6 * len(name)
    out.append("</svg>")
    return "".join(out)


def _round_up(v: float) -> float:
    if v <= 0:
        return 1.0
    step = _nice_step(v / 2)
    return step * math.ceil(v / step) if v % step else v


def _short(v: float) -> str:
    if v >= 1000:
        return f"{v / 1000:g}k"
    return f"{v:.3g}"


__all__ = ["Bin", "incident_html", "line_chart", "timeline_svg", "utc_label"]
