"""Crash loop: kill -9 the controller, agents, the gateway and nats-server at random points of a
scripted workload, again and again, and check that nothing acknowledged was lost.

    python bench/crashloop.py [--kills 50] [--seed 1] [--agents 3] [--json] [--quick]
    python bench/crashloop.py --ha [--kills 50] [--seed 1] [--agents 3] [--clients 4] [--json]

Every part is its own process on loopback (tests/integration/stack.py: nats-server with
JetStream, the controller on a SQLite log, agents with fake GPUs and echo workloads), plus a
gateway process (`gpumesh gateway`). A workload task runs control API operations without pause
(cluster create, scale, delete, chosen by a seeded RNG) and records each one the controller
acknowledged (ApiReply ok); another sends chat requests through the gateway. Meanwhile a
killer picks a victim among {controller, an agent, the gateway, nats-server} at a random moment
(0.3-2 s apart), SIGKILLs its process group, waits 0-1 s, and starts it again. After --kills
kills it lets everything settle and checks:

  - every acknowledged cluster operation has its event in the log (created, scaled to the
    acknowledged count, deleted), once and in the order acknowledged
    (bench/_crashloop_common.py, check_ops_in_order), and the final clusters are what the last
    acknowledged operations left;
  - every event the workload saw committed (its `events.list` samples, by id and position) is
    still in the log, at the same position;
  - positions in the log are contiguous (1..head: nothing half-written);
  - the JetStream events stream holds every position of the log, in order, once;
  - the controller's live state (its API) equals a rebuild of the log.

`--ha` runs it on a stack in high-availability shape instead: 3 clustered nats-servers, two
controllers following the log of record on JetStream, the killer drawing among the leading
controller, the standby, one nats-server at a time, an agent and the gateway, under client load,
and a checker that adds no two leaders ever writing and live state equal to a rebuild on every
controller (bench/_crashloop_ha.py says what each check reads).

It prints progress as it goes, then the figures, and exits 1 on any loss. A benchmark that
prints figures, not a test (it takes a few minutes).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import projections  # noqa: E402
from bench._crashloop_common import (  # noqa: E402
    Ledger,
    check_ops_in_order,
    operations,
    ops_problems,
    say,
)
from bench._gateway_process import GatewayProcess  # noqa: E402
from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from events.contract import subjects  # noqa: E402
from events.sqlite_store import SqliteEventStore  # noqa: E402
from gpumesh.logconfig import configure_logging  # noqa: E402
from tests.integration.stack import Stack, echo_spec  # noqa: E402

VICTIMS = ("controller", "agent", "gateway", "nats")
# 4 kills, 2 agents; seed 59's killer picks each kind of victim once.
QUICK: dict[str, Any] = {"kills": 4, "agents": 2, "seed": 59}
# --ha: 5 kills, 2 agents; seed 139's killer picks each kind of victim once (the leader first).
QUICK_HA: dict[str, Any] = {"kills": 5, "agents": 2, "seed": 139}


async def traffic(gateway: GatewayProcess, ledger: Ledger, stop: asyncio.Event) -> None:
    body = {"model": "stable", "messages": [{"role": "user", "content": "crash?"}]}
    timeout = aiohttp.ClientTimeout(total=5)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while not stop.is_set():
            try:
                async with http.post(f"{gateway.url}/v1/chat/completions", json=body) as resp:
                    await resp.read()
                    ledger.requests[str(resp.status)] += 1
            except (aiohttp.ClientError, TimeoutError):
                ledger.requests["no connection"] += 1
            await asyncio.sleep(0.05)


async def killer(
    stack: Stack, gateway: GatewayProcess, rng: random.Random, ledger: Ledger, kills: int
) -> None:
    for n in range(1, kills + 1):
        await asyncio.sleep(rng.uniform(0.3, 2.0))
        victim = rng.choice(VICTIMS)
        pause = rng.uniform(0.0, 1.0)
        if victim == "controller":
            await stack.kill_controller()
            await asyncio.sleep(pause)
            await stack.start_controller(timeout=60)
        elif victim == "agent":
            node = rng.choice(sorted(stack.agents))
            await stack.kill_agent(node)
            await asyncio.sleep(pause)
            stack.start_agent(node)
            victim = f"agent {node}"
        elif victim == "gateway":
            await gateway.kill()
            await asyncio.sleep(pause)
            gateway.start()
        else:
            pid = stack.nats.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            await stack.nats.stop()  # reaps it; the port is kept for the restart
            await asyncio.sleep(pause)
            await stack.nats.start()
        ledger.kills[victim.split()[0]] += 1
        say(f"kill {n}/{kills}: {victim} (back after {pause:.2f} s)")


async def check(stack: Stack, ledger: Ledger) -> dict[str, Any]:
    store = await SqliteEventStore.open(stack.db_path)
    try:
        log = await store.read_all(1, 10_000_000)
    finally:
        await store.close()
    problems: list[str] = []
    positions = [e.position for e in log]
    if positions != list(range(1, len(log) + 1)):
        problems.append("log positions are not contiguous from 1")
    by_id = {e.event_id: e.position for e in log}
    lost = [i for i, pos in ledger.seen_events.items() if by_id.get(i) != pos]
    if lost:
        problems.append(f"{len(lost)} events seen committed are gone or moved: {lost[:3]}")
    # Every acknowledged operation left its event.
    kinds: dict[tuple[str, str], list[Any]] = {}
    for e in log:
        if e.stream.startswith("cluster/"):
            kinds.setdefault((e.stream, e.type), []).append(e.payload)
    missing = 0
    for verb, name, replicas in ledger.ops:
        stream = f"cluster/{name}"
        created = kinds.get((stream, "cluster.created.v1"), [])
        if verb == "cluster.create":
            ok = bool(created)
        elif verb == "cluster.delete":
            ok = bool(kinds.get((stream, "cluster.deleted.v1")))
        else:  # scaled to that count (every scale records one, to the same count too)
            counts = {p.replicas for p in kinds.get((stream, "cluster.scaled.v1"), [])}
            ok = replicas in counts
        missing += not ok
    if missing:
        problems.append(f"{missing} acknowledged operations have no event")
    problems += ops_problems(check_ops_in_order(log, ledger))
    # Live equals rebuild.
    state = projections.rebuild(log)
    rebuilt = {n: c.spec.replicas for n, c in state.clusters.clusters.items()}
    live_list = await stack.api("cluster.list", {}, timeout=30.0)
    live = {c["name"]: c["desired"] for c in live_list}
    if live != rebuilt:
        problems.append(f"live clusters {live} differ from the rebuild {rebuilt}")
    # The JetStream stream holds every position once, in order.
    js = stack.bus.jetstream(timeout=10.0)
    published: list[int] = []
    info = await js.stream_info(subjects.EVENTS_STREAM)
    sub = await js.subscribe(subjects.EVENTS_ALL, ordered_consumer=True)
    try:
        while len(published) < info.state.messages:
            msg = await sub.next_msg(timeout=10.0)
            published.append(int(msg.headers["Gpumesh-Position"]) if msg.headers else -1)
    finally:
        await sub.unsubscribe()
    # The stack runs on while this checks: what the outbox published after the log was read
    # (heartbeats, a late verdict) is past its last position and not compared.
    last = positions[-1] if positions else 0
    published = [p for p in published if p <= last]
    if published != positions:
        pairs = zip(published, positions, strict=False)
        first = next((i for i, (a, b) in enumerate(pairs) if a != b), None)
        problems.append(
            f"JetStream has {len(published)} events, the log {len(positions)}; "
            f"first difference at index {first}"
        )
    return {
        "log_events": len(log),
        "jetstream_events": len(published),
        "ops_acknowledged": len(ledger.ops),
        "ops_by_verb": dict(Counter(v for v, _, _ in ledger.ops)),
        "refused": dict(ledger.refused.most_common(6)),
        "events_seen_committed": len(ledger.seen_events),
        "lost": problems,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    ledger = Ledger()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="gpumesh-crashloop-") as tmp:
        async with Stack(Path(tmp) / "stack", agents=args.agents) as stack:
            say(f"stack up: {args.agents} agents, NATS {stack.url}")
            # A cluster the operations never touch, for the gateway traffic to reach.
            await stack.create_cluster(echo_spec(2, name="stable"))
            gateway = GatewayProcess(stack)
            gateway.start()
            stop = asyncio.Event()
            try:
                async with asyncio.TaskGroup() as tasks:
                    tasks.create_task(operations(stack, rng, ledger, stop))
                    tasks.create_task(traffic(gateway, ledger, stop))
                    await killer(stack, gateway, random.Random(args.seed + 1), ledger, args.kills)
                    say("kills done; settling")
                    stop.set()
                await stack.wait_until(
                    stack._controller_answers, timeout=60, why="controller answering"
                )
                await asyncio.sleep(5)  # the outbox catches up with the log
                result = await check(stack, ledger)
            finally:
                await gateway.kill()
    result.update(
        kills=dict(ledger.kills),
        kills_total=sum(ledger.kills.values()),
        gateway_requests=dict(ledger.requests),
        wall_s=round(time.perf_counter() - started, 1),
        seed=args.seed,
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--agents", type=int, default=3)
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--ha",
        action="store_true",
        help="high-availability shape: 3 nats-servers, 2 controllers on the JetStream log",
    )
    parser.add_argument("--clients", type=int, default=4, help="--ha: gateway clients")
    parser.add_argument(
        "--keep",
        help="--ha: keep the stack's files (logs) in this directory, with timeline.json (the "
        "kills) and operations.json (every operation sent and its outcome, every cluster event)",
    )
    add_quick(
        parser,
        " ".join(f"--{k} {v}" for k, v in QUICK.items())
        + "; with --ha "
        + " ".join(f"--{k} {v}" for k, v in QUICK_HA.items()),
    )
    arguments = parser.parse_args()
    apply_quick(parser, arguments, **(QUICK_HA if arguments.ha else QUICK))
    configure_logging(level="warning", json=False, stream=sys.stderr)
    announce(arguments, json_output=arguments.json)
    if arguments.ha:
        from bench._crashloop_ha import run_ha

        run = run_ha(
            kills=arguments.kills,
            seed=arguments.seed,
            agents=arguments.agents,
            clients=arguments.clients,
            keep=arguments.keep,
        )
    else:
        run = main(arguments)
    outcome = mark(arguments, asyncio.run(run))
    if arguments.json:
        print(json.dumps(outcome, indent=2))
    else:
        for key, value in outcome.items():
            print(f"{key:>22}: {value}")
    sys.exit(1 if outcome["lost"] else 0)
