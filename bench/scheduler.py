"""What one placement decision costs as the fleet grows, and how large its event is.

    python bench/scheduler.py [--nodes 100,1000,10000,20000] [--repeat 20] [--json] [--quick]

For each fleet size: `actors.scheduler.schedule` on N healthy nodes (1 to 8 GPUs of two
models, three regions, 5% offline, utilization and price varied; 2 clusters already placed on
64 replicas), placing one more replica of an 8-replica cluster. Printed: milliseconds per
decision (median of --repeat), microseconds per node, the bytes of the `replica.placed.v1`
payload that records it, and the same for a decision that finds no node (`cluster.unschedulable`,
every node rejected). The floor column is one plain loop over the same nodes reading the
fields the filters read, in the same process: the ratio says how far the decision is from
the cost of merely looking at every node once.

A benchmark that prints figures, not a test; tests/actors/test_scheduler.py holds the limits
on the recorded size.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

from actors.scheduler import NoFit, Placement, schedule  # noqa: E402
from bench._quick import add_quick, announce, apply_quick  # noqa: E402
from events import ClusterSpec, ClusterUnschedulable, GpuInfo, GpuMetrics  # noqa: E402
from events.replica import ReplicaPlaced  # noqa: E402
from projections.views import NodeView, ReplicaView  # noqa: E402

REGIONS = ("eu-west", "eu-central", "us-east")
QUICK = {"nodes": "100,1000", "repeat": 3}


def fleet(count: int, rng: random.Random) -> list[NodeView]:
    nodes = []
    for i in range(count):
        model = "A100" if i % 3 else "H100"
        size = rng.choice((1, 1, 2, 4, 8))
        gpus = tuple(
            GpuInfo(index=g, uuid=f"GPU-{i}-{g}", model=model, vram_mib=81920) for g in range(size)
        )
        util = float(rng.randrange(0, 100))
        nodes.append(
            NodeView(
                node_id=f"node-{i:05d}",
                region=REGIONS[i % 3],
                zone="abc"[rng.randrange(3)],
                gpus=gpus,
                metrics=tuple(GpuMetrics(index=g.index, utilization_pct=util) for g in gpus),
                price_per_hour=round(rng.uniform(0.5, 3.0), 2),
                health="offline" if rng.random() < 0.05 else "healthy",
            )
        )
    return nodes


def existing(nodes: list[NodeView], rng: random.Random) -> list[ReplicaView]:
    placed = []
    for i in range(64):
        node = rng.choice(nodes)
        placed.append(
            ReplicaView(
                replica_id=f"other-{i}",
                cluster="other" if i % 2 else "chat",
                node_id=node.node_id,
                epoch=1,
                gpu_indices=(0,),
                status="ready",
            )
        )
    return placed


def spec(models: tuple[str, ...]) -> ClusterSpec:
    return msgspec.convert(
        {
            "name": "chat",
            "command": "serve",
            "replicas": 8,
            "gpu": {"count": 1, "models": list(models), "min_vram_mib": 40000},
        },
        ClusterSpec,
    )


def timed(fn: Any, repeat: int) -> tuple[float, Any]:
    times = []
    result = None
    for _ in range(repeat):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times), result


def floor(nodes: list[NodeView]) -> int:
    seen = 0
    for node in nodes:
        if node.health == "healthy" and not node.drained and node.gpus[0].vram_mib >= 40000:
            seen += len(node.gpus) + len(node.metrics) + int(node.price_per_hour)
    return seen


def row(count: int, repeat: int) -> dict[str, Any]:
    rng = random.Random(count)
    nodes = fleet(count, rng)
    placements = existing(nodes, rng)
    fits = spec(("A100", "H100"))
    nothing = spec(("B200",))
    seconds, placed = timed(lambda: schedule(nodes, fits, placements, random.Random(1)), repeat)
    no_fit_s, blocked = timed(
        lambda: schedule(nodes, nothing, placements, random.Random(1)), repeat
    )
    floor_s, _ = timed(lambda: floor(nodes), repeat)
    assert isinstance(placed, Placement) and isinstance(blocked, NoFit)
    event = ReplicaPlaced(
        replica_id="chat-9",
        cluster="chat",
        epoch=1,
        node_id=placed.node_id,
        gpu_indices=placed.gpu_indices,
        why=placed.why,
        candidates=placed.candidates,
    )
    unschedulable = ClusterUnschedulable(
        name="chat", missing=1, reason=blocked.reason, candidates=blocked.candidates
    )
    return {
        "nodes": count,
        "placement_ms": seconds * 1000,
        "us_per_node": seconds * 1e6 / count,
        "floor_ms": floor_s * 1000,
        "vs_floor": seconds / floor_s if floor_s else float("inf"),
        "placed_event_bytes": len(msgspec.json.encode(event)),
        "no_fit_ms": no_fit_s * 1000,
        "unschedulable_event_bytes": len(msgspec.json.encode(unschedulable)),
        "candidates_listed": len(placed.candidates),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", default="100,1000,10000,20000", help="fleet sizes")
    parser.add_argument("--repeat", type=int, default=20, help="decisions per size (median)")
    parser.add_argument("--json", action="store_true")
    add_quick(parser, f"--nodes {QUICK['nodes']} --repeat {QUICK['repeat']}")
    args = parser.parse_args()
    apply_quick(parser, args, **QUICK)
    announce(args, json_output=args.json)
    rows = [row(int(n), args.repeat) for n in args.nodes.split(",")]
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print(
        f"{'nodes':>7} {'placement ms':>13} {'us/node':>8} {'floor ms':>9} {'x floor':>8}"
        f" {'event B':>9} {'no-fit ms':>10} {'no-fit event B':>15}"
    )
    for r in rows:
        print(
            f"{r['nodes']:>7} {r['placement_ms']:>13.2f} {r['us_per_node']:>8.2f}"
            f" {r['floor_ms']:>9.3f} {r['vs_floor']:>8.1f} {r['placed_event_bytes']:>9,}"
            f" {r['no_fit_ms']:>10.2f} {r['unschedulable_event_bytes']:>15,}"
        )
    print(f"\ncommand: python bench/scheduler.py --nodes {args.nodes} --repeat {args.repeat}")


if __name__ == "__main__":
    main()
