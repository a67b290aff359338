"""`gpumesh chaos --dry-run`: the processes found and what each fault would do to whom."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from sim.env import SeededStreams
from sim.scenario import NODE_FAULTS, Scenario
from sim.timeline import End, FaultTimeline

from .ha import HaLayout, read_layout
from .kinds import (
    CANNOT_PARTITION,
    HA_KINDS,
    IN_UP,
    IN_UP_HA,
    KIND_ACTIONS,
    NEEDS_HA,
    NO_CONTROL,
    RESTARTS,
)
from .procfs import Found, flag, scan
from .stack import STAGE, NodeState, draw

# What a planned fault leaves a node in until it ends: the state the next draws skip.
_MARKS = {"power_loss": ("powered", False), "hang": ("hung", True)}


def plan(
    scenario: Scenario,
    seed: int,
    found: Found,
    *,
    speed: float = 1.0,
    ha: HaLayout | None = None,
) -> list[dict[str, Any]]:
    """What each fault would do to whom, victims drawn as a run draws them at those times if
    every fault does what it says (a real run draws among the nodes up when it fires), on the
    run's own timeline (sim/timeline.py)."""
    rng = SeededStreams(seed)("faults")
    nodes = {n: NodeState(n, p) for n, p in sorted(found.agents.items())}
    timeline: FaultTimeline[Callable[[], None]] = FaultTimeline()
    out = []
    for step in timeline.steps(scenario.faults, until=scenario.duration_s):
        if isinstance(step, End):
            step.undo()
            continue
        fault = step.fault
        out.append(_step(fault.kind, fault.at_s, fault.duration_s, speed, found, ha))
        if fault.kind not in NODE_FAULTS:
            continue
        if fault.nodes == STAGE:
            # Drawn when it fires, among the nodes holding a ready pipeline's worker stage.
            out[-1]["victims"] = ["a worker stage's node"]
            continue
        picked = draw(nodes, fault.nodes, rng)
        out[-1]["victims"] = [n.node_id for n in picked]
        if fault.kind not in _MARKS:
            continue
        attr, during = _MARKS[fault.kind]
        for node in picked:
            setattr(node, attr, during)
            timeline.ends_after(
                fault, fault.at_s, f"{fault.kind} {node.node_id}", _setter(node, attr, not during)
            )
    return out


def _setter(node: NodeState, attr: str, value: bool) -> Callable[[], None]:
    return lambda: setattr(node, attr, value)


def _step(
    kind: str,
    at_s: float,
    duration_s: float | None,
    speed: float,
    found: Found,
    ha: HaLayout | None = None,
) -> dict[str, Any]:
    step: dict[str, Any] = {"at_s": round(at_s / speed, 3), "kind": kind}
    if kind in NODE_FAULTS:
        step["victims"] = []
    action = KIND_ACTIONS[kind]
    if kind == "controller_partition" and ha is None:
        action = CANNOT_PARTITION
    elif kind in HA_KINDS and ha is None:
        action = NEEDS_HA
    elif kind == "controller_partition" and ha is not None and not ha.control:
        action = NO_CONTROL
    elif kind == "controller_partition" and ha is not None:
        relays = "; ".join(
            f"{p.name} pid {p.pid} through " + ", ".join(f":{port}" for _, port in p.relays)
            for p in ha.named("controller")
        )
        action += f" (the controllers now: {relays}; the lease says who leads when it fires)"
    elif kind in ("leader_crash", "leader_pause") and ha is not None:
        pids = ", ".join(f"{p.name} pid {p.pid}" for p in ha.named("controller"))
        action += f" (the controllers now: {pids}; the lease says who leads when it fires)"
    elif kind == "nats_server_loss" and ha is not None:
        pids = ", ".join(f"{p.name} pid {p.pid}" for p in ha.named("nats-server"))
        action += f" (the servers now: {pids})"
    elif kind == "power_loss" and ha is not None:
        action = (
            "SIGKILL the agent's process group and every workload's (a machine losing power); "
            f"{RESTARTS}, whatever duration_s"
        )
    elif kind == "controller_crash" and ha is not None:
        action = IN_UP_HA
    elif kind == "nats_outage" and ha is not None:
        pids = ", ".join(str(p.pid) for p in ha.named("nats-server"))
        action = f"SIGSTOP the three nats-servers ({pids}); SIGCONT after duration_s"
    elif kind == "controller_crash":
        if found.controller is None:
            action = IN_UP if found.up is not None else "skipped: no controller process found"
        elif flag(found.controller.args, "--nats") is None:
            action = "skipped: the controller runs the stack's own NATS"
        else:
            action = f"SIGKILL controller {found.controller.pid}, started again after duration_s"
    elif kind == "nats_outage" and found.nats is None:
        action = "skipped: no nats-server of this stack on this machine"
    if duration_s is not None:
        step["duration_s"] = round(duration_s / speed, 3)
    step["action"] = action
    return step


def dry_run(
    args: argparse.Namespace, scenario: Scenario, path: Path, url: str, gateway: str
) -> int:
    found = scan(args.data_dir, url)
    ha = read_layout(args.data_dir, url)
    steps = plan(scenario, args.seed, found, speed=args.speed, ha=ha)
    if args.json:
        processes = {
            "agents": {n: p.pid for n, p in sorted(found.agents.items())},
            "controller": found.controller.pid if found.controller else None,
            "up": found.up.pid if found.up else None,
            "nats_server": found.nats.pid if found.nats else None,
            "up_ha": {p.name: p.pid for p in ha.processes} if ha else None,
        }
        data = {
            "scenario": scenario.name,
            "file": str(path),
            "seed": args.seed,
            "nats": url,
            "gateway": gateway,
            "processes": processes,
            "clusters": [asdict(c) for c in scenario.clusters],
            "rate_per_s": scenario.rate_per_s,
            "faults": steps,
        }
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        print(render_plan(args, scenario, path, url, gateway, found, steps, ha=ha))
    return 0


def render_plan(
    args: argparse.Namespace,
    scenario: Scenario,
    path: Path,
    url: str,
    gateway: str,
    found: Found,
    steps: list[dict[str, Any]],
    *,
    ha: HaLayout | None = None,
) -> str:
    where = (
        "gpumesh up --ha: " + ", ".join(f"{p.name} (pid {p.pid})" for p in ha.named("controller"))
        if ha is not None
        else f"inside gpumesh up (pid {found.up.pid})"
        if found.controller is None and found.up is not None
        else f"pid {found.controller.pid}"
        if found.controller is not None
        else "not found on this machine"
    )
    agents = ", ".join(f"{n} (pid {p.pid})" for n, p in sorted(found.agents.items())) or "none"
    lines = [
        f"scenario {scenario.name} ({path})  seed {args.seed}  speed {args.speed:g}  dry run",
        f"  NATS:        {url}"
        + (
            " (nats-servers "
            + ", ".join(f"{p.name} pid {p.pid}" for p in ha.named("nats-server"))
            + ")"
            if ha is not None
            else f" (nats-server pid {found.nats.pid})"
            if found.nats
            else ""
        ),
        f"  gateway:     {gateway}",
        f"  controller:  {where}",
        f"  agents:      {agents}",
        f"  fleet:       the scenario has {scenario.fleet.nodes} nodes, the stack "
        f"{len(found.agents)}",
        "",
        "clusters (created when missing; the echo workload)",
    ]
    lines += [
        f"  t={c.at_s / args.speed:g} s  {c.name}: {c.replicas} replicas"
        + (f" on {c.gpu_model}" if c.gpu_model else "")
        for c in scenario.clusters
    ]
    lines.append(f"traffic: {scenario.rate_per_s:g} requests/s per cluster through {gateway}")
    lines.append("")
    lines.append("faults (wall seconds)")
    for step in steps:
        victims = f" {', '.join(step['victims']) or '(none)'}" if "victims" in step else ""
        lasting = f" for {step['duration_s']:g} s" if "duration_s" in step else ""
        lines.append(f"  t={step['at_s']:g}  {step['kind']}{victims}{lasting}")
        lines.append(f"      {step['action']}")
    return "\n".join(lines)
