"""The contract every EventStore honours. Runs against the in-memory and the SQLite store."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from events import (
    ANY,
    NO_STREAM,
    ConcurrencyConflict,
    DuplicateEventId,
    Envelope,
    EventStore,
    InvalidAppend,
    NodeDrained,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRegistered,
    Snapshot,
    StoreClosed,
)
from tests.factories import EventMaker


def hb(node: str, seq: int) -> NodeHeartbeat:
    return NodeHeartbeat(node_id=node, seq=seq)


def note(node: str, seq: int) -> NodeDrained:
    """Any event of a node's own stream (heartbeats have a stream of their own)."""
    return NodeDrained(node_id=node, reason=f"note {seq}")


async def test_first_append_assigns_versions_and_positions(store: EventStore) -> None:
    make = EventMaker()
    batch = [make(NodeRegistered(node_id="a")), make(note("a", 1))]
    positions = await store.append("node/a", batch, NO_STREAM)
    assert positions == [1, 2]
    read = await store.read_stream("node/a")
    assert [e.version for e in read] == [1, 2]
    assert [e.position for e in read] == [1, 2]
    assert [e.event_id for e in read] == [e.event_id for e in batch]
    assert read[0].type == "node.registered.v1"
    assert read[1].payload == note("a", 1)
    assert read[0].recorded_at == batch[0].recorded_at
    assert read[0].correlation_id == batch[0].correlation_id
    assert await store.stream_version("node/a") == 2
    assert await store.stream_version("node/nobody") == 0
    assert await store.head() == 2


async def test_wrong_expected_version_raises_conflict_with_details(store: EventStore) -> None:
    make = EventMaker()
    await store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
    with pytest.raises(ConcurrencyConflict) as info:
        await store.append("node/a", [make(note("a", 1))], 5)
    assert (info.value.stream, info.value.expected, info.value.actual) == ("node/a", 5, 1)
    with pytest.raises(ConcurrencyConflict) as info:
        await store.append("node/a", [make(note("a", 1))], NO_STREAM)
    assert info.value.actual == 1
    assert await store.head() == 1


async def test_any_skips_the_version_check(store: EventStore) -> None:
    make = EventMaker()
    await store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
    await store.append("node/a", [make(note("a", 1))], ANY)
    assert await store.stream_version("node/a") == 2


async def test_retried_append_is_a_no_op(store: EventStore) -> None:
    make = EventMaker()
    batch = [make(NodeRegistered(node_id="a")), make(note("a", 1))]
    first = await store.append("node/a", batch, NO_STREAM)
    await store.append("node/b", [make(NodeRegistered(node_id="b"))], NO_STREAM)
    again = await store.append("node/a", batch, NO_STREAM)
    assert again == first
    assert await store.head() == 3
    assert len(await store.read_stream("node/a")) == 2


async def test_event_id_reused_in_another_stream_is_refused(store: EventStore) -> None:
    make = EventMaker()
    event = make(NodeRegistered(node_id="a"))
    await store.append("node/a", [event], NO_STREAM)
    stolen = type(event)(
        event_id=event.event_id,
        payload=NodeRegistered(node_id="b"),
        recorded_at=event.recorded_at,
    )
    with pytest.raises(DuplicateEventId):
        await store.append("node/b", [stolen], NO_STREAM)
    assert await store.stream_version("node/b") == 0


async def test_event_for_another_stream_is_refused(store: EventStore) -> None:
    make = EventMaker()
    with pytest.raises(InvalidAppend, match="belongs to stream 'node/b'"):
        await store.append("node/a", [make(note("b", 1))], NO_STREAM)
    with pytest.raises(InvalidAppend):
        await store.append("node/a.b", [make(note("a.b", 1))], NO_STREAM)
    assert await store.head() == 0


async def test_empty_append_writes_nothing(store: EventStore) -> None:
    assert await store.append("node/a", [], NO_STREAM) == []
    assert await store.head() == 0


async def test_read_stream_from_version(store: EventStore) -> None:
    make = EventMaker()
    await store.append("node/a", [make(note("a", i)) for i in range(5)], NO_STREAM)
    tail = await store.read_stream("node/a", from_version=4)
    assert [e.version for e in tail] == [4, 5]
    assert await store.read_stream("node/missing") == []


async def test_read_all_pages_in_commit_order(store: EventStore) -> None:
    make = EventMaker()
    for i in range(10):
        node = f"n{i % 3}"
        version = await store.stream_version(f"heartbeat/{node}")
        await store.append(f"heartbeat/{node}", [make(hb(node, i))], version)
    page1 = await store.read_all(1, 4)
    page2 = await store.read_all(page1[-1].position + 1, 4)
    page3 = await store.read_all(page2[-1].position + 1, 4)
    everything = page1 + page2 + page3
    assert [e.position for e in everything] == list(range(1, 11))
    assert [e.payload.seq for e in everything if isinstance(e.payload, NodeHeartbeat)] == list(
        range(10)
    )
    assert await store.read_all(11, 4) == []


async def test_concurrent_writers_on_one_stream_exactly_one_wins(store: EventStore) -> None:
    make = EventMaker()
    await store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
    attempts = [store.append("node/a", [make(note("a", i))], 1) for i in range(20)]
    results = await asyncio.gather(*attempts, return_exceptions=True)
    winners = [r for r in results if isinstance(r, list)]
    losers = [r for r in results if isinstance(r, ConcurrencyConflict)]
    assert len(winners) == 1
    assert len(losers) == 19
    assert all(c.actual == 2 for c in losers)
    assert await store.stream_version("node/a") == 2


async def test_concurrent_writers_on_many_streams_all_commit_gaplessly(store: EventStore) -> None:
    make = EventMaker()
    appends = [
        store.append(
            f"node/n{i}", [make(NodeRegistered(node_id=f"n{i}")), make(note(f"n{i}", 0))], NO_STREAM
        )
        for i in range(200)
    ]
    results = await asyncio.gather(*appends)
    positions = sorted(p for r in results for p in r)
    assert positions == list(range(1, 401))
    for r in results:
        assert r[1] == r[0] + 1  # an append's events are contiguous in the log


async def test_subscribe_catches_up_then_follows_live_without_gap_or_duplicate(
    store: EventStore,
) -> None:
    make = EventMaker()
    for i in range(30):
        await store.append("node/a", [make(note("a", i))], i)
    seen: list[Envelope] = []
    enough = asyncio.Event()

    async def consume() -> None:
        async for envelope in store.subscribe(from_position=5):
            seen.append(envelope)
            if len(seen) == 26 + 50:
                enough.set()
                return

    async def produce() -> None:
        for i in range(30, 80):
            await store.append("node/a", [make(note("a", i))], i)
            if i % 7 == 0:
                await asyncio.sleep(0)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(consume())
        tg.create_task(produce())
        await asyncio.wait_for(enough.wait(), timeout=10)
    assert [e.position for e in seen] == list(range(5, 81))


async def test_subscribe_batches_gives_the_same_events_a_commit_at_a_time(
    store: EventStore,
) -> None:
    make = EventMaker()
    for i in range(30):
        await store.append("node/a", [make(note("a", i))], i)
    batches: list[list[int]] = []
    enough = asyncio.Event()
    live = asyncio.Event()

    async def consume() -> None:
        async with contextlib.aclosing(store.subscribe_batches(from_position=5)) as pages:
            async for batch in pages:
                batches.append([e.position for e in batch])
                if batches[-1][-1] == 30:
                    live.set()  # caught up: what follows arrives as it is committed
                if batches[-1][-1] == 80:
                    enough.set()
                    return

    async def produce() -> None:
        await live.wait()
        for i in range(30, 80, 10):  # five commits of ten events each
            events = [make(note("a", j)) for j in range(i, i + 10)]
            await store.append("node/a", events, i)
            await asyncio.sleep(0.01)

    async with asyncio.TaskGroup() as tg:
        tg.create_task(consume())
        tg.create_task(produce())
        await asyncio.wait_for(enough.wait(), timeout=10)
    assert [p for batch in batches for p in batch] == list(range(5, 81))  # no gap, no repeat
    assert all(batches)  # never an empty list
    assert batches[-5:] == [list(range(i, i + 10)) for i in range(31, 81, 10)]  # one per commit


async def test_subscription_ends_when_the_store_closes(store: EventStore) -> None:
    make = EventMaker()
    await store.append("node/a", [make(note("a", 0))], NO_STREAM)
    got: list[int] = []
    first = asyncio.Event()

    async def consume() -> None:
        async for envelope in store.subscribe():
            got.append(envelope.position)
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), timeout=5)
    await store.close()
    await asyncio.wait_for(task, timeout=5)
    assert got == [1]
    with pytest.raises(StoreClosed):
        await store.append("node/a", [make(note("a", 1))], 1)


async def test_heartbeat_compaction_keeps_latest_and_other_events(store: EventStore) -> None:
    make = EventMaker(step_ns=1_000_000_000)
    await store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
    await store.append("heartbeat/a", [make(hb("a", i)) for i in range(5)], NO_STREAM)
    await store.append(
        "node/a", [make(NodeHealthChanged(node_id="a", state="degraded", reason="thermal"))], 1
    )
    await store.append("heartbeat/a", [make(hb("a", 5))], 5)
    await store.append("heartbeat/b", [make(hb("b", 0))], NO_STREAM)
    cutoff = make.now_ns + 1  # everything is old enough
    removed = await store.compact_heartbeats(cutoff)
    assert removed == 5
    assert [e.type for e in await store.read_stream("node/a")] == [
        "node.registered.v1",
        "node.health_changed.v1",
    ]
    remaining = await store.read_stream("heartbeat/a")
    assert [e.payload for e in remaining] == [hb("a", 5)]
    assert remaining[0].version == 6
    assert [e.type for e in await store.read_stream("heartbeat/b")] == ["node.heartbeat.v1"]
    assert await store.stream_version("heartbeat/a") == 6
    # Appends continue at the right version after compaction.
    await store.append("heartbeat/a", [make(hb("a", 6))], 6)
    # hb 5 is no longer the latest and is older than the cutoff; hb 6 is newer than it.
    assert await store.compact_heartbeats(cutoff) == 1
    assert await store.compact_heartbeats(cutoff) == 0


async def test_compaction_respects_the_age_cutoff(store: EventStore) -> None:
    make = EventMaker(step_ns=1_000_000_000)
    await store.append("heartbeat/a", [make(hb("a", i)) for i in range(10)], NO_STREAM)
    events = await store.read_stream("heartbeat/a")
    cutoff = events[4].recorded_at  # the first four are older than the cutoff
    assert await store.compact_heartbeats(cutoff) == 4
    assert [e.version for e in await store.read_stream("heartbeat/a")] == list(range(5, 11))


async def test_snapshots_round_trip_and_latest_wins(store: EventStore) -> None:
    assert await store.load_snapshot("node/a") is None
    await store.save_snapshot(Snapshot(stream="node/a", version=3, schema="s1", state=b"x"))
    await store.save_snapshot(Snapshot(stream="node/a", version=9, schema="s1", state=b"y"))
    got = await store.load_snapshot("node/a")
    assert got == Snapshot(stream="node/a", version=9, schema="s1", state=b"y")


async def test_queued_appends_to_one_stream_apply_in_call_order(store: EventStore) -> None:
    """Appends issued back to back with consecutive versions all commit, even in one batch."""
    make = EventMaker()
    results = await asyncio.gather(
        *(store.append("node/a", [make(note("a", i))], i) for i in range(50))
    )
    assert [r[0] for r in results] == list(range(1, 51))
    assert await store.stream_version("node/a") == 50


async def test_read_for_rebuild_folds_to_the_same_state(store: EventStore) -> None:
    import random

    import projections
    from events.store import RebuildReader
    from events.synthetic import fleet_history

    assert isinstance(store, RebuildReader)
    for step in fleet_history(random.Random(3), nodes=5, clusters=2, replicas=2, limit=600):
        await store.append(step.stream, [step.event], step.expected_version)

    async def fold(read: object) -> projections.FleetState:
        state = projections.FleetState()
        appended = False
        while page := await read(state.position + 1, 64):  # type: ignore[operator]
            for envelope in page:
                projections.apply(state, envelope)
            if read == store.read_for_rebuild and state.position >= 320 and not appended:
                appended = True
                # A heartbeat committed mid-rebuild is newer than any "latest" seen so far.
                await store.append(
                    "heartbeat/node-00000",
                    [EventMaker(seed=9)(hb("node-00000", 999))],
                    await store.stream_version("heartbeat/node-00000"),
                )
        return state

    fast = await fold(store.read_for_rebuild)
    assert fast == projections.rebuild(await store.read_all(1, 10_000))
    assert fast.nodes.nodes["node-00000"].last_heartbeat_seq == 999
    kept = await store.read_for_rebuild(1, 10_000)
    assert len(kept) < await store.head()


async def test_append_many_appends_each_as_append_would(store: EventStore) -> None:
    make = EventMaker()
    await store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
    beats_a = [make(hb("a", 1)), make(hb("a", 2))]
    beat_b = make(hb("b", 1))
    results = await store.append_many(
        [("heartbeat/a", beats_a, NO_STREAM), ("heartbeat/b", [beat_b], NO_STREAM)]
    )
    assert results == [[2, 3], [4]]
    assert [e.event_id for e in await store.read_stream("heartbeat/a")] == [
        e.event_id for e in beats_a
    ]
    assert await store.stream_version("heartbeat/b") == 1
    assert await store.head() == 4
    # A retry of what is stored writes nothing and returns the same positions.
    assert await store.append_many([("heartbeat/b", [beat_b], NO_STREAM)]) == [[4]]
    assert await store.head() == 4


async def test_append_many_fails_one_append_without_the_others(store: EventStore) -> None:
    make = EventMaker()
    await store.append("heartbeat/a", [make(hb("a", 1))], NO_STREAM)
    results = await store.append_many(
        [
            ("heartbeat/a", [make(hb("a", 2))], NO_STREAM),  # stale: a is at 1
            ("heartbeat/b", [make(hb("b", 1))], NO_STREAM),
            ("node/c", [make(hb("c", 1))], NO_STREAM),  # a heartbeat in a node stream
            ("heartbeat/d", [], NO_STREAM),
        ]
    )
    conflict, written, refused, empty = results
    assert isinstance(conflict, ConcurrencyConflict)
    assert (conflict.stream, conflict.expected, conflict.actual) == ("heartbeat/a", 0, 1)
    assert written == [2]
    assert isinstance(refused, InvalidAppend)
    assert empty == []
    assert await store.head() == 2
    assert await store.stream_version("heartbeat/a") == 1


async def test_append_many_in_call_order_for_one_stream(store: EventStore) -> None:
    make = EventMaker()
    results = await store.append_many(
        [
            ("heartbeat/a", [make(hb("a", 1))], NO_STREAM),
            ("heartbeat/a", [make(hb("a", 2))], 1),
        ]
    )
    assert results == [[1], [2]]
    assert [e.payload for e in await store.read_stream("heartbeat/a")] == [hb("a", 1), hb("a", 2)]


async def test_append_many_on_a_closed_store_raises(store: EventStore) -> None:
    await store.close()
    with pytest.raises(StoreClosed):
        await store.append_many([("heartbeat/a", [EventMaker()(hb("a", 1))], NO_STREAM)])
