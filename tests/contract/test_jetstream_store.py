"""What only the JetStream store has to show: a second store object on the same stream (a
restart, or a second controller), the server's own fencing of a writer that did not see an
append, atomic batches, retries past the server's duplicate window, and its failures.

The contract every store honours is in test_store_contract.py; these run on the nats-server
the session shares (tests/contract/jetstream.py), a stream of their own each.
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import nats
import pytest
from nats.js.api import DiscardPolicy, StreamConfig

from events import (
    ANY,
    NO_STREAM,
    ConcurrencyConflict,
    EventStoreError,
    InvalidAppend,
    NodeDrained,
    NodeHeartbeat,
    NodeRegistered,
    Snapshot,
    StoreClosed,
    StoreFull,
)
from events.errors import StoreIOError
from events.jetstream_store import JetStreamEventStore, JetStreamOptions
from events.jetstream_store.store import _LAST_SEQ
from tests.contract.jetstream import SharedServer, drop, fresh_options, open_store, opened
from tests.factories import EventMaker
from wire.nats_server import EmbeddedNats


def hb(node: str, seq: int) -> NodeHeartbeat:
    return NodeHeartbeat(node_id=node, seq=seq)


def note(node: str, seq: int) -> NodeDrained:
    return NodeDrained(node_id=node, reason=f"note {seq}")


async def test_a_second_store_on_the_stream_sees_the_same_log(options: JetStreamOptions) -> None:
    make = EventMaker(step_ns=1_000_000_000)
    registered = [make(NodeRegistered(node_id="a")), make(note("a", 1))]
    beats = [make(hb("a", i)) for i in range(4)]
    async with opened(options) as first:
        await first.append("node/a", registered, NO_STREAM)
        await first.append("heartbeat/a", beats[:3], NO_STREAM)
        await first.append("heartbeat/a", beats[3:], 3)
        await first.append("node/b", [make(NodeRegistered(node_id="b"))], NO_STREAM)
        assert await first.compact_heartbeats(make.now_ns + 1) == 3
        await first.save_snapshot(Snapshot(stream="node/a", version=2, schema="s", state=b"x"))
        log = await first.read_all(1, 100)
        head = await first.head()
    async with opened(options) as second:
        assert await second.read_all(1, 100) == log
        assert await second.head() == head == 7
        assert await second.stream_version("node/a") == 2
        assert await second.stream_version("heartbeat/a") == 4
        assert [e.version for e in await second.read_stream("heartbeat/a")] == [4]
        assert (await second.load_snapshot("node/a")) == Snapshot(
            stream="node/a", version=2, schema="s", state=b"x"
        )
        # Its index came back from the server: a retry writes nothing, a new append goes on.
        assert await second.append("node/a", registered, NO_STREAM) == [1, 2]
        assert await second.append("node/a", [make(note("a", 2))], 2) == [8]
        assert await second.append("heartbeat/a", [make(hb("a", 9))], 4) == [9]
        assert [e.position for e in await second.read_for_rebuild(1, 100)] == [1, 2, 7, 8, 9]


async def test_a_writer_that_did_not_see_an_append_is_refused(options: JetStreamOptions) -> None:
    """Two controllers on one log: the server, not a lock, keeps them from both extending a
    stream. The one that did not see the other's append gets ConcurrencyConflict with the
    stream's real version, and can then go on from there."""
    make = EventMaker()
    async with opened(options) as first, opened(options) as second:
        await first.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
        with pytest.raises(ConcurrencyConflict) as info:
            await second.append("node/a", [make(note("a", 1))], NO_STREAM)
        assert (info.value.expected, info.value.actual) == (0, 1)
        assert await second.append("node/a", [make(note("a", 2))], 1) == [2]
        # Now the first is the one behind.
        with pytest.raises(ConcurrencyConflict) as info:
            await first.append("node/a", [make(note("a", 3)), make(note("a", 4))], 1)
        assert info.value.actual == 2
        assert await first.head() == 2
        # ANY takes the stream where it is, whoever moved it.
        assert await first.append("node/a", [make(note("a", 5))], ANY) == [3]
        assert [e.version for e in await second.read_stream("node/a")] == [1, 2, 3]


async def test_racing_writers_on_two_store_objects_exactly_one_wins(
    options: JetStreamOptions,
) -> None:
    make = EventMaker()
    async with opened(options) as first, opened(options) as second:
        await first.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
        attempts = [
            store.append("node/a", [make(note("a", i))], 1)
            for i in range(10)
            for store in (first, second)
        ]
        results = await asyncio.gather(*attempts, return_exceptions=True)
        assert len([r for r in results if isinstance(r, list)]) == 1
        assert all(isinstance(r, ConcurrencyConflict) for r in results if not isinstance(r, list))
        assert await second.stream_version("node/a") == 2


async def test_a_refused_batch_stores_none_of_its_events(options: JetStreamOptions) -> None:
    make = EventMaker()
    async with opened(options) as first, opened(options) as second:
        assert await first.append("node/a", [make(note("a", i)) for i in range(3)], 0) == [1, 2, 3]
        await second.append("node/a", [make(note("a", 3))], 3)
        with pytest.raises(ConcurrencyConflict):
            await first.append("node/a", [make(note("a", i)) for i in range(4, 9)], 3)
        assert await first.head() == 4
        assert [e.version for e in await first.read_stream("node/a")] == [1, 2, 3, 4]


async def test_a_retry_long_after_the_duplicate_window_still_writes_nothing() -> None:
    options = fresh_options(duplicate_window_s=0.2)
    make = EventMaker()
    batch = [make(NodeRegistered(node_id="a")), make(note("a", 1))]
    beat = make(hb("a", 1))
    try:
        async with opened(options) as store:
            assert await store.append("node/a", batch, NO_STREAM) == [1, 2]
            assert await store.append("heartbeat/a", [beat], NO_STREAM) == [3]
            await asyncio.sleep(0.5)  # the server has forgotten the ids
            assert await store.append("node/a", batch, ANY) == [1, 2]
            assert await store.append("heartbeat/a", [beat], ANY) == [3]
        async with opened(options) as again:
            assert await again.append("node/a", batch, NO_STREAM) == [1, 2]
            assert await again.append("heartbeat/a", [beat], 0) == [3]
            assert await again.head() == 3
    finally:
        await drop(options)


async def test_a_compacted_id_is_appended_again(options: JetStreamOptions) -> None:
    """As in the memory store, an id compaction removed is free. The server still holds it in
    its duplicate window; after a reopen the store no longer knows that it does, meets the
    server's duplicate answer, and writes the event again without the server's id."""
    make = EventMaker(step_ns=1_000_000_000)
    beats = [make(hb("a", i)) for i in range(4)]
    async with opened(options) as store:
        await store.append("heartbeat/a", beats[:1], NO_STREAM)
        await store.append("heartbeat/a", beats[1:3], 1)
        await store.append("heartbeat/a", beats[3:], 3)
        assert await store.compact_heartbeats(make.now_ns + 1) == 3
        assert await store.append("heartbeat/a", beats[:1], ANY) == [5]  # known forgotten
    async with opened(options) as store:
        assert await store.append("heartbeat/a", beats[1:2], ANY) == [6]  # single: duplicate
        assert await store.append("heartbeat/a", [*beats[2:3], make(hb("a", 9))], 6) == [7, 8]
        assert [e.version for e in await store.read_stream("heartbeat/a")] == [4, 5, 6, 7, 8]


async def test_jetstream_rewrites_a_compacted_id_late(options: JetStreamOptions) -> None:
    """The known difference the differential machine stays clear of: that rewrite (above)
    happens after the acknowledgement, so an append made after it, to another stream, may
    take the lower position. Both are stored, each once and whole."""
    make = EventMaker(step_ns=1_000_000_000)
    beats = [make(hb("a", i)) for i in range(2)]
    async with opened(options) as store:
        await store.append("heartbeat/a", beats, NO_STREAM)
        assert await store.compact_heartbeats(make.now_ns + 1) == 1
    async with opened(options) as store:
        rewritten, other = await asyncio.gather(
            store.append("heartbeat/a", beats[:1], ANY),
            store.append("node/b", [make(NodeRegistered(node_id="b"))], NO_STREAM),
        )
        assert sorted(rewritten + other) == [3, 4]
        assert other == [3]  # the memory store would say [4]


async def test_append_many_sends_every_append_before_waiting(options: JetStreamOptions) -> None:
    make = EventMaker()
    async with opened(options) as store:
        appends = [(f"heartbeat/n{i}", [make(hb(f"n{i}", 0))], NO_STREAM) for i in range(300)]
        results = await store.append_many(appends)
        assert results == [[i] for i in range(1, 301)]
        # Two per stream: the second waits for the first's acknowledgement, and those after
        # it wait their turn, so the positions still follow the call order.
        twice = [(f"heartbeat/n{i}", [make(hb(f"n{i}", k))], k) for i in range(50) for k in (1, 2)]
        assert await store.append_many(twice) == [[i] for i in range(301, 401)]


async def test_a_subscriber_follows_another_writer(options: JetStreamOptions) -> None:
    make = EventMaker()
    async with opened(options) as writer, opened(options) as reader:
        pages = reader.subscribe_batches()
        try:
            await writer.append("node/a", [make(note("a", i)) for i in range(5)], NO_STREAM)
            page = await asyncio.wait_for(anext(pages), 5)
            assert [e.position for e in page] == [1, 2, 3, 4, 5]
            assert [e.version for e in page] == [1, 2, 3, 4, 5]
        finally:
            await pages.aclose()


async def test_an_append_of_more_than_a_batch_holds_is_refused(options: JetStreamOptions) -> None:
    make = EventMaker()
    async with opened(options) as store:
        events = [make(note("a", i)) for i in range(1001)]
        with pytest.raises(InvalidAppend, match="at most 1000"):
            await store.append("node/a", events, NO_STREAM)
        assert await store.append("node/a", events[:1000], NO_STREAM) == list(range(1, 1001))


async def test_a_full_stream_is_store_full(options: JetStreamOptions) -> None:
    """A stream at its byte limit refuses the whole append, and says so as the SQLite store
    says a full disk."""
    nc = await nats.connect(SharedServer.url())
    try:
        await nc.jetstream().add_stream(
            StreamConfig(
                name=options.stream,
                subjects=[options.filter],
                max_bytes=4096,
                discard=DiscardPolicy.NEW,
                allow_direct=True,
                allow_atomic=True,
            )
        )
    finally:
        await nc.close()
    make = EventMaker()
    async with opened(options) as store:
        version = 0
        with pytest.raises(StoreFull, match="NATS stream"):
            for i in range(100):
                await store.append("node/a", [make(note("a", i)), make(note("a", -i))], version)
                version += 2
        assert await store.stream_version("node/a") == version
        assert await store.head() == version


async def test_an_unreachable_server_is_a_store_io_error(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    await server.start()
    store = await JetStreamEventStore.connect(
        server.url, JetStreamOptions(request_timeout_s=0.5), max_reconnect_attempts=0
    )
    try:
        await store.append("node/a", [EventMaker()(note("a", 0))], NO_STREAM)
        await server.stop()
        for call in (
            store.append("node/a", [EventMaker(seed=2)(note("a", 1))], 1),
            store.read_all(),
            store.head(),
        ):
            with pytest.raises(EventStoreError) as info:
                await call
            assert isinstance(info.value, StoreIOError)
            assert "\n" not in str(info.value)
    finally:
        await store.close()
        await server.stop()


async def test_a_closed_store_refuses_every_operation(options: JetStreamOptions) -> None:
    store = await open_store(options)
    await store.close()
    await store.close()  # twice is fine
    snap = Snapshot(stream="node/a", version=1, schema="s", state=b"")
    for call in (
        store.append("node/a", [EventMaker()(note("a", 0))], NO_STREAM),
        store.append_many([]),
        store.read_stream("node/a"),
        store.stream_version("node/a"),
        store.read_all(),
        store.read_for_rebuild(),
        store.head(),
        store.compact_heartbeats(0),
        store.save_snapshot(snap),
        store.load_snapshot("node/a"),
    ):
        with pytest.raises(StoreClosed):
            await call
    assert [e async for e in store.subscribe()] == []


async def test_reads_past_the_end_and_odd_arguments(options: JetStreamOptions) -> None:
    make = EventMaker()
    async with opened(options) as store:
        await store.append("node/a", [make(note("a", 0))], NO_STREAM)
        assert await store.read_all(2**70, 5) == []
        assert await store.read_all(_LAST_SEQ, 5) == []
        assert [e.position for e in await store.read_all(-5, 2**70)] == [1]
        assert await store.read_stream("node/a.b") == []
        assert await store.stream_version("not a stream") == 0
        assert await store.load_snapshot("node/") is None


async def test_a_standby_that_observes_the_log_takes_over_without_refusals(
    options: JetStreamOptions,
) -> None:
    """A standby's store learns what the leader writes from its own subscription (`observe`,
    as actors/controller_process.py feeds it); when it takes over, its first append to each
    stream the leader wrote goes through without the server refusing it and a read."""
    make = EventMaker()
    async with opened(options) as leader, opened(options) as standby:
        for node in ("a", "b", "c"):
            await leader.append(f"node/{node}", [make(NodeRegistered(node_id=node))], NO_STREAM)
            await leader.append(f"heartbeat/{node}", [make(hb(node, 1)), make(hb(node, 2))], 0)
        head = await leader.head()
        async with contextlib.aclosing(standby.subscribe_batches(1)) as pages:
            async for page in pages:
                standby.observe(page)
                if page[-1].position >= head:
                    break

        async def refused(*_: object) -> None:
            raise AssertionError("the standby had to read its way to a stream's end")

        standby._writer._catch_up = refused  # type: ignore[method-assign]
        for node in ("a", "b", "c"):
            await standby.append(f"node/{node}", [make(note(node, 1))], 1)
            await standby.append(f"heartbeat/{node}", [make(hb(node, 3))], 2)
        assert await standby.head() == head + 6
        # The learned heartbeats compact like its own.
        assert await standby.compact_heartbeats(make.now_ns + 1) == 6
