"""`gpumesh sim run SCENARIO --seed N --plot FILE.png`: a run as one picture, and the drawing
pieces bench/failover.py's `--plot` shares.

The picture: per cluster, requests answered and failed per virtual second with the faults
shaded (the per-second counts sim/report_html.py's `record` keeps, from the same run), and
below, the detection and replacement times per failure class, every sample a dot over its box
(the samples the run's invariant checker timed, of which the summary prints p50 and p99).

matplotlib is an optional extra (`pip install 'gpumesh[plot]'`) and draws with its Agg backend:
no display needed. The PNG's bytes are not promised to be the same for a seed; the figures in
it are the run's.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

if TYPE_CHECKING:
    from .report_html import Traffic
    from .run import RunResult
    from .scenario import Scenario

INSTALL_HINT: Final = "--plot needs matplotlib: pip install 'gpumesh[plot]'"
ANSWERED: Final = "#1a7f37"
FAILED: Final = "#c62828"
FAULT: Final = "#c62828"
MAX_CLUSTER_ROWS: Final = 6  # more clusters: the rest summed in one row


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message is the one line to print."""


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend, or PlotUnavailable with the install hint."""
    try:
        import matplotlib

        # Its font cache's first build logs at INFO: not for the run's stdout (--json).
        logging.getLogger("matplotlib").setLevel(logging.WARNING)
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable(INSTALL_HINT) from None
    return plt


def distributions(
    ax: Any,
    groups: Mapping[str, Sequence[float]],
    *,
    title: str,
    unit: str = "s",
    colour: str = "#2454c5",
    target: float | None = None,
    never: Mapping[str, int] | None = None,
) -> None:
    """One box per group with every sample a dot over it (a strip plot: with 3 or 5 runs a box
    alone hides how few there are); groups without samples are named, not drawn. `never`:
    per group, the runs in which the time never came (named under the group)."""
    names = list(groups)
    ax.set_title(title, fontsize=10, loc="left")
    if not names:
        ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
        return
    positions = list(range(1, len(names) + 1))
    drawn = [(p, list(groups[n])) for p, n in zip(positions, names, strict=True) if groups[n]]
    if drawn:
        ax.boxplot(
            [values for _, values in drawn],
            positions=[p for p, _ in drawn],
            widths=0.5,
            showfliers=False,
            medianprops={"color": "#1d2430"},
            boxprops={"color": "#667085"},
            whiskerprops={"color": "#667085"},
            capprops={"color": "#667085"},
        )
        for p, values in drawn:
            # Spread the dots sideways by rank, not by chance: the same data, the same picture.
            k = len(values)
            xs = [p + (0.0 if k == 1 else -0.15 + 0.3 * i / (k - 1)) for i in range(k)]
            ax.scatter(xs, sorted(values), s=14, color=colour, alpha=0.75, zorder=3)
            median = statistics.median(values)
            shown = f"{median:.2f} s" if unit == "s" else f"{median:,.0f}"
            ax.annotate(shown, (p + 0.27, median), fontsize=8, va="center", color="#1d2430")
    for p, name in zip(positions, names, strict=True):
        if not groups[name]:
            ax.text(
                p,
                0.5,
                "none",
                ha="center",
                va="center",
                color="#667085",
                transform=ax.get_xaxis_transform(),
            )
    if target is not None:
        ax.axhline(target, color=FAULT, linestyle="--", linewidth=1)
        ax.text(0.5, target, f" target {target:g} {unit}", color=FAULT, fontsize=8, va="bottom")
    never = never or {}
    labels = [
        f"{n}\n(n={len(groups[n])}" + (f", {never[n]} never)" if never.get(n) else ")")
        for n in names
    ]
    ax.set_xticks(positions, labels, fontsize=8, rotation=20 if len(names) > 3 else 0)
    ax.set_xlim(0.4, len(names) + 0.6)
    ax.set_ylabel(unit)
    if unit != "s":  # counts: whole numbers on the axis
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    top = max([v for _, values in drawn for v in values] + [target or 0.0, 0.0])
    ax.set_ylim(0, top * 1.15 if top > 0 else 1.0)
    ax.grid(axis="y", alpha=0.3)


def save(fig: Any, path: Path) -> None:
    """The PNG, and the figure closed (pyplot keeps every open one)."""
    try:
        fig.savefig(path, dpi=110, format="png")
    finally:
        pyplot().close(fig)


def _fault_spans(scenario: Scenario) -> list[tuple[float, float, str]]:
    out = []
    for f in scenario.faults:
        # A fault with no duration lasts until the faults stop (as sim/report_html.py draws it).
        end = f.at_s + f.duration_s if f.duration_s is not None else scenario.duration_s
        out.append((f.at_s, max(end, f.at_s + 0.5), f"{f.kind} ({f.nodes})"))
    return out


def _rows(traffic: Traffic, clusters: list[str], until: int) -> list[tuple[str, list[str]]]:
    """Cluster rows, busiest first past MAX_CLUSTER_ROWS: the rest summed in one."""
    if len(clusters) <= MAX_CLUSTER_ROWS:
        return [(c, [c]) for c in clusters]

    def sent(c: str) -> float:
        return sum(v for _, v in traffic.series(c, "sent", until) if v)

    busiest = sorted(clusters, key=lambda c: (-sent(c), c))
    keep, rest = busiest[: MAX_CLUSTER_ROWS - 1], busiest[MAX_CLUSTER_ROWS - 1 :]
    return [(c, [c]) for c in sorted(keep)] + [(f"{len(rest)} other clusters", rest)]


def _summed(traffic: Traffic, clusters: list[str], what: str, until: int) -> list[float]:
    total = [0.0] * (until + 1)
    for c in clusters:
        for t, v in traffic.series(c, what, until):
            total[int(t)] += v or 0.0
    return total


def plot_run(
    result: RunResult,
    scenario: Scenario,
    traffic: Traffic,
    samples: Mapping[str, Mapping[str, Sequence[float]]],
    path: Path,
    *,
    commit: str = "",
) -> None:
    """Write the run's PNG. `samples`: {"detection": {kind: [s, ...]}, "replacement": ...},
    the checker's timings of this run (RunResult keeps their p50/p99)."""
    plt = pyplot()
    until = int(scenario.duration_s + scenario.settle_s)
    clusters = sorted(traffic.seconds.keys() | set(result.availability))
    rows = _rows(traffic, clusters, until) or [("no clusters", [])]
    fig = plt.figure(figsize=(11, 2.0 * len(rows) + 3.6), layout="constrained")
    grid = fig.add_gridspec(len(rows) + 1, 2, height_ratios=[1.0] * len(rows) + [1.6])
    title = f"gpumesh sim: {result.scenario}, seed {result.seed}"
    fig.suptitle(
        f"{title}  ({result.duration_s:g} s simulated, {result.events} events, "
        f"{result.requests_failed} requests failed"
        + (f", {len(result.violations)} invariant violations" if result.violations else "")
        + (f", commit {commit}" if commit else "")
        + ")",
        fontsize=11,
    )
    spans = _fault_spans(scenario)
    seconds = list(range(until + 1))
    first = None
    for row, (label, members) in enumerate(rows):
        ax = fig.add_subplot(grid[row, :], sharex=first)
        first = first or ax
        ok = _summed(traffic, members, "ok", until)
        failed = _summed(traffic, members, "failed", until)
        ax.fill_between(seconds, ok, step="post", color=ANSWERED, alpha=0.25, linewidth=0)
        ax.step(seconds, ok, where="post", color=ANSWERED, linewidth=1, label="answered / s")
        ax.bar(seconds, failed, width=1.0, align="edge", color=FAILED, label="failed / s")
        for i, (start, end, what) in enumerate(spans):
            ax.axvspan(start, end, color=FAULT, alpha=0.08, label="fault" if i == 0 else None)
            if row == 0:  # staggered: faults that start close together stay readable
                ax.text(
                    start,
                    0.98 - 0.1 * (i % 5),
                    f" {what}",
                    transform=ax.get_xaxis_transform(),
                    fontsize=7,
                    color=FAULT,
                    va="top",
                    clip_on=True,
                )
        availability = [
            result.availability[m]["availability"] for m in members if m in result.availability
        ]
        shown = (
            f"availability {availability[0] * 100:.3f}%"
            if len(availability) == 1
            else f"{len(members)} clusters"
        )
        ax.set_title(f"{label}: requests per second ({shown})", fontsize=10, loc="left")
        ax.set_xlim(0, until)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
        if row == 0:
            ax.legend(
                loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=8, ncols=3, frameon=False
            )
        if row == len(rows) - 1:
            ax.set_xlabel("virtual time (s)")
    for col, what in enumerate(("detection", "replacement")):
        ax = fig.add_subplot(grid[len(rows), col])
        groups = dict(sorted(samples.get(what, {}).items()))
        summary = result.detection if what == "detection" else result.replacement
        for kind in summary:
            groups.setdefault(kind, [])
        distributions(
            ax,
            groups,
            title=f"{what}: fault to {'offline verdict' if what == 'detection' else 'ready again'}"
            ", per failure class",
            colour="#8250df" if what == "detection" else "#2454c5",
        )
    save(fig, path)


__all__ = ["INSTALL_HINT", "PlotUnavailable", "distributions", "plot_run", "pyplot", "save"]
