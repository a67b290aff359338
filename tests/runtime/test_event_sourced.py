"""EventSourcedActor: persist, recover, snapshots, conflicts."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace
from typing import ClassVar

import msgspec
import pytest

from events import (
    ConcurrencyConflict,
    DomainEvent,
    Envelope,
    EventStore,
    MemoryEventStore,
    NewEvent,
    NodeDrained,
    NodeRegistered,
    Snapshot,
    Undecodable,
)
from runtime import ActorContext, ActorSystem, Env, EventSourcedActor, RecoveryFailed

STREAM = "node/n1"


class NodeState(msgspec.Struct, frozen=True):
    registered: bool = False
    hostname: str = ""
    beats: int = 0
    last_seq: int = -1


@dataclass(frozen=True)
class Register:
    hostname: str


@dataclass(frozen=True)
class Beat:
    seq: int
    count: int = 1


@dataclass(frozen=True)
class Get:
    pass


Command = Register | Beat | Get


class Node(EventSourcedActor[Command, NodeState]):
    snapshot_type: type[NodeState] | None = NodeState
    snapshot_every: ClassVar[int] = 3

    @property
    def stream(self) -> str:
        return STREAM

    def initial_state(self) -> NodeState:
        return NodeState()

    def evolve(self, state: NodeState, payload: DomainEvent) -> NodeState:
        match payload:
            case NodeRegistered(hostname=hostname):
                return msgspec.structs.replace(state, registered=True, hostname=hostname)
            case NodeDrained(reason=seq):  # a beat, as any node-stream event of its own can be
                return msgspec.structs.replace(state, beats=state.beats + 1, last_seq=int(seq))
        return state

    async def handle(self, ctx: ActorContext[Command], msg: Command) -> object:
        match msg:
            case Register(hostname=hostname):
                await self.persist(ctx, [NodeRegistered(node_id="n1", hostname=hostname)])
            case Beat(seq=seq, count=count):
                beats = [NodeDrained(node_id="n1", reason=str(seq + i)) for i in range(count)]
                await self.persist(ctx, beats, causation_id=f"beat-{seq}")
            case Get():
                pass
        return (self.state, self.version)


class NodeWithoutSnapshots(Node):
    snapshot_type = None


class SnapshotV2(Node):
    snapshot_version: ClassVar[int] = 2


class Hidden:
    """Wraps a store and can hide its snapshots or record reads."""

    def __init__(self, inner: MemoryEventStore, *, hide_snapshots: bool = False) -> None:
        self.inner = inner
        self.hide_snapshots = hide_snapshots
        self.reads: list[int] = []

    async def append(
        self, stream: str, events: Sequence[NewEvent], expected_version: int
    ) -> list[int]:
        return await self.inner.append(stream, events, expected_version)

    async def read_stream(self, stream: str, from_version: int = 1) -> list[Envelope]:
        self.reads.append(from_version)
        return await self.inner.read_stream(stream, from_version)

    async def stream_version(self, stream: str) -> int:
        return await self.inner.stream_version(stream)

    async def read_all(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        return await self.inner.read_all(from_position, limit)

    def subscribe(self, from_position: int = 1) -> AsyncGenerator[Envelope, None]:
        return self.inner.subscribe(from_position)

    async def head(self) -> int:
        return await self.inner.head()

    async def compact_heartbeats(self, older_than_ns: int) -> int:
        return await self.inner.compact_heartbeats(older_than_ns)

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        await self.inner.save_snapshot(snapshot)

    async def load_snapshot(self, stream: str) -> Snapshot | None:
        return None if self.hide_snapshots else await self.inner.load_snapshot(stream)

    async def close(self) -> None:
        await self.inner.close()


def with_store(env: Env, store: EventStore) -> Env:
    return replace(env, store=store)


async def recovered(env: Env, factory: type[Node] = Node) -> tuple[NodeState, int]:
    async with ActorSystem(env) as system:
        ref = await system.spawn(factory, "node")
        state, version = await ref.ask(Get(), expect=tuple)
        return state, version


@pytest.fixture
def store() -> MemoryEventStore:
    return MemoryEventStore()


async def fill(env: Env, *, beats: int) -> tuple[NodeState, int]:
    async with ActorSystem(env) as system:
        ref = await system.spawn(Node, "node")
        await ref.ask(Register("gpu-host-1"))
        for seq in range(beats):
            await ref.tell(Beat(seq))
        state, version = await ref.ask(Get(), expect=tuple)
        return state, version


async def test_persisted_events_are_in_the_store_and_folded_into_state(
    env: Env, store: MemoryEventStore
) -> None:
    env = with_store(env, store)
    state, version = await fill(env, beats=4)
    assert state == NodeState(registered=True, hostname="gpu-host-1", beats=4, last_seq=3)
    assert version == 5
    stored = await store.read_stream(STREAM)
    assert [e.version for e in stored] == [1, 2, 3, 4, 5]
    assert [e.type for e in stored][:2] == ["node.registered.v1", "node.drained.v1"]
    assert stored[1].causation_id == "beat-0"
    assert all(e.recorded_at > 0 for e in stored)


async def test_a_batch_is_one_append_sharing_a_correlation_id(
    env: Env, store: MemoryEventStore
) -> None:
    env = with_store(env, store)
    async with ActorSystem(env) as system:
        ref = await system.spawn(NodeWithoutSnapshots, "node")
        _, version = await ref.ask(Beat(10, count=3), expect=tuple)
    stored = await store.read_stream(STREAM)
    assert version == 3
    assert len({e.correlation_id for e in stored}) == 1
    assert stored[0].correlation_id == stored[0].event_id
    assert [e.position for e in stored] == [1, 2, 3]


async def test_a_restarted_actor_recovers_its_state_from_the_store(
    env: Env, store: MemoryEventStore
) -> None:
    env = with_store(env, store)
    expected = await fill(env, beats=7)
    assert await recovered(env) == expected
    assert await recovered(env, NodeWithoutSnapshots) == expected


async def test_snapshots_are_taken_every_n_events_and_recovery_reads_only_the_tail(
    env: Env, store: MemoryEventStore
) -> None:
    await fill(with_store(env, store), beats=7)  # versions 1..8: snapshots at 3 and 6
    snapshot = await store.load_snapshot(STREAM)
    assert snapshot is not None
    assert snapshot.version == 6
    assert snapshot.schema == "tests.runtime.test_event_sourced.NodeState/v1"
    assert msgspec.msgpack.decode(snapshot.state, type=NodeState).beats == 5
    spy = Hidden(store)
    state, version = await recovered(with_store(env, spy))
    assert spy.reads == [7]
    assert (state.beats, version) == (7, 8)


async def test_deleting_every_snapshot_does_not_change_the_recovered_state(
    env: Env, store: MemoryEventStore
) -> None:
    expected = await fill(with_store(env, store), beats=11)
    with_snapshots = await recovered(with_store(env, store))
    hidden = Hidden(store, hide_snapshots=True)
    without_snapshots = await recovered(with_store(env, hidden))
    assert hidden.reads == [1]  # a full replay
    assert with_snapshots == without_snapshots == expected


async def test_a_snapshot_of_another_schema_version_is_ignored(
    env: Env, store: MemoryEventStore
) -> None:
    expected = await fill(with_store(env, store), beats=5)
    spy = Hidden(store)
    assert await recovered(with_store(env, spy), SnapshotV2) == expected
    assert spy.reads == [1]


async def test_an_unreadable_snapshot_is_a_cache_miss(env: Env, store: MemoryEventStore) -> None:
    expected = await fill(with_store(env, store), beats=5)
    await store.save_snapshot(
        Snapshot(
            stream=STREAM,
            version=6,
            schema="tests.runtime.test_event_sourced.NodeState/v1",
            state=b"\xc1 not msgpack",
        )
    )
    assert await recovered(with_store(env, store)) == expected


async def test_a_conflict_reloads_the_state_and_reraises(env: Env, store: MemoryEventStore) -> None:
    env = with_store(env, store)
    async with ActorSystem(env) as system:
        ref = await system.spawn(Node, "node")
        await ref.ask(Register("gpu-host-1"))
        # Another writer appends behind the actor's back.
        rival = env.new_event(NodeDrained(node_id="n1", reason="100"))
        await store.append(STREAM, [rival], expected_version=1)
        with pytest.raises(ConcurrencyConflict) as info:
            await ref.ask(Beat(0))
        assert (info.value.expected, info.value.actual) == (1, 2)
        state, version = await ref.ask(Get(), expect=tuple)
        assert (state.last_seq, version) == (100, 2)  # caught up with the rival's event
        _, version = await ref.ask(Beat(1), expect=tuple)  # the retry succeeds
        assert version == 3


async def test_an_undecodable_event_fails_recovery(env: Env, store: MemoryEventStore) -> None:
    await fill(with_store(env, store), beats=1)

    class Corrupting(Hidden):
        async def read_stream(self, stream: str, from_version: int = 1) -> list[Envelope]:
            events = await super().read_stream(stream, from_version)
            broken = Undecodable(raw=b"??", error="unknown tag 'node.teleported.v9'")
            return [*events, msgspec.structs.replace(events[-1], version=3, payload=broken)]

    async with ActorSystem(with_store(env, Corrupting(store, hide_snapshots=True))) as system:
        with pytest.raises(RecoveryFailed, match=r"node\.teleported\.v9") as info:
            await system.spawn(Node, "node")
    assert (info.value.stream, info.value.version) == (STREAM, 3)


async def test_a_failing_snapshot_write_does_not_fail_the_persist(
    env: Env, store: MemoryEventStore
) -> None:
    class NoSnapshots(Hidden):
        async def save_snapshot(self, snapshot: Snapshot) -> None:
            raise OSError("disk full")

    state, version = await fill(with_store(env, NoSnapshots(store)), beats=5)
    assert (state.beats, version) == (5, 6)
    assert await store.load_snapshot(STREAM) is None


async def test_recovery_happens_before_the_first_message(env: Env, store: MemoryEventStore) -> None:
    await fill(with_store(env, store), beats=2)
    seen: list[int] = []

    class Watcher(Node):
        async def on_recovered(self, ctx: ActorContext[Command]) -> None:
            await asyncio.sleep(0)
            seen.append(self.version)

    await recovered(with_store(env, store), Watcher)
    assert seen == [3]
