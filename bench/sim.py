"""How fast the production actor code runs on the simulator, and what the seed fuzz costs.

    python bench/sim.py [--rows 100:60,1000:60,10000:20] [--budget 600] [--json]
        One run per row (NODES:SIMULATED_SECONDS), each in a child process of its own so its peak
        RSS is its own: the real controller, N real agents (fake GPUs) heartbeating every second
        with every heartbeat recorded as an event, 2 clusters (8 + 4 replicas), light traffic
        (1 request/s per cluster), one node losing power for a third of the run. Reported:
        wall and CPU time against simulated time (the speed-up, simulated seconds per wall
        second, overall and after every node registered), events and heartbeat events
        recorded, heartbeats recorded per wall second, heartbeats the agents sent, peak RSS. A
        row that would run past --budget wall seconds stops there and reports how far it got.

    python bench/sim.py --nodes 1000 --seconds 60 [--profile] [--top 25]
        One row; with --profile, under cProfile, and the top costs by own time and by
        cumulative time, as file:function.

    python bench/sim.py --floor [--nodes 1000]
        The floor under any heartbeat on this loop: N tasks that sleep 1 virtual second and
        hand a value to one consumer through a Queue, nothing else; microseconds per beat and
        the speed-up that alone would allow at N nodes.

    python bench/sim.py --wakeups [--seed N] [--top 25]
        One fleet-100 seed with the loop's call_soon and call_at counted by what they wake
        (a task's coroutine, a callback): per heartbeat recorded, the top entries.

    python bench/sim.py --seeds 4 [--jobs 2]
        Seeds of sim/scenarios/fleet-100.toml (100 nodes, 300 s of faults + 120 s settling):
        first one after the other in this process, then `gpumesh sim fuzz fleet-100 --seeds N
        --jobs J` as CI runs it (a child process; the fuzz re-runs 5% of passing seeds to check
        determinism), and both extrapolated to 1,000 seeds against CI's 90-minute budget.

With --quick (for CI) each mode runs small: the rows become one of 100 nodes for 10 simulated
seconds, the floor 100 nodes, the seeds mode one seed before the fuzz; figures marked, not
comparable.

Targets (issue): 1,000 nodes at 50x real time or faster, 10,000 nodes at 5x or faster, 1,000
seeds of fleet-100 within CI's 90 minutes. A benchmark that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import cProfile
import io
import json
import math
import os
import pstats
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from sim.loop import run_simulation  # noqa: E402
from sim.run import quiet_logger  # noqa: E402
from sim.scenario import ClusterPlan, FaultPlan, Fleet, Scenario  # noqa: E402
from sim.world import World  # noqa: E402

TARGETS = {1_000: 50.0, 10_000: 5.0}  # nodes -> speed-up (simulated s per wall s)
CI_BUDGET_S = 90 * 60
FULL_SEEDS = 1_000
REPLAY_SHARE = 0.05  # sim/cli.py re-runs this share of passing seeds
DEFAULT_ROWS = "100:60,1000:60,10000:20"
QUICK = {"rows": "100:10", "seconds": 10.0, "sequential": 1}
QUICK_FLOOR_NODES = 100
HEARTBEAT = "node.heartbeat.v1"
TICK_S = 0.25  # virtual seconds between the bench's own checks (wall budget, progress marks)


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def bench_scenario(nodes: int, seconds: float, *, fault: bool = True) -> Scenario:
    """N nodes in 3 regions, 2 clusters, light traffic, at most one power loss; no settling."""
    faults: tuple[FaultPlan, ...] = ()
    if fault:
        faults = (
            FaultPlan(at_s=seconds / 3, kind="power_loss", nodes="1", duration_s=seconds / 3),
        )
    return Scenario(
        name=f"bench-{nodes}",
        description=f"{nodes} nodes, light traffic, {len(faults)} fault(s)",
        duration_s=seconds,
        settle_s=0.0,
        fleet=Fleet(nodes=nodes, regions=("eu-west", "us-east", "ap-south")),
        clusters=(ClusterPlan("llama", replicas=8), ClusterPlan("mistral", replicas=4)),
        rate_per_s=1.0,
        faults=faults,
    )


# -- one run ---------------------------------------------------------------------------------


@dataclass
class Marks:
    """(virtual s, wall s, cpu s) at each whole virtual second, and when all nodes registered."""

    points: list[tuple[float, float, float]] = field(default_factory=list)
    registered: tuple[float, float, float] | None = None
    stopped_by_budget: bool = False


async def _drive(world: World, budget_s: float, wall0: float, cpu0: float, marks: Marks) -> None:
    """world.run(), beside a ticker that notes progress and stops the run at the wall budget."""
    loop = asyncio.get_running_loop()
    run = asyncio.ensure_future(world.run())
    nodes = world.scenario.fleet.nodes
    next_mark = 1.0
    last_say = time.perf_counter()

    async def ticker() -> None:
        nonlocal next_mark, last_say
        while not run.done():
            await asyncio.sleep(TICK_S)
            now, wall, cpu = loop.time(), time.perf_counter() - wall0, time.process_time() - cpu0
            if marks.registered is None:
                done = sum(
                    1 for n in world.nodes.values() if n.agent is not None and n.agent.registrations
                )
                if done >= nodes:
                    marks.registered = (now, wall, cpu)
            if now >= next_mark - 1e-9:
                marks.points.append((now, wall, cpu))
                next_mark = math.floor(now) + 1.0
            if time.perf_counter() - last_say > 15:
                last_say = time.perf_counter()
                say(f"  ... t={now:.1f} s simulated after {wall:.0f} s wall")
            if wall > budget_s and not run.done():
                marks.stopped_by_budget = True
                run.cancel()

    tick = asyncio.ensure_future(ticker())
    try:
        await run
    except asyncio.CancelledError:
        if not marks.stopped_by_budget:
            raise
    finally:
        tick.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await tick


def measure(
    nodes: int, seconds: float, *, budget_s: float, fault: bool, seed: int, profile: Any = None
) -> dict[str, Any]:
    scenario = bench_scenario(nodes, seconds, fault=fault)
    world = World(scenario, seed, log=quiet_logger())
    marks = Marks()
    wall0, cpu0 = time.perf_counter(), time.process_time()
    holder: dict[str, float] = {}

    async def main() -> None:
        await _drive(world, budget_s, wall0, cpu0, marks)
        holder["virtual"] = asyncio.get_running_loop().time()

    if profile is not None:
        profile.enable()
    try:
        run_simulation(main())
    finally:
        if profile is not None:
            profile.disable()
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    simulated = holder.get("virtual", 0.0)
    log = world.store.read_all_now()
    heartbeats = sum(1 for e in log if e.type == HEARTBEAT)
    # Sent against recorded, over the nodes whose agent never restarted (a powered-off agent's
    # count goes with it); a heartbeat still on the wire when the run ends is sent, not recorded.
    once = {
        n.node_id: getattr(n.agent, "_seq", 0)
        for n in world.nodes.values()
        if n.agent is not None and n.incarnation == 1
    }
    sent = sum(once.values())
    recorded_once = sum(
        1 for e in log if e.type == HEARTBEAT and getattr(e.payload, "node_id", None) in once
    )
    faults_fired = sum(1 for line in world.timeline if line.split()[1:2] == ["fault"])
    controller = world.controller
    steady = None
    if marks.registered is not None and marks.points:
        t_end, w_end, c_end = simulated, wall, cpu
        t_reg, w_reg, c_reg = marks.registered
        if t_end - t_reg >= 1.0 and w_end > w_reg:
            steady = {
                "from_s": round(t_reg, 2),
                "speedup": round((t_end - t_reg) / (w_end - w_reg), 2),
                "speedup_cpu": round((t_end - t_reg) / max(1e-9, c_end - c_reg), 2),
            }
    target = TARGETS.get(nodes)
    speedup = simulated / wall if wall > 0 else math.nan
    return {
        "nodes": nodes,
        "simulated_s_asked": seconds,
        "simulated_s": round(simulated, 2),
        "stopped_by_budget": marks.stopped_by_budget,
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "speedup": round(speedup, 2),
        "speedup_cpu": round(simulated / cpu, 2) if cpu > 0 else None,
        "all_registered_at_s": round(marks.registered[0], 2) if marks.registered else None,
        "all_registered_after_wall_s": round(marks.registered[1], 2) if marks.registered else None,
        "steady": steady,
        "events": len(log),
        "heartbeat_events": heartbeats,
        "heartbeats_sent": sent,
        "heartbeats_recorded_of_sent": recorded_once,
        "heartbeats_recorded_share": round(recorded_once / sent, 4) if sent else None,
        "heartbeats_per_wall_s": round(heartbeats / wall) if wall > 0 else None,
        "faults_fired": faults_fired,
        "controller_dropped": dict(controller.dropped) if controller is not None else {},
        "violations": len(world.checker.violations),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "target_speedup": target,
        "meets_target": (speedup >= target) if target else None,
        "load_average": round(os.getloadavg()[0], 2),
    }


def measure_in_child(
    nodes: int, seconds: float, *, budget_s: float, fault: bool, seed: int
) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", "--nodes", str(nodes)]
    command += ["--seconds", str(seconds), "--budget", str(budget_s), "--seed", str(seed)]
    if not fault:
        command.append("--no-fault")
    done = subprocess.run(command, stdout=subprocess.PIPE, check=False)
    if done.returncode != 0:
        raise SystemExit(f"bench child failed ({done.returncode}): {shlex.join(command)}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


# -- the floor -------------------------------------------------------------------------------


def measure_floor(nodes: int, seconds: float) -> dict[str, Any]:
    """The bare shape of a heartbeat: a sleeping task per node and a queue hand-off."""

    async def agent(queue: asyncio.Queue[int], i: int) -> None:
        loop = asyncio.get_running_loop()
        await asyncio.sleep(i / nodes)
        while loop.time() < seconds:
            await asyncio.sleep(1.0)
            queue.put_nowait(i)

    async def consumer(queue: asyncio.Queue[int], got: list[int]) -> None:
        while True:
            got.append(await queue.get())

    async def main() -> int:
        queue: asyncio.Queue[int] = asyncio.Queue()
        got: list[int] = []
        async with asyncio.TaskGroup() as group:
            eater = group.create_task(consumer(queue, got))
            await asyncio.gather(*(agent(queue, i) for i in range(nodes)))
            eater.cancel()
        return len(got)

    wall0 = time.perf_counter()
    beats = run_simulation(main())
    wall = time.perf_counter() - wall0
    return {
        "nodes": nodes,
        "seconds": seconds,
        "beats": beats,
        "wall_s": round(wall, 3),
        "us_per_beat": round(1e6 * wall / beats, 2),
        "speedup_ceiling": round(seconds / wall, 1),
    }


# -- wake-ups --------------------------------------------------------------------------------


def count_wakeups(seed: int, top: int) -> dict[str, Any]:
    """Run one fleet-100 seed counting what the loop schedules, per recorded heartbeat."""
    from collections import Counter

    from sim.loop import SimEventLoop
    from sim.run import find_scenario, run_scenario
    from sim.scenario import load

    counts: Counter[str] = Counter()

    def what(callback: Any, args: tuple[Any, ...]) -> str:
        owner = getattr(callback, "__self__", None)
        if isinstance(owner, asyncio.Task):
            coro = owner.get_coro()
            return "wake task " + getattr(coro, "__qualname__", type(coro).__name__)
        name = getattr(callback, "__qualname__", repr(callback))
        if name == "_set_result_unless_cancelled":
            return "timer asyncio.sleep"
        return "call " + name

    soon, at = SimEventLoop.call_soon, SimEventLoop.call_at

    def counting_soon(self: Any, callback: Any, *args: Any, context: Any = None) -> Any:
        counts[what(callback, args)] += 1
        return soon(self, callback, *args, context=context)

    def counting_at(self: Any, when: float, callback: Any, *args: Any, context: Any = None) -> Any:
        counts["timer " + what(callback, args).split(" ", 1)[1]] += 1
        counts["(timers)"] += 1
        return at(self, when, callback, *args, context=context)

    SimEventLoop.call_soon = counting_soon  # type: ignore[method-assign]
    SimEventLoop.call_at = counting_at  # type: ignore[method-assign]
    try:
        _, world = run_scenario(load(find_scenario("fleet-100")), seed)
    finally:
        SimEventLoop.call_soon = soon  # type: ignore[method-assign]
        SimEventLoop.call_at = at  # type: ignore[method-assign]
    beats = sum(1 for e in world.store.read_all_now() if e.type == HEARTBEAT)
    return {
        "seed": seed,
        "heartbeats": beats,
        "per_heartbeat": {k: round(v / beats, 3) for k, v in counts.most_common(top)},
    }


# -- profile ---------------------------------------------------------------------------------


def _where(func: tuple[str, int, str]) -> str:
    filename, line, name = func
    if filename == "~":
        return name  # a builtin: "{method 'split' of 'str' objects}"
    path = Path(filename)
    with contextlib.suppress(ValueError):
        path = path.resolve().relative_to(ROOT)
    text = str(path)
    if "/lib/python3" in text:
        text = "stdlib/" + text.split("/lib/python3", 1)[1].split("/", 1)[1]
    return f"{text}:{line}:{name}"


def _area(where: str) -> str:
    """What a profile row belongs to: asyncio itself, a package of ours, or the rest."""
    if where.startswith("stdlib/asyncio/") or "_asyncio" in where or "_heapq" in where:
        return "asyncio (event loop, tasks, futures, queues, timers)"
    head = where.split("/", 1)[0]
    if "/" in where and head in {"actors", "sim", "nodeagent", "events", "projections", "gateway"}:
        return f"{head}/"
    return "other (builtins, stdlib, msgspec, structlog)"


def top_costs(profile: cProfile.Profile, top: int) -> dict[str, list[dict[str, Any]]]:
    stats = pstats.Stats(profile, stream=io.StringIO())
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    total = sum(tt for (_, _, tt, _, _) in raw.values()) or 1.0
    rows = [
        {
            "where": _where(func),
            "calls": nc,
            "own_s": round(tt, 3),
            "own_share": round(tt / total, 4),
            "cumulative_s": round(ct, 3),
        }
        for func, (_, nc, tt, ct, _) in raw.items()
    ]
    areas: dict[str, float] = {}
    for r in rows:
        areas[_area(r["where"])] = areas.get(_area(r["where"]), 0.0) + r["own_s"]
    return {
        "total_s": [{"own_s": round(total, 3)}],
        "by_area": [
            {"area": area, "own_s": round(own, 3), "own_share": round(own / total, 4)}
            for area, own in sorted(areas.items(), key=lambda a: -a[1])
        ],
        "by_own_time": sorted(rows, key=lambda r: -r["own_s"])[:top],
        "by_cumulative_time": sorted(rows, key=lambda r: -r["cumulative_s"])[:top],
    }


# -- seeds -----------------------------------------------------------------------------------


def fuzz_runs(seeds: int) -> int:
    """How many runs `gpumesh sim fuzz --seeds N` makes when every seed passes."""
    return seeds + len(range(0, seeds, max(1, round(1 / REPLAY_SHARE))))


def measure_seeds(seeds: int, jobs: int, sequential: int) -> dict[str, Any]:
    from sim.cli import execute
    from sim.run import find_scenario

    path = str(find_scenario("fleet-100"))
    per_seed = []
    for seed in range(1, sequential + 1):
        wall0, cpu0 = time.perf_counter(), time.process_time()
        result = execute(path, seed)
        wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
        per_seed.append(
            {
                "seed": seed,
                "wall_s": round(wall, 2),
                "cpu_s": round(cpu, 2),
                "events": result["events"],
                "violations": len(result["violations"]),
            }
        )
        say(f"  seed {seed}: {wall:.1f} s wall, {cpu:.1f} s CPU, {result['events']} events")
    command = [sys.executable, "-m", "gpumesh", "sim", "fuzz", "fleet-100"]
    command += ["--seeds", str(seeds), "--jobs", str(jobs)]
    say(f"  {shlex.join(command)}")
    wall0 = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False, cwd=ROOT)
    fuzz_wall = time.perf_counter() - wall0
    runs = fuzz_runs(seeds)
    full_runs = fuzz_runs(FULL_SEEDS)
    mean_wall = sum(s["wall_s"] for s in per_seed) / len(per_seed) if per_seed else math.nan
    mean_cpu = sum(s["cpu_s"] for s in per_seed) / len(per_seed) if per_seed else math.nan
    from_fuzz = fuzz_wall / runs * full_runs
    from_cpu = mean_cpu * full_runs / max(1, jobs)
    return {
        "scenario": "fleet-100",
        "sequential": per_seed,
        "sequential_mean_wall_s": round(mean_wall, 2),
        "sequential_mean_cpu_s": round(mean_cpu, 2),
        "fuzz_command": f"gpumesh sim fuzz fleet-100 --seeds {seeds} --jobs {jobs}",
        "fuzz_seeds": seeds,
        "fuzz_runs": runs,
        "fuzz_wall_s": round(fuzz_wall, 2),
        "fuzz_exit": done.returncode,
        "fuzz_output": done.stdout.strip().splitlines()[-1:] or [done.stderr.strip()[-300:]],
        "full_set_runs": full_runs,
        "full_set_estimate_s_from_fuzz": round(from_fuzz),
        "full_set_estimate_s_from_cpu": round(from_cpu),
        "ci_budget_s": CI_BUDGET_S,
        "fits_ci_budget": from_fuzz <= CI_BUDGET_S,
        "seeds_fitting_budget": math.floor(FULL_SEEDS * CI_BUDGET_S / from_fuzz)
        if from_fuzz > 0
        else None,
        "load_average": round(os.getloadavg()[0], 2),
    }


# -- output ----------------------------------------------------------------------------------


def _verdict(row: dict[str, Any]) -> str:
    target = row["target_speedup"]
    if not target:
        return ""
    mark = "PASS" if row["meets_target"] else "MISS"
    return f"≥ {target:g}x: {mark}"


def print_rows(rows: list[dict[str, Any]]) -> None:
    head = (
        f"{'nodes':>6} {'sim s':>7} {'wall s':>8} {'CPU s':>8} {'speed-up':>9} {'(CPU)':>7} "
        f"{'steady':>7} {'events':>8} {'hb events':>9} {'hb/sent':>8} {'hb/wall s':>9} "
        f"{'RSS MiB':>8}  target"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        sim = f"{r['simulated_s']:g}" + ("*" if r["stopped_by_budget"] else "")
        steady = f"{r['steady']['speedup']:.2f}x" if r["steady"] else "-"
        share = f"{r['heartbeats_recorded_share'] * 100:.1f}%" if r["heartbeats_sent"] else "-"
        print(
            f"{r['nodes']:>6} {sim:>7} {r['wall_s']:>8.1f} {r['cpu_s']:>8.1f} "
            f"{r['speedup']:>8.2f}x {r['speedup_cpu']:>6.2f}x {steady:>7} {r['events']:>8} "
            f"{r['heartbeat_events']:>9} {share:>8} {r['heartbeats_per_wall_s']:>9} "
            f"{r['peak_rss_mib']:>8.0f}  {_verdict(r)}"
        )
    notes = []
    if any(r["stopped_by_budget"] for r in rows):
        notes.append("* stopped at the wall budget: the simulated time it reached")
    for r in rows:
        reg = r["all_registered_at_s"]
        after = r["all_registered_after_wall_s"]
        notes.append(
            f"{r['nodes']} nodes: all registered at t={reg} s (after {after} s wall)"
            if reg is not None
            else f"{r['nodes']} nodes: not all registered by t={r['simulated_s']} s"
        )
        if r["controller_dropped"] or r["violations"]:
            notes.append(
                f"{r['nodes']} nodes: controller dropped {r['controller_dropped']}, "
                f"{r['violations']} invariant violation(s) (no settling time: expected)"
            )
    loads = ", ".join(f"{r['load_average']:g}" for r in rows)
    notes.append(f"load average at the end of each row: {loads}")
    notes.append("speed-up: simulated s / wall s; (CPU): / CPU s; steady: after all registered")
    for note in notes:
        print(f"  {note}")


def print_seeds(s: dict[str, Any]) -> None:
    print(f"fleet-100, one seed after another ({len(s['sequential'])} seeds):")
    for seed in s["sequential"]:
        print(
            f"  seed {seed['seed']}: {seed['wall_s']:.1f} s wall, {seed['cpu_s']:.1f} s CPU, "
            f"{seed['events']} events, {seed['violations']} violation(s)"
        )
    print(
        f"  mean {s['sequential_mean_wall_s']:.1f} s wall, {s['sequential_mean_cpu_s']:.1f} s CPU"
    )
    print(
        f"{s['fuzz_command']}: {s['fuzz_wall_s']:.1f} s wall for {s['fuzz_runs']} runs "
        f"(exit {s['fuzz_exit']}: {' '.join(s['fuzz_output'])})"
    )
    full = s["full_set_estimate_s_from_fuzz"]
    mark = "PASS" if s["fits_ci_budget"] else "MISS"
    print(
        f"1,000 seeds ({s['full_set_runs']} runs with the 5% replays): about {full / 60:.0f} min "
        f"from the fuzz timing, {s['full_set_estimate_s_from_cpu'] / 60:.0f} min from CPU time "
        f"over 2 cores; CI budget {s['ci_budget_s'] / 60:.0f} min: {mark} "
        f"(about {s['seeds_fitting_budget']} seeds fit)"
    )
    print(f"  load average at the end: {s['load_average']:g}")


def print_profile(costs: dict[str, list[dict[str, Any]]]) -> None:
    total = costs["total_s"][0]["own_s"]
    print(f"\nprofile (cProfile, {total:.1f} s in all; profiling slows the run):")
    print("own time by area:")
    for a in costs["by_area"]:
        print(f"  {a['own_s']:8.2f} s {a['own_share'] * 100:5.1f}%  {a['area']}")
    print("by own time:")
    for r in costs["by_own_time"]:
        print(
            f"  {r['own_s']:8.2f} s {r['own_share'] * 100:5.1f}%  {r['calls']:>10} calls  "
            f"{r['where']}"
        )
    print("by cumulative time:")
    for r in costs["by_cumulative_time"]:
        print(f"  {r['cumulative_s']:8.2f} s  {r['calls']:>10} calls  {r['where']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, help="one row: this many nodes")
    parser.add_argument("--seconds", type=float, default=60.0, help="simulated seconds (60)")
    parser.add_argument(
        "--rows", default=DEFAULT_ROWS, help=f"NODES:SECONDS,... (default {DEFAULT_ROWS})"
    )
    parser.add_argument(
        "--budget", type=float, default=600.0, help="wall seconds per row before it stops (600)"
    )
    parser.add_argument("--no-fault", action="store_true", help="no power loss in the run")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--profile", action="store_true", help="cProfile the one row")
    parser.add_argument("--top", type=int, default=25, help="profile rows to print (25)")
    parser.add_argument("--seeds", type=int, help="fleet-100 seeds mode: fuzz this many")
    parser.add_argument("--jobs", type=int, default=2, help="fuzz processes (2)")
    parser.add_argument(
        "--sequential", type=int, default=2, help="seeds run one after another first (2)"
    )
    parser.add_argument(
        "--wakeups", action="store_true", help="what the loop schedules, per heartbeat (fleet-100)"
    )
    parser.add_argument(
        "--floor", action="store_true", help="the loop's floor: a sleep and a queue hop per beat"
    )
    parser.add_argument("--json", action="store_true")
    add_quick(
        parser,
        f"--rows {QUICK['rows']}, --seconds {QUICK['seconds']:g}, --sequential "
        f"{QUICK['sequential']}, --floor at {QUICK_FLOOR_NODES} nodes",
    )
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    apply_quick(parser, args, **QUICK)
    fault = not args.no_fault
    command = shlex.join([Path(sys.executable).name, "bench/sim.py", *sys.argv[1:]])

    if args.child:
        row = measure(args.nodes, args.seconds, budget_s=args.budget, fault=fault, seed=args.seed)
        print(json.dumps(row))
        return 0

    announce(args, json_output=args.json)
    if args.wakeups:
        result = mark(args, count_wakeups(args.seed, args.top))
        if args.json:
            print(json.dumps(result))
        else:
            print(f"fleet-100 seed {result['seed']}: {result['heartbeats']} heartbeats recorded")
            for name, per in result["per_heartbeat"].items():
                print(f"  {per:7.3f} per heartbeat  {name}")
            print(f"\ncommand: {command}")
        return 0

    if args.floor:
        nodes = args.nodes or (QUICK_FLOOR_NODES if args.quick else 1_000)
        floor = mark(args, measure_floor(nodes, min(args.seconds, 20.0)))
        if args.json:
            print(json.dumps(floor))
        else:
            print(
                f"floor at {floor['nodes']} nodes: {floor['beats']} beats in {floor['wall_s']} s "
                f"wall, {floor['us_per_beat']} us per beat: at most "
                f"{floor['speedup_ceiling']}x real time with handlers that do nothing"
            )
            print(f"\ncommand: {command}")
        return 0

    if args.seeds is not None:
        say(f"bench/sim.py: fleet-100 seeds ({args.sequential} sequential, then the fuzz)")
        result = mark(args, measure_seeds(args.seeds, args.jobs, args.sequential))
        if args.json:
            print(json.dumps(result))
        else:
            print_seeds(result)
            print(f"\ncommand: {command}")
        return 0

    if args.nodes is not None:
        plan = [(args.nodes, args.seconds)]
    else:
        plan = []
        for item in args.rows.split(","):
            nodes, _, seconds = item.partition(":")
            plan.append((int(nodes), float(seconds or args.seconds)))

    rows = []
    costs = None
    for nodes, seconds in plan:
        say(f"bench/sim.py: {nodes} nodes, {seconds:g} s simulated (budget {args.budget:g} s wall)")
        if args.profile:
            profile = cProfile.Profile()
            row = measure(
                nodes, seconds, budget_s=args.budget, fault=fault, seed=args.seed, profile=profile
            )
            rows.append(row)
            costs = top_costs(profile, args.top)
        else:
            rows.append(
                measure_in_child(nodes, seconds, budget_s=args.budget, fault=fault, seed=args.seed)
            )
        say(f"  {rows[-1]['speedup']:.2f}x real time in {rows[-1]['wall_s']:.1f} s wall")
    if args.json:
        print(json.dumps(mark(args, {"rows": rows, "profile": costs})))
        return 0
    print_rows(rows)
    if costs is not None:
        print_profile(costs)
    print(f"\ncommand: {command}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
