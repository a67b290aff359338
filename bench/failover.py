"""Failover timings on a real local stack, and a no-fault soak that counts false verdicts.

Every part is its own process on loopback (tests/integration/stack.py): nats-server, the
controller, N agents with fake GPUs, real echo workloads. Health settings are the defaults
(heartbeat 1 s, offline after 3 missed heartbeats).

    python bench/failover.py [--runs 5] [--json]
        Each run: a fresh stack (4 agents, cluster `echo` of 3 replicas), all serving; after a
        random 0-1 s pause (so the kill falls anywhere in the heartbeat cycle) SIGKILL one agent
        that holds a replica, and its workload. From the event log's recorded_at times:
          detection    kill -> node.health_changed(offline)
          decision     offline -> the replacement's replica.placed
          launch       placed -> replica.starting (command delivered, process started)
          start        replica.starting -> replica.ready (the echo workload's own start time)
          replacement  kill -> the replacement's replica.ready

    python bench/failover.py --soak 300 --agents 20 [--json]
        20 agents and a cluster of 3 echo replicas, no faults, for 300 s: any health verdict
        other than healthy (offline above all) is a false alarm; also reports the largest gap
        between two recorded heartbeats of any node.

Targets printed beside the results: detection <= 3 s; replacement <= detection + 2 s + the
workload's start time. A benchmark that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from events.envelope import Envelope  # noqa: E402
from gpumesh.logconfig import configure_logging  # noqa: E402
from tests.integration.stack import Stack, echo_spec, payload, pid_alive  # noqa: E402

DETECTION_TARGET_S = 3.0
DECISION_BUDGET_S = 2.0  # replacement <= detection + this + the workload's start time
REPLICAS = 3


def _s(ns: int) -> float:
    return ns / 1e9


async def _serving(stack: Stack, replicas: int, timeout: float = 60.0) -> dict[str, Any]:
    async def check() -> dict[str, Any] | None:
        cluster = await stack.cluster("echo")
        if cluster["ready"] != replicas:
            return None
        running = {(w.replica_id, w.epoch) for w in stack.workloads()}
        wanted = {
            (r["replica_id"], r["epoch"]) for r in cluster["replicas"] if r["status"] == "ready"
        }
        return cluster if running == wanted else None

    return await stack.wait_until(check, timeout=timeout, why=f"{replicas} echo replicas serving")


def _start_times(events: list[Envelope]) -> list[float]:
    """replica.starting -> replica.ready, per (replica, epoch), in seconds."""
    starting: dict[tuple[str, int], int] = {}
    out = []
    for e in events:
        p = payload(e)
        key = (p.get("replica_id", ""), p.get("epoch", 0))
        if e.type == "replica.starting.v1":
            starting[key] = e.recorded_at
        elif e.type == "replica.ready.v1" and key in starting:
            out.append(_s(e.recorded_at - starting[key]))
    return out


async def one_run(index: int, workdir: Path, agents: int, rng: random.Random) -> dict[str, Any]:
    async with Stack(workdir / f"run-{index}", agents=agents) as stack:
        await stack.create_cluster(echo_spec(REPLICAS))
        cluster = await _serving(stack, REPLICAS)
        initial_starts = _start_times(stack.events())
        victim = cluster["replicas"][index % REPLICAS]
        rid, node = victim["replica_id"], victim["node_id"]
        await asyncio.sleep(rng.uniform(0.0, 1.0))
        killed = await stack.kill_agent(node)
        offline = await stack.wait_for_event(
            "node.health_changed.v1", node_id=node, state="offline", timeout=30
        )
        placed = await stack.wait_for_event(
            "replica.placed.v1", replica_id=rid, epoch=2, after=offline.position, timeout=30
        )
        starting = await stack.wait_for_event(
            "replica.starting.v1", replica_id=rid, epoch=2, timeout=30
        )
        ready = await stack.wait_for_event("replica.ready.v1", replica_id=rid, epoch=2, timeout=60)
        await _serving(stack, REPLICAS)
        assert not any(pid_alive(w.pid) for w in killed.workloads)
        return {
            "run": index + 1,
            "victim": node,
            "replica": rid,
            "replacement_node": payload(placed)["node_id"],
            "detection_s": _s(offline.recorded_at - killed.at_ns),
            "decision_s": _s(placed.recorded_at - offline.recorded_at),
            "launch_s": _s(starting.recorded_at - placed.recorded_at),
            "workload_start_s": _s(ready.recorded_at - starting.recorded_at),
            "replacement_s": _s(ready.recorded_at - killed.at_ns),
            "initial_workload_starts_s": initial_starts,
        }


def _verdicts(run: dict[str, Any]) -> tuple[bool, bool]:
    detect_ok = run["detection_s"] <= DETECTION_TARGET_S
    budget = run["detection_s"] + DECISION_BUDGET_S + run["workload_start_s"]
    return detect_ok, run["replacement_s"] <= budget


async def failover(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    runs = []
    with tempfile.TemporaryDirectory(prefix="gpumesh-failover-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        for i in range(args.runs):
            run = await one_run(i, workdir, args.agents, rng)
            runs.append(run)
            if not args.json:
                _print_run(run)
    keys = ("detection_s", "decision_s", "launch_s", "workload_start_s", "replacement_s")
    medians = {k: statistics.median(r[k] for r in runs) for k in keys}
    initial = [t for r in runs for t in r["initial_workload_starts_s"]]
    medians["initial_workload_start_s"] = statistics.median(initial) if initial else 0.0
    maxima = {k: max(r[k] for r in runs) for k in keys}
    verdicts = [_verdicts(r) for r in runs]
    return {
        "mode": "failover",
        "agents": args.agents,
        "replicas": REPLICAS,
        "heartbeat_interval_s": 1.0,
        "offline_after": 3,
        "runs": runs,
        "median": medians,
        "max": maxima,
        "targets": {
            "detection_s": DETECTION_TARGET_S,
            "detection_met": sum(d for d, _ in verdicts),
            "replacement_budget": f"detection + {DECISION_BUDGET_S:g} s + workload start",
            "replacement_met": sum(r for _, r in verdicts),
            "runs": len(runs),
        },
    }


def _print_header(agents: int) -> None:
    print(
        f"failover: {agents} agents, cluster echo x{REPLICAS}, heartbeat 1 s, offline after 3 "
        "missed; SIGKILL one agent holding a replica (and its workload) per run"
    )
    print(
        f"{'run':>3} {'victim':7} {'detection':>9} {'decision':>9} {'launch':>7} "
        f"{'wl start':>8} {'replacement':>11}  targets"
    )


def _print_run(run: dict[str, Any]) -> None:
    detect_ok, replace_ok = _verdicts(run)
    verdict = (
        f"detection {'ok' if detect_ok else 'MISSED'}, "
        f"replacement {'ok' if replace_ok else 'MISSED'}"
    )
    print(
        f"{run['run']:>3} {run['victim']:7} {run['detection_s']:8.2f}s {run['decision_s']:8.3f}s "
        f"{run['launch_s']:6.3f}s {run['workload_start_s']:7.2f}s {run['replacement_s']:10.2f}s  "
        f"{verdict}"
    )


def _print_summary(result: dict[str, Any]) -> None:
    m, x, t = result["median"], result["max"], result["targets"]
    print(
        f"med {'':7} {m['detection_s']:8.2f}s {m['decision_s']:8.3f}s {m['launch_s']:6.3f}s "
        f"{m['workload_start_s']:7.2f}s {m['replacement_s']:10.2f}s"
    )
    print(
        f"max {'':7} {x['detection_s']:8.2f}s {x['decision_s']:8.3f}s {x['launch_s']:6.3f}s "
        f"{x['workload_start_s']:7.2f}s {x['replacement_s']:10.2f}s"
    )
    budget = m["detection_s"] + DECISION_BUDGET_S + m["workload_start_s"]
    print(
        f"target: detection <= {t['detection_s']:.1f} s: median {m['detection_s']:.2f} s, "
        f"met in {t['detection_met']}/{t['runs']} runs"
    )
    print(
        f"target: replacement <= detection + {DECISION_BUDGET_S:g} s + workload start "
        f"(median {m['detection_s']:.2f} + {DECISION_BUDGET_S:g} + {m['workload_start_s']:.2f} "
        f"= {budget:.2f} s): median {m['replacement_s']:.2f} s, met in "
        f"{t['replacement_met']}/{t['runs']} runs"
    )
    print(
        f"echo workload start (replica.starting -> replica.ready): median "
        f"{m['workload_start_s']:.2f} s for replacements, {m['initial_workload_start_s']:.2f} s "
        "at the initial deploys"
    )


async def soak(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gpumesh-soak-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        started = time.monotonic()
        async with Stack(workdir / "soak", agents=args.agents) as stack:
            setup_s = time.monotonic() - started
            await stack.create_cluster(echo_spec(REPLICAS))
            await _serving(stack, REPLICAS)
            begin = stack.events()[-1].position
            begin_ns = time.time_ns()
            if not args.json:
                print(
                    f"soak: {args.agents} agents up in {setup_s:.1f} s, cluster echo x{REPLICAS} "
                    f"serving; no faults for {args.soak:g} s",
                    flush=True,
                )
            deaths: list[str] = []
            deadline = time.monotonic() + args.soak
            while time.monotonic() < deadline:
                await asyncio.sleep(min(5.0, max(deadline - time.monotonic(), 0.0)))
                for node, child in stack.agents.items():
                    if child.popen.poll() is not None and node not in deaths:
                        deaths.append(node)
            end_ns = time.time_ns()
            events = [e for e in stack.events() if e.position > begin]
            beats = [
                e for e in stack.events("node.heartbeat.v1") if begin_ns <= e.recorded_at <= end_ns
            ]
            final_nodes = await stack.nodes()
            final = await stack.cluster("echo")
    verdicts = [
        {
            "node_id": payload(e)["node_id"],
            "state": payload(e)["state"],
            "reason": payload(e)["reason"],
            "detail": payload(e).get("detail", ""),
            "at_s": round(_s(e.recorded_at - begin_ns), 3),
        }
        for e in events
        if e.type == "node.health_changed.v1"
    ]
    replica_events = [e.type for e in events if e.type.startswith("replica.")]
    per_node: dict[str, list[int]] = defaultdict(list)
    for e in beats:
        per_node[payload(e)["node_id"]].append(e.recorded_at)
    gaps = {
        node: max((_s(b - a) for a, b in itertools.pairwise(times)), default=0.0)
        for node, times in per_node.items()
    }
    worst = max(gaps.items(), key=lambda kv: kv[1], default=("-", 0.0))
    return {
        "mode": "soak",
        "agents": args.agents,
        "seconds": args.soak,
        "setup_s": setup_s,
        "offline_verdicts": sum(1 for v in verdicts if v["state"] == "offline"),
        "health_verdicts": verdicts,
        "replica_events": replica_events,
        "agents_died": deaths,
        "heartbeats_recorded": len(beats),
        "heartbeats_expected": int(args.agents * args.soak),
        "max_heartbeat_gap_s": worst[1],
        "max_heartbeat_gap_node": worst[0],
        "nodes_healthy_at_end": sum(1 for n in final_nodes if n["health"] == "healthy"),
        "cluster_ready_at_end": final["ready"],
    }


def _print_soak(r: dict[str, Any]) -> None:
    print(
        f"offline verdicts: {r['offline_verdicts']} (target 0); other health changes: "
        f"{len(r['health_verdicts']) - r['offline_verdicts']}"
    )
    for v in r["health_verdicts"]:
        print(f"  +{v['at_s']:.1f}s {v['node_id']} -> {v['state']} ({v['reason']}: {v['detail']})")
    print(
        f"heartbeats recorded: {r['heartbeats_recorded']} (~{r['heartbeats_expected']} expected); "
        f"largest gap between two of one node: {r['max_heartbeat_gap_s']:.2f} s "
        f"({r['max_heartbeat_gap_node']}; offline needs 3 s)"
    )
    print(
        f"replica events during the soak: {len(r['replica_events'])} "
        f"{sorted(set(r['replica_events']))}; agents died: {r['agents_died'] or 'none'}; "
        f"at the end: {r['nodes_healthy_at_end']}/{r['agents']} nodes healthy, "
        f"echo {r['cluster_ready_at_end']}/{REPLICAS} ready"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="failover runs (default 5)")
    parser.add_argument("--agents", type=int, default=None, help="default 4, or 20 with --soak")
    parser.add_argument("--soak", type=float, default=0.0, metavar="SECONDS")
    parser.add_argument("--seed", type=int, default=1, help="for the pause before each kill")
    parser.add_argument(
        "--keep", metavar="DIR", help="keep the stacks' data and logs in this directory"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    configure_logging(level="warning", json=False, stream=sys.stderr)
    if args.soak > 0:
        args.agents = args.agents or 20
        result = asyncio.run(soak(args))
        if args.json:
            print(json.dumps(result, indent=2))
        else:
            _print_soak(result)
        return 0 if result["offline_verdicts"] == 0 else 1
    args.agents = args.agents or 4
    if not args.json:
        _print_header(args.agents)
    result = asyncio.run(failover(args))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        _print_summary(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
