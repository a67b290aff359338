"""How many heartbeats one controller records as events, over real NATS, and how fast.

A generator process registers N simulated nodes and publishes their heartbeats at a paced
rate; this process runs the real controller (SQLite event store, synchronous=FULL, NATS) and
counts committed `node.heartbeat.v1` events, with the latency from the agent's send to the
commit being visible to a subscriber of the log.

    python bench/heartbeats.py [--nodes 2000] [--rate 20000] [--seconds 20] [--json] [--quick]
                               [--store sqlite|jetstream-r3]

Target (issue 3): at least 20,000 heartbeats/s recorded as events. With `--store jetstream-r3`
the log of record is the JetStream store (events/jetstream_store/) on three local nats-servers
clustered by routes, each with `sync_interval: always`, the stream R3 (issue 16's target: the
same 20,000/s by the leader on that store); the controller and the load then use that cluster.
There the store is fenced on a term record, as a leading controller's is (actors/fenced_store.py:
every append conditional on the term); `--unfenced` measures the bare store.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from actors.controller import Controller, ControllerConfig  # noqa: E402
from actors.health import HealthPolicy  # noqa: E402
from actors.outbox import OutboxPublisher  # noqa: E402
from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from events.contract import subjects  # noqa: E402
from events.contract.messages import Heartbeat, Register  # noqa: E402
from events.errors import EventStoreError  # noqa: E402
from events.node import GpuInfo, GpuMetrics, NodeHealthChanged, NodeHeartbeat  # noqa: E402
from events.sqlite_store import SqliteEventStore  # noqa: E402
from events.store import EventStore  # noqa: E402
from gpumesh.gc_tuning import tune_collector  # noqa: E402
from gpumesh.logconfig import configure_logging  # noqa: E402
from runtime.real_env import real_env  # noqa: E402
from sim.commands import MemoryCommandQueue  # noqa: E402
from wire.nats_bus import NatsBus  # noqa: E402
from wire.nats_server import EmbeddedNats  # noqa: E402

TARGET = 20_000
QUICK = {"nodes": 50, "rate": 500.0, "seconds": 2.0}


async def generate(url: str, nodes: int, rate: float, seconds: float, leases: bool) -> None:
    """The load: register every node, then publish heartbeats round-robin at `rate` per second."""
    from nats.aio.client import Client

    nc = Client()
    await nc.connect(servers=url.split(","))
    gpus = tuple(
        GpuInfo(index=i, uuid=f"GPU-{i}", model="RTX4090", vram_mib=24_576) for i in range(2)
    )
    for n in range(nodes):
        node_id = f"hb-{n:05d}"
        await nc.request(
            subjects.register(node_id),
            msgspec.json.encode(Register(node_id=node_id, gpus=gpus)),
            timeout=30,
        )
    acks = 0

    async def count_ack(_msg: Any) -> None:
        nonlocal acks
        acks += 1

    if leases:
        # Real agents ask for their lease with every heartbeat (a reply subject); the replies
        # come back here, counted, not awaited one by one.
        await nc.subscribe("hbbench.ack.*", cb=count_ack)
    metrics = (GpuMetrics(index=0, temperature_c=55.0), GpuMetrics(index=1, temperature_c=57.0))
    encoder = msgspec.json.Encoder()
    print(json.dumps({"load_started": True}), flush=True)  # every node registered
    seq = [0] * nodes
    sent = 0
    start = time.perf_counter()
    tick = 0.01
    while (elapsed := time.perf_counter() - start) < seconds:
        due = int(elapsed * rate) - sent
        for _ in range(max(0, due)):
            n = sent % nodes
            seq[n] += 1
            hb = Heartbeat(
                node_id=f"hb-{n:05d}", seq=seq[n], sent_at_ns=time.time_ns(), gpus=metrics
            )
            reply = f"hbbench.ack.{n}" if leases else ""
            await nc.publish(subjects.heartbeat(hb.node_id), encoder.encode(hb), reply=reply)
            sent += 1
        await nc.flush()
        await asyncio.sleep(tick)
    await nc.flush()
    await asyncio.sleep(2.0 if leases else 0.0)  # acks of the backlog still on their way
    await nc.drain()
    print(
        json.dumps({"sent": sent, "acks": acks, "seconds": round(time.perf_counter() - start, 3)})
    )


@contextlib.asynccontextmanager
async def nats_for(args: argparse.Namespace, tmp: Path) -> AsyncIterator[tuple[str, int | None]]:
    """The NATS the run uses: its URL(s) and the server's pid (None for a cluster)."""
    if args.store == "sqlite":
        async with EmbeddedNats(tmp / "nats") as server:
            yield server.url, server._process.pid if server._process else None
        return
    from bench.eventstore import nats_servers

    with nats_servers(tmp / "cluster", 3, "always") as urls:
        yield ",".join(urls), None


class _Leading:
    """The bench's controller leads throughout: its lease never lapses."""

    def holds_lease(self) -> bool:
        return True

    def deposed(self, reason: str) -> None:
        raise SystemExit(f"the bench's store was deposed: {reason}")


async def open_store(
    args: argparse.Namespace, tmp: Path, bus: NatsBus
) -> tuple[EventStore, EventStore]:
    """(what the controller writes through, the store underneath to close)."""
    if args.store == "sqlite":
        store = await SqliteEventStore.open(tmp / "events.db")
        return store, store
    from events.jetstream_store import JetStreamEventStore, JetStreamOptions

    # A fresh cluster elects its JetStream meta leader a few seconds after it is ready.
    for attempt in range(60):
        try:
            js = await JetStreamEventStore.open(bus.client, JetStreamOptions(replicas=3))
            break
        except EventStoreError:
            if attempt == 59:
                raise
            await asyncio.sleep(0.5)
    if args.unfenced:
        return js, js
    from actors.fenced_store import fenced
    from events import LeaderTermBegan, NewEvent

    leader = fenced(js, _Leading(), term=1)
    record = LeaderTermBegan(controller_id="bench", term=1)
    await leader.begin_term(NewEvent(event_id="bench-term-1", payload=record, recorded_at=0))
    return leader, js


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        async with nats_for(args, Path(tmp)) as (url, server_pid):
            bus = await NatsBus.connect(url, name="bench-controller")
            store, underneath = await open_store(args, Path(tmp), bus)
            # Heartbeats arrive every nodes/rate seconds per node: give silence detection room.
            interval = max(1.0, args.nodes / args.rate * 2)
            # Each node beats rate/nodes times a second, faster than a real agent: raise the
            # flood limit to match, or the limiter, not the recording path, sets the figure.
            per_interval = max(4.0, args.rate / args.nodes * interval * 2)
            controller = Controller(
                real_env(store, bus=bus, seed=1),
                MemoryCommandQueue(),
                ControllerConfig(
                    health=HealthPolicy(heartbeat_interval=interval),
                    heartbeat_rate_per_interval=per_interval,
                ),
            )
            # The whole of `gpumesh controller`: every event also published to JetStream.
            outbox = OutboxPublisher(store, bus) if args.production else None
            latencies: list[float] = []
            offline_at: list[float] = []  # when each node was declared offline
            load_started = load_ended = float("inf")
            counted = 0
            window: list[float] = []

            async def observe() -> None:
                nonlocal counted
                async for envelope in store.subscribe(1):
                    payload = envelope.payload
                    if isinstance(payload, NodeHealthChanged) and payload.state == "offline":
                        offline_at.append(time.perf_counter())
                    if isinstance(envelope.payload, NodeHeartbeat) and envelope.payload.sent_at_ns:
                        counted += 1
                        now = time.time_ns()
                        latencies.append((now - envelope.payload.sent_at_ns) / 1e6)
                        window.append(time.perf_counter())

            async with asyncio.TaskGroup() as tg:
                extra = [outbox.run] if outbox is not None else []
                ctl = tg.create_task(controller.run(extra=extra))
                await controller.ready.wait()
                obs = tg.create_task(observe())
                cpu0 = time.process_time()
                gen = await asyncio.create_subprocess_exec(
                    sys.executable,
                    __file__,
                    "--generator",
                    "--url",
                    url,
                    "--nodes",
                    str(args.nodes),
                    "--rate",
                    str(args.rate),
                    "--seconds",
                    str(args.seconds),
                    *(["--leases"] if args.production else []),
                    stdout=subprocess.PIPE,
                )
                assert gen.stdout is not None
                await gen.stdout.readline()  # registration done: the load begins
                load_started = time.perf_counter()
                spy = await _py_spy(args.py_spy, args.seconds)
                out = await gen.stdout.read()
                await gen.wait()
                load_ended = time.perf_counter()
                generated = json.loads(out)
                sent = generated["sent"]
                generator_cpu = _children_cpu()
                if spy is not None:
                    await spy.wait()
                # Let the tail drain, up to 10 s.
                deadline = time.perf_counter() + 10
                while counted < sent and time.perf_counter() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(0.1)
                cpu = time.process_time() - cpu0
                if server_pid is not None:
                    nats_cpu = _process_cpu(server_pid)
                else:  # the three servers of the cluster, children of this process
                    found = [_process_cpu(pid) for pid in _nats_children()]
                    nats_cpu = sum(c for c in found if c is not None) if found else None
                ctl.cancel()
                obs.cancel()
            await underneath.close()
            await bus.close()
    # Steady state: drop the first and last 10% of commit times.
    steady = window[len(window) // 10 : len(window) * 9 // 10] or window
    span = (steady[-1] - steady[0]) if len(steady) > 1 else float("nan")
    rate = (len(steady) - 1) / span if len(steady) > 1 else 0.0
    latencies.sort()
    return {
        "store": args.store,
        "fenced": args.store != "sqlite" and not args.unfenced,
        "nodes": args.nodes,
        "offered_per_second": args.rate,
        "sent": sent,
        "recorded": counted,
        "dropped_by_controller": dict(controller.dropped),
        "recorded_per_second": round(rate),
        "target_per_second": TARGET,
        "meets_target": rate >= TARGET,
        "latency_ms_p50": round(statistics.median(latencies), 2) if latencies else None,
        "latency_ms_p99": round(latencies[int(len(latencies) * 0.99)], 2) if latencies else None,
        "controller_cpu_seconds": round(cpu, 2),
        "controller_cpu_us_per_heartbeat": round(cpu / max(1, counted) * 1e6, 1),
        "gc": args.gc,
        # Every node beats throughout the load: an offline verdict then is false. (Before it,
        # the first nodes wait silent for the others to register, and a verdict on that may
        # land in the first second of the load; after it, the bench has stopped its nodes.)
        "declared_offline_during_load": sum(
            1 for t in offline_at if load_started + 1.0 < t < load_ended
        ),
        "production_path": args.production,
        "outbox_published": outbox.published if outbox is not None else None,
        "lease_acks_received": generated["acks"] if args.production else None,
        # The same machine runs the load and the server: what they took from the controller.
        "generator_cpu_seconds": round(generator_cpu, 2),
        "nats_server_cpu_seconds": round(nats_cpu, 2) if nats_cpu is not None else None,
    }


async def _py_spy(out: str | None, seconds: float) -> asyncio.subprocess.Process | None:
    """py-spy sampling this process during the load only (raw collapsed stacks to `out`)."""
    if not out:
        return None
    spy = Path(sys.executable).with_name("py-spy")
    return await asyncio.create_subprocess_exec(
        str(spy),
        "record",
        "--pid",
        str(os.getpid()),
        "--duration",
        str(int(seconds)),
        "--rate",
        "250",
        "--format",
        "raw",
        "--output",
        out,
        "--nonblocking",
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _nats_children() -> list[int]:
    """The nats-server processes this one started (Linux only)."""
    pids: list[int] = []
    for children in Path("/proc/self/task").glob("*/children"):
        for pid in children.read_text().split():
            with contextlib.suppress(OSError):
                if Path(f"/proc/{pid}/comm").read_text().strip() == "nats-server":
                    pids.append(int(pid))
    return pids


def _process_cpu(pid: int | None) -> float | None:
    """User plus system CPU seconds of a running process, from /proc (Linux only)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=2000)
    parser.add_argument("--rate", type=float, default=20_000, help="heartbeats offered per second")
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument(
        "--gc",
        choices=("tuned", "default"),
        default="tuned",
        help="the collector as `gpumesh controller` sets it (tuned) or CPython's default",
    )
    parser.add_argument(
        "--production",
        action="store_true",
        help="also run the outbox (every event to JetStream) and ask for a lease with every "
        "heartbeat, as `gpumesh controller` and real agents do",
    )
    parser.add_argument(
        "--store",
        choices=("sqlite", "jetstream-r3"),
        default="sqlite",
        help="the log of record: SQLite (FULL) on one nats-server, or the JetStream store on "
        "an R3 stream of three local servers with sync_interval always",
    )
    parser.add_argument(
        "--unfenced",
        action="store_true",
        help="jetstream-r3: the bare store, not fenced on a term as a leader's is",
    )
    parser.add_argument("--json", action="store_true")
    add_quick(parser, " ".join(f"--{k} {v:g}" for k, v in QUICK.items()))
    parser.add_argument("--leases", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--generator", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument(
        "--py-spy",
        metavar="OUT",
        help="sample this process with py-spy during the load only (not the registration), "
        "collapsed stacks to OUT; needs `.venv/bin/pip install py-spy`",
    )
    args = parser.parse_args()
    if args.generator:
        asyncio.run(generate(args.url, args.nodes, args.rate, args.seconds, args.leases))
        return 0
    apply_quick(parser, args, **QUICK)
    configure_logging(level="warning", json=False, stream=sys.stderr)
    if args.gc == "tuned":
        tune_collector()
    announce(args, json_output=args.json)
    result = mark(args, asyncio.run(measure(args)))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:34} {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
