"""Draw docs/performance.md's heartbeat, cold-start and gateway tables as PNGs, from the figures
copied by hand into docs/img/tables.json (nothing is measured here; the failover figures have
their own `bench/failover.py --plot`). Needs matplotlib: pip install 'gpumesh[plot]'.

    .venv/bin/python docs/img/tables.py [--out DIR]     # default: docs/img/
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent.parent))

from sim.plot import PlotUnavailable, pyplot, save  # noqa: E402

COLOURS = {
    "the recorder": "#2454c5",
    "before": "#6e7781",
    "the recorder, --production": "#8250df",
    "before, --production": "#bf8700",
}


def heartbeats(plt: Any, data: dict[str, Any], path: Path) -> None:
    fig, (rate, cpu) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    fig.suptitle(
        f"bench/heartbeats.py: 2,000 nodes, one controller ({data['source']})", fontsize=10
    )
    seen: set[str] = set()
    for row in data["runs"]:
        tree, offered = row["tree"], row["offered"] / 1000
        label = None if tree in seen else tree
        seen.add(tree)
        colour = COLOURS.get(tree, "#1d2430")
        rate.scatter(
            [offered] * len(row["recorded"]),
            [r / 1000 for r in row["recorded"]],
            color=colour,
            label=label,
            s=28,
            alpha=0.8,
        )
        cpu.scatter([offered] * len(row["cpu_us"]), row["cpu_us"], color=colour, s=28, alpha=0.8)
    rate.plot([18, 31], [18, 31], color="#1a7f37", linestyle=":", linewidth=1, label="all offered")
    rate.axhline(20, color="#c62828", linestyle="--", linewidth=1, label="target 20,000/s")
    rate.set_title("heartbeats recorded per second", loc="left", fontsize=10)
    rate.set_xlabel("offered (thousands / s)")
    rate.set_ylabel("recorded (thousands / s)")
    rate.set_ylim(0, 32)
    rate.legend(fontsize=8, loc="lower left")
    cpu.set_title("controller CPU per heartbeat", loc="left", fontsize=10)
    cpu.set_xlabel("offered (thousands / s)")
    cpu.set_ylabel("µs")
    cpu.set_ylim(0, 140)
    for ax in (rate, cpu):
        ax.set_xticks([20, 25, 30])
        ax.grid(alpha=0.3)
    save(fig, path)


def coldstart(plt: Any, data: dict[str, Any], path: Path) -> None:
    runs = data["runs_ms"]
    fig, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
    fig.suptitle(
        f"bench/coldstart.py: one request at zero replicas ({data['source']})", fontsize=10
    )
    colours = ("#bf8700", "#2454c5", "#1a7f37")
    for row, phases in enumerate(runs):
        left = 0.0
        for i, (ms, colour) in enumerate(zip(phases, colours, strict=True)):
            ax.barh(
                row,
                ms,
                left=left,
                color=colour,
                height=0.6,
                label=data["phases"][i] if row == 0 else None,
            )
            left += ms
        ax.annotate(f" {left:.0f} ms", (left, row), va="center", fontsize=8)
    ax.set_yticks(range(len(runs)), [f"run {i + 1}" for i in range(len(runs))])
    ax.invert_yaxis()
    ax.set_xlim(0, max(sum(r) for r in runs) * 1.12)
    ax.set_xlabel("ms from the gateway holding the request (held → first byte)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.25), ncols=3, fontsize=8, frameon=False)
    ax.grid(axis="x", alpha=0.3)
    save(fig, path)


def gateway(plt: Any, data: dict[str, Any], path: Path) -> None:
    targets = data["targets"]
    names = [t["name"] for t in targets]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True, layout="constrained")
    fig.suptitle(f"bench/gateway.py ({data['source']})", fontsize=10)
    for ax, key, title in (
        (axes[0], "req_per_s", "requests / s (more is better)"),
        (axes[1], "proxy_cpu_us_per_req", "proxy CPU µs per request"),
        (axes[2], "cpu_us_per_stream", "proxy CPU µs per stream"),
    ):
        values = [t[key] for t in targets]
        colours = ["#2454c5" if n == "gateway" else "#8c959f" for n in names]
        ax.barh(range(len(names)), [v or 0 for v in values], color=colours, height=0.6)
        for row, v in enumerate(values):
            ax.annotate(" -" if v is None else f" {v:,.0f}", (v or 0, row), va="center", fontsize=8)
        ax.set_title(title, loc="left", fontsize=10)
        ax.set_xlim(0, max(v for v in values if v is not None) * 1.2)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(names)), names, fontsize=8)
    axes[0].invert_yaxis()
    save(fig, path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="where the PNGs go")
    args = parser.parse_args()
    try:
        plt = pyplot()
    except PlotUnavailable as exc:
        print(exc, file=sys.stderr)
        return 2
    figures = json.loads((HERE / "tables.json").read_text(encoding="utf-8"))
    for name, draw in (("heartbeats", heartbeats), ("coldstart", coldstart), ("gateway", gateway)):
        path = args.out / f"perf-{name}.png"
        draw(plt, figures[name], path)
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
