"""What one heartbeat's production work costs with no event loop, no network and no tasks.

    python bench/heartbeat_steps.py [--nodes 1000] [--beats 20] [--json] [--quick]

Each step a recorded heartbeat takes through the production code, timed on its own in a
plain loop over `--nodes` x `--beats` heartbeats (2 fake GPUs per node and 1 replica, as in
bench/sim.py): the agent's probe, building and encoding the heartbeat; the controller's intake
checks, decode and verdict check, its lease answer and the agent's handling of it; the event
built and appended to the in-memory store; the live state's fold. Microseconds per heartbeat.

The sum is a floor under what the simulator can reach with this production code, whatever the
loop, the network model or the tasks around it cost: bench/sim.py's speed target at N nodes
(heartbeat every second) leaves `1e6 / (target x N)` microseconds for everything a heartbeat
does, and `bench/sim.py --floor` measures the loop's bare share of that.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import msgspec  # noqa: E402

import projections  # noqa: E402
from actors.health import HealthPolicy  # noqa: E402
from actors.heartbeat_recorder import NodeLiveness, heartbeat_event  # noqa: E402
from actors.intake_limit import IntakeLimiter  # noqa: E402
from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from events import NodeRegistered, new_event, stream_name  # noqa: E402
from events.contract import subjects  # noqa: E402
from events.contract.messages import Heartbeat, HeartbeatAck, ReplicaLease, ReplicaState  # noqa: E402
from events.memory_store import MemoryEventStore  # noqa: E402
from nodeagent.gpu import FakeGpuProbe  # noqa: E402
from projections import FleetState  # noqa: E402

TARGETS = {1_000: 50.0, 10_000: 5.0}
QUICK = {"nodes": 100, "beats": 3}


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def monotonic(self) -> float:
        return self.t

    def wall_ns(self) -> int:
        return 1_767_225_600_000_000_000 + round(self.t * 1e9)


def run_coro(coro: Any) -> Any:
    """Drive a coroutine that never suspends (the fake probe) to its result."""
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the coroutine suspended")


def timed(label: str, count: int, fn: Callable[[], None], out: dict[str, float]) -> None:
    started = time.perf_counter()
    fn()
    out[label] = (time.perf_counter() - started) * 1e6 / count


def measure(nodes: int, beats: int) -> dict[str, float]:
    rng = random.Random(1)
    ids = [f"node-{i}" for i in range(nodes)]
    probes = [FakeGpuProbe.parse("RTX4090:24GiB:2", rng=rng, node_id=n) for n in ids]
    replica = ReplicaState(replica_id="llama-0", epoch=1, state="ready", port=9000)
    clock = Clock()
    policy = HealthPolicy()
    count = nodes * beats
    out: dict[str, float] = {}

    samples: list[Any] = []
    timed(
        "agent: probe (fake GPUs, 2)",
        count,
        lambda: samples.extend(run_coro(p.sample()) for _ in range(beats) for p in probes),
        out,
    )
    beats_: list[Heartbeat] = []

    def build() -> None:
        for i in range(count):
            beats_.append(
                Heartbeat(
                    node_id=ids[i % nodes],
                    seq=i // nodes + 1,
                    gpus=samples[i],
                    replicas=(replica,),
                )
            )

    timed("agent: build the Heartbeat", count, build, out)
    wire: list[bytes] = []
    encode = msgspec.json.encode
    timed("agent: encode", count, lambda: wire.extend(encode(b) for b in beats_), out)

    limiter = IntakeLimiter(clock, rate_per_s=4.0, burst=8.0)
    liveness = NodeLiveness()
    decoded: list[Heartbeat] = []
    subject = [subjects.heartbeat(n) for n in ids]

    def intake() -> None:
        decode = msgspec.json.Decoder(Heartbeat).decode
        for i, data in enumerate(wire):
            if i % nodes == 0:
                clock.t += 1.0
            sender = subjects.node_of(subject[i % nodes])
            limiter.admit(sender)
            hb = decode(data)
            liveness.heard(hb.node_id, clock.t)
            liveness.may_change_verdict(hb, policy)
            decoded.append(hb)

    timed("controller: intake checks, decode, verdict check", count, intake, out)
    acks: list[bytes] = []
    leases = (ReplicaLease(replica_id="llama-0", epoch=1),)

    def answer() -> None:
        for hb in decoded:
            ack = HeartbeatAck(node_id=hb.node_id, seq=hb.seq, lease_s=2.4, replicas=leases)
            acks.append(encode(ack))

    timed("controller: lease answer, build and encode", count, answer, out)

    def take_lease() -> None:
        decode = msgspec.json.Decoder(HeartbeatAck).decode
        held: dict[str, Any] = {}
        for data in acks:
            ack = decode(data)
            held[ack.node_id] = frozenset((r.replica_id, r.epoch) for r in ack.replicas)

    timed("agent: lease, decode and apply", count, take_lease, out)

    store = MemoryEventStore()
    state = FleetState()
    for n in ids:  # registered nodes, as in a run: the fold has a node to update
        event = new_event(
            NodeRegistered(node_id=n, hostname=n, address="", region="eu-west", zone="a"),
            wall_ns=clock.wall_ns(),
            entropy=rng,
        )
        store.append_now(stream_name("node", n), [event], 0)
    for envelope in store._log:
        projections.apply(state, envelope)
    streams = [stream_name("heartbeat", n) for n in ids]

    def record() -> None:
        for i, hb in enumerate(decoded):
            event = new_event(heartbeat_event(hb), wall_ns=clock.wall_ns(), entropy=rng)
            store.append_now(streams[i % nodes], [event], i // nodes)

    timed("recorder: event, id, append", count, record, out)
    log = store._log[nodes:]
    timed("live state: fold", count, lambda: [projections.apply(state, e) for e in log], out)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--beats", type=int, default=20, help="heartbeats per node")
    parser.add_argument("--json", action="store_true")
    add_quick(parser, f"--nodes {QUICK['nodes']} --beats {QUICK['beats']}")
    args = parser.parse_args()
    apply_quick(parser, args, **QUICK)
    announce(args, json_output=args.json)
    steps = measure(args.nodes, args.beats)
    total = sum(steps.values())
    if args.json:
        print(json.dumps(mark(args, {"steps_us": steps, "total_us": total}), indent=2))
        return
    width = max(map(len, steps))
    for label, us in steps.items():
        print(f"  {label:<{width}}  {us:6.2f} us")
    print(f"  {'sum':<{width}}  {total:6.2f} us per heartbeat")
    for nodes, target in TARGETS.items():
        budget = 1e6 / (target * nodes)
        print(
            f"  {nodes:,} nodes at {target:g}x: {budget:.0f} us per heartbeat for everything;"
            f" these steps alone allow {1e6 / (total * nodes):.1f}x"
        )
    print(f"\ncommand: python bench/heartbeat_steps.py --nodes {args.nodes} --beats {args.beats}")


if __name__ == "__main__":
    main()
