"""`gpumesh sim run SCENARIO --seed N --html report.html`: one self-contained HTML file of a run.

The file has the run's summary, the fleet's health over virtual time with the faults shaded,
requests and failures per second per cluster, each incident drawn with the dashboard's own
code (gateway/ui/incidents.py finds them in the run's event log, gateway/ui/timeline.py draws
them, with the requests of the clusters they moved), the invariant violations and the text
timeline. Everything is inline (the dashboard's style sheet, SVG, no script): the file opens
anywhere, with no network.

Per-second request counts: the World keeps a RequestLog per cluster, totals only. Before the
run, `record` puts a dict of its own in `world.requests` that notes the loop's (virtual) time
of each change to a log's counters. It only notes: no timer, no task, no draw from any random
stream, so the run is the one `gpumesh sim run` makes without `--html`, event for event (the
digest is the same; tests/sim/test_report_html.py checks it).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Callable, Iterable
from html import escape
from importlib import resources
from typing import Any, Final

from events import Envelope, NodeHealthChanged, NodeRegistered, NodeRemoved
from gateway.ui.incidents import Incident, incidents
from gateway.ui.timeline import COLOURS, Bin, incident_html, line_chart

from .clock import SIM_EPOCH_NS
from .loop import run_simulation
from .run import RunResult, quiet_logger, render, summarize
from .scenario import Scenario
from .world import RequestLog, World

S: Final = 1_000_000_000
_FIELDS: Final = ("sent", "ok", "failed")


class Traffic:
    """Per cluster, per virtual second: requests sent, answered and failed."""

    def __init__(self) -> None:
        self.seconds: dict[str, dict[int, list[int]]] = defaultdict(dict)

    def note(self, cluster: str, what: str, count: int) -> None:
        second = int(asyncio.get_running_loop().time())
        row = self.seconds[cluster].setdefault(second, [0, 0, 0])
        row[_FIELDS.index(what)] += count

    def series(self, cluster: str, what: str, until: int) -> list[tuple[float, float | None]]:
        """(second, count) for every second of the run, zeros included."""
        rows = self.seconds.get(cluster, {})
        index = _FIELDS.index(what)
        return [(float(t), float(rows[t][index]) if t in rows else 0.0) for t in range(until + 1)]

    def bins(self, clusters: Iterable[str], lo_ns: int, hi_ns: int) -> list[Bin]:
        """Answered and failed per second of [lo_ns, hi_ns], summed over `clusters`."""
        first, last = (lo_ns - SIM_EPOCH_NS) // S, (hi_ns - SIM_EPOCH_NS) // S
        out = []
        for second in range(first, last + 1):
            rows = [self.seconds.get(c, {}).get(second) for c in clusters]
            ok = sum(r[1] for r in rows if r)
            failed = sum(r[2] for r in rows if r)
            out.append(Bin(SIM_EPOCH_NS + second * S, ok, failed))
        return out


class _Failures(dict[str, int]):
    def __init__(self, base: dict[str, int], noted: Callable[[int], None]) -> None:
        super().__init__(base)
        self._noted = noted

    def __setitem__(self, kind: str, count: int) -> None:
        self._noted(count - self.get(kind, 0))
        super().__setitem__(kind, count)


class _TimedLog(RequestLog):
    """A RequestLog whose counters, as the World changes them, are noted in `Traffic`."""

    _cluster: str
    _traffic: Traffic | None

    def __init__(self, cluster: str, traffic: Traffic, base: RequestLog) -> None:
        object.__setattr__(self, "_traffic", None)  # the fields set here are not traffic
        failures = _Failures(base.failed, lambda n: traffic.note(cluster, "failed", n))
        super().__init__(sent=base.sent, ok=base.ok, failed=failures)
        object.__setattr__(self, "_cluster", cluster)
        object.__setattr__(self, "_traffic", traffic)

    def __setattr__(self, name: str, value: Any) -> None:
        if self._traffic is not None and name in ("sent", "ok"):
            self._traffic.note(self._cluster, name, value - getattr(self, name))
        super().__setattr__(name, value)


class _Recorded(dict[str, RequestLog]):
    """`world.requests`: every log put in it is a _TimedLog."""

    def __init__(self, traffic: Traffic) -> None:
        super().__init__()
        self._traffic = traffic

    def __setitem__(self, cluster: str, log: RequestLog) -> None:
        if not isinstance(log, _TimedLog):
            log = _TimedLog(cluster, self._traffic, log)
        super().__setitem__(cluster, log)

    def setdefault(self, cluster: str, default: RequestLog | None = None) -> RequestLog:
        if cluster not in self:
            self[cluster] = default if default is not None else RequestLog()
        return self[cluster]


def record(world: World) -> Traffic:
    """Note the virtual time of each request the world sends, answers or fails, from now on."""
    traffic = Traffic()
    recorded = _Recorded(traffic)
    for cluster, log in world.requests.items():
        recorded[cluster] = log
    world.requests = recorded
    return traffic


def run_recorded(scenario: Scenario, seed: int) -> tuple[RunResult, World, Traffic]:
    """`sim.run.run_scenario`, with the requests noted per second."""
    world = World(scenario, seed, log=quiet_logger())
    traffic = record(world)
    run_simulation(world.run())
    return summarize(world), world, traffic


def virtual(ns: int) -> str:
    return f"t = {(ns - SIM_EPOCH_NS) / S:.3f} s"


def report(result: RunResult, world: World, traffic: Traffic, *, commit: str = "") -> str:
    """The whole file."""
    scenario = world.scenario
    log = world.store.read_all_now()
    found = incidents(log)
    until = int(scenario.duration_s + scenario.settle_s)
    faults = []
    for f in scenario.faults:
        # A fault with no duration lasts until the faults stop (sim/timeline.py).
        end = f.at_s + f.duration_s if f.duration_s is not None else scenario.duration_s
        lasting = f" for {f.duration_s:g} s" if f.duration_s is not None else ""
        faults.append((f.at_s, end, f"{f.kind} ({f.nodes} nodes) at t = {f.at_s:g} s{lasting}"))
    title = f"{scenario.name}, seed {result.seed}"
    parts = [
        f"<header class=report><h1>gpumesh sim: {escape(title)}</h1>"
        f"<p class=muted>{escape(scenario.description)}</p>"
        f"<p class=muted>{result.duration_s:g} s simulated, {result.events} events, digest "
        f"{escape(result.digest[:16])}{', commit ' + escape(commit) if commit else ''}. "
        f"Replay: <code>gpumesh sim run {escape(scenario.name)} --seed {result.seed}</code></p>"
        "</header>",
        _summary(result, len(found)),
        "<h2>The fleet</h2>",
        _fleet(log, world, until, faults, found),
        "<h2>Requests</h2><div class=charts>",
    ]
    for cluster in sorted(traffic.seconds.keys() | set(result.availability)):
        parts.append(
            line_chart(
                [
                    ("sent", "#2454c5", traffic.series(cluster, "sent", until)),
                    ("answered", "#1a7f37", traffic.series(cluster, "ok", until)),
                ],
                x_range=(0, until),
                x_label=lambda v: f"{v:g} s",
                unit="",
                title=f"{cluster}: requests / s",
                marks=faults,
            )
        )
        parts.append(
            line_chart(
                [("failed", "#c62828", traffic.series(cluster, "failed", until))],
                x_range=(0, until),
                x_label=lambda v: f"{v:g} s",
                unit="",
                title=f"{cluster}: failed / s",
                marks=faults,
            )
        )
    parts.append("</div>")
    parts.append(f"<h2>Incidents ({len(found)})</h2>")
    if not found:
        parts.append("<p class=muted>No node loss or health change moved a replica.</p>")
    for incident in found:
        clusters = {m.cluster for m in incident.moves}
        bins = traffic.bins(clusters, incident.begin_ns, incident.end_ns)
        parts.append(incident_html(incident, label=virtual, requests=bins))
    parts.append("<h2>Timeline</h2>")
    lines = "\n".join(escape(line) for line in result.timeline)
    parts.append(f"<pre class=timeline-text>{lines}</pre>")
    parts.append(
        "<details><summary>The summary as <code>gpumesh sim run</code> prints it</summary>"
        f"<pre>{escape(render(result, commit=commit))}</pre></details>"
    )
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{escape(title)} · gpumesh sim</title>"
        f"<style>{_style()}</style></head><body><main>{''.join(parts)}</main></body></html>\n"
    )


def _summary(result: RunResult, incident_count: int) -> str:
    rows = []
    for name, a in result.availability.items():
        failed = ", ".join(f"{k} {v}" for k, v in a["failed"].items()) or "none"
        rows.append(
            f"<tr><td>{escape(name)}</td><td class=num>{a['availability'] * 100:.3f}%</td>"
            f"<td class=num>{a['ok']}</td><td class=num>{a['sent']}</td>"
            f"<td>{escape(failed)}</td></tr>"
        )
    timings = []
    for what, table in (("detection", result.detection), ("replacement", result.replacement)):
        for kind, t in table.items():
            timings.append(
                f"<tr><td>{what}</td><td>{escape(kind)}</td><td class=num>{t['p50']:.3f} s</td>"
                f"<td class=num>{t['p99']:.3f} s</td><td class=num>{t['count']:g}</td></tr>"
            )
    violations = (
        "<ul class=error>"
        + "".join(
            f"<li>t = {v['at']:.3f} s {escape(v['invariant'])}: {escape(v['detail'])}</li>"
            for v in result.violations
        )
        + "</ul>"
        if result.violations
        else "<p class=ok>Invariant violations: none.</p>"
    )
    return (
        "<section class=summary-block><table class=grid><thead><tr><th>Cluster</th>"
        "<th class=num>Availability</th><th class=num>Answered</th><th class=num>Sent</th>"
        f"<th>Failed</th></tr></thead><tbody>{''.join(rows)}</tbody></table>"
        + (
            "<table class=grid><thead><tr><th></th><th>Failure</th><th class=num>p50</th>"
            f"<th class=num>p99</th><th class=num>n</th></tr></thead><tbody>{''.join(timings)}"
            "</tbody></table>"
            if timings
            else ""
        )
        + f"<p>Requests failed: {result.requests_failed}. Incidents: {incident_count}.</p>"
        + f"{violations}</section>"
    )


def _fleet(
    log: list[Envelope],
    world: World,
    until: int,
    faults: list[tuple[float, float, str]],
    found: list[Incident],
) -> str:
    """Each node's health over the run, a lane each, the faults shaded behind; an incident's
    start is a link to its drawing below."""
    health: dict[str, list[tuple[float, str, str]]] = defaultdict(list)
    for e in log:
        p = e.payload
        t = (e.recorded_at - SIM_EPOCH_NS) / S
        if isinstance(p, NodeRegistered):
            health[p.node_id].append((t, "healthy", "registered"))
        elif isinstance(p, NodeHealthChanged):
            health[p.node_id].append((t, p.state, f"{p.reason} {p.detail}".strip()))
        elif isinstance(p, NodeRemoved):
            health[p.node_id].append((t, "removed", p.reason))
    nodes = sorted(health, key=lambda n: (len(n), n))
    left, right, lane, top = 90, 12, 12, 18
    width = 960
    height = top + lane * len(nodes) + 20

    def x(t: float) -> float:
        return round(left + (width - left - right) * min(max(t, 0.0), until) / max(until, 1), 1)

    out = [
        f'<svg class="fleet" viewBox="0 0 {width} {height}" width="100%" role="img" '
        'aria-label="each node\'s health over the run" font-family="system-ui, sans-serif" '
        'font-size="10">'
    ]
    for start, end, what in faults:
        out.append(
            f'<rect x="{x(start)}" y="{top - 4}" width="{max(1.0, round(x(end) - x(start), 1))}" '
            f'height="{lane * len(nodes) + 4}" fill="#c62828" fill-opacity="0.07">'
            f"<title>{escape(what)}</title></rect>"
        )
    for k in range(6):
        t = until * k / 5
        out.append(
            f'<text x="{x(t)}" y="{height - 4}" text-anchor="middle" fill="#667085">{t:g} s</text>'
        )
    for row, node in enumerate(nodes):
        y = top + row * lane
        out.append(f'<text x="4" y="{y + 8}" fill="#1d2430">{escape(node)}</text>')
        changes = health[node]
        for (t, state, why), after in zip(changes, [*changes[1:], None], strict=True):
            end = after[0] if after is not None else float(until)
            colour = COLOURS.get(state, "#6e7781")
            out.append(
                f'<rect class="h-{escape(state)}" x="{x(t)}" y="{y}" '
                f'width="{max(0.5, round(x(end) - x(t), 1))}" height="{lane - 3}" '
                f'fill="{colour}" fill-opacity="{0.25 if state == "healthy" else 0.75}">'
                f"<title>{escape(node)} {escape(state)} from t = {t:.3f} s: "
                f"{escape(why)}</title></rect>"
            )
    for incident in found:
        if incident.node_id not in nodes:
            continue
        y = top + nodes.index(incident.node_id) * lane
        px = x((incident.start_ns - SIM_EPOCH_NS) / S)
        out.append(
            f'<a href="#incident-{escape(incident.id)}"><path d="M{px - 4},{y - 3} '
            f'L{px + 4},{y - 3} L{px},{y + 4} Z" fill="#1d2430">'
            f"<title>incident: {escape(incident.node_id)} {escape(incident.state)}, "
            f"{len(incident.moves)} replica(s) moved</title></path></a>"
        )
    out.append("</svg>")
    legend = (
        "<p class='legend muted'><span class='key k-ready'>healthy</span>"
        "<span class='key k-suspect'>suspect, degraded</span>"
        "<span class='key k-offline'>offline, unhealthy</span>"
        "<span class=muted>shaded: a fault; ▼ an incident (drawn below)</span></p>"
    )
    return legend + "".join(out)


def _style() -> str:
    sheet = (resources.files("gateway.ui") / "static" / "dashboard.css").read_text("utf-8")
    return sheet + (
        "header.report h1 { font-size: 20px; margin: 0 0 4px; }"
        "main { max-width: 1240px; margin: 0 auto; } h2 { font-size: 16px; margin: 22px 0 8px; }"
        ".summary-block { display: flex; flex-direction: column; align-items: flex-start;"
        " gap: 8px; }"
        ".summary-block table.grid { width: auto; }"
        ".charts { background: var(--panel); border: 1px solid var(--line); border-radius: 6px;"
        " grid-template-columns: repeat(2, minmax(300px, 1fr)); }"
        "svg.chart { max-width: 560px; } svg.fleet { background: var(--panel);"
        " border: 1px solid var(--line); border-radius: 6px; }"
        ".ok { color: var(--ok); } pre.timeline-text { background: var(--panel); padding: 8px;"
        " border: 1px solid var(--line); border-radius: 6px; overflow: auto; }"
    )


__all__ = ["Traffic", "record", "report", "run_recorded"]
