"""A small seeded simulation whose printed trace must not depend on PYTHONHASHSEED.

It deliberately uses what usually breaks reproducibility: sets and dicts of strings, random
draws, generated ids, timers with colliding deadlines, and several actors interleaving.
Run: `python -m tests.sim.scenario SEED`.
"""

from __future__ import annotations

import asyncio
import hashlib
import sys
from dataclasses import dataclass
from functools import partial

import msgspec
import structlog

from events import DomainEvent, MemoryEventStore, NodeDrained, NodeRegistered
from runtime import Actor, ActorContext, ActorRef, ActorSystem, Env, EventSourcedActor
from sim import run_simulation, sim_env, stamp_sim_time

NODES = {"gpu-c", "gpu-a", "gpu-d", "gpu-b", "gpu-e"}  # a set: iteration order varies by hash
LABELS = {"zone": "eu-1", "arch": "h100", "tier": "spot"}


@dataclass(frozen=True)
class Tick:
    pass


@dataclass(frozen=True)
class Seen:
    node: str
    seq: int
    at: float


class Counts(msgspec.Struct):
    beats: int = 0


class NodeAgent(EventSourcedActor[Tick, Counts]):
    def __init__(self, node: str, tracker: ActorRef[Seen], trace: list[str]) -> None:
        self.node = node
        self.tracker = tracker
        self.trace = trace

    @property
    def stream(self) -> str:
        return f"node/{self.node}"

    def initial_state(self) -> Counts:
        return Counts()

    def evolve(self, state: Counts, payload: DomainEvent) -> Counts:
        # A drain per beat: any node-stream event does (heartbeats have a stream of their own).
        if isinstance(payload, NodeDrained):
            return Counts(beats=state.beats + 1)
        return state

    async def on_recovered(self, ctx: ActorContext[Tick]) -> None:
        labels = {key: LABELS[key] for key in sorted(LABELS)}
        await self.persist(ctx, [NodeRegistered(node_id=self.node, labels=labels)])
        ctx.create_task(self.timer(ctx), name="heartbeat")

    async def timer(self, ctx: ActorContext[Tick]) -> None:
        rng = ctx.env.derive_rng(f"timer:{self.node}")
        while True:
            # Whole seconds so that several nodes often fire at the same instant.
            await asyncio.sleep(rng.randint(1, 4))
            await ctx.self_ref.tell(Tick())

    async def handle(self, ctx: ActorContext[Tick], msg: Tick) -> object:
        seq = self.state.beats
        await self.persist(ctx, [NodeDrained(node_id=self.node, reason=f"beat {seq}")])
        now = asyncio.get_running_loop().time()
        self.trace.append(f"{now:10.3f} {self.node} beat={seq} id={ctx.env.new_id()}")
        await self.tracker.tell(Seen(self.node, seq, now))
        return None


class Tracker(Actor[Seen]):
    """Keeps a dict keyed by node name: its order is first-heartbeat order, not hash order."""

    def __init__(self, trace: list[str]) -> None:
        self.last: dict[str, int] = {}
        self.trace = trace

    async def handle(self, ctx: ActorContext[Seen], msg: Seen) -> object:
        self.last[msg.node] = msg.seq
        if ctx.env.rng.random() < 0.1:
            self.trace.append(f"{msg.at:10.3f} tracker sample {msg.node} {self.last}")
        return None

    async def on_stop(self, ctx: ActorContext[Seen]) -> None:
        self.trace.append(f"tracker final {self.last}")


async def scenario(seed: int, *, seconds: float = 60.0) -> list[str]:
    store = MemoryEventStore()
    env: Env = sim_env(seed, store)
    trace: list[str] = [f"seed={seed} draw={env.derive_rng('scenario').random():.12f}"]
    async with ActorSystem(env) as system:
        tracker = await system.spawn(lambda: Tracker(trace), "tracker")
        for node in sorted(NODES):
            await system.spawn(
                partial(NodeAgent, node, tracker, trace), node, context={"node": node}
            )
        await asyncio.sleep(seconds)
    digest = hashlib.sha256()
    for envelope in store.read_all_now():
        digest.update(msgspec.msgpack.encode(envelope))
    trace.append(f"events={len(store.read_all_now())} digest={digest.hexdigest()}")
    return trace


def main(argv: list[str]) -> None:
    # The runtime's own log lines are part of the output that must repeat: stamp them with
    # virtual time and render keys sorted.
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            stamp_sim_time,
            structlog.processors.KeyValueRenderer(sort_keys=True),
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
    )
    for line in run_simulation(scenario(int(argv[0]))):
        print(line)


if __name__ == "__main__":
    main(sys.argv[1:])
