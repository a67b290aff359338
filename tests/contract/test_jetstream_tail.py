"""The JetStream store's subscribers take its own appends from its tail (events/jetstream_store/
tail.py) and everything else from the server: whatever the mix, each sees the log in order,
with no gap and no duplicate, the envelopes equal to what a read from the server gives.
Run on the nats-server the contract tests share, a stream of their own each."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from events import ANY, NO_STREAM, Envelope, NodeDrained, NodeHeartbeat
from events.jetstream_store import JetStreamEventStore, JetStreamOptions
from tests.contract.jetstream import opened
from tests.factories import EventMaker


def hb(node: str, seq: int) -> NodeHeartbeat:
    return NodeHeartbeat(node_id=node, seq=seq)


def note(node: str, seq: int) -> NodeDrained:
    return NodeDrained(node_id=node, reason=f"note {seq}")


class ServerReads:
    """Counts what a store's subscribers read from the server."""

    def __init__(self, store: JetStreamEventStore) -> None:
        self.events = 0
        inner = store._read_envelopes

        async def counted(start: int, limit: int) -> list[Envelope]:
            found = await inner(start, limit)
            self.events += len(found)
            return found

        store._read_envelopes = counted  # type: ignore[method-assign]
        store._followers._read = counted


async def take(pages: AsyncIterator[list[Envelope]], last: int) -> list[Envelope]:
    got: list[Envelope] = []
    async with asyncio.timeout(10):
        while not got or got[-1].position < last:
            got += await anext(pages)
    return got


async def test_a_writers_subscriber_takes_its_appends_from_the_tail(
    options: JetStreamOptions,
) -> None:
    make = EventMaker()
    async with opened(options) as store:
        reads = ServerReads(store)
        pages = store.subscribe_batches(1)
        try:
            # The first page asked for before anything was written (nothing there yet).
            waiting = asyncio.ensure_future(anext(pages))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            appends = [(f"heartbeat/n{i}", [make(hb(f"n{i}", 1))], NO_STREAM) for i in range(50)]
            await store.append_many(appends)
            await store.append("node/a", [make(note("a", i)) for i in range(3)], NO_STREAM)
            got = await waiting
            got += await take(pages, 53)
        finally:
            await pages.aclose()
        assert [e.position for e in got] == list(range(1, 54))
        assert reads.events == 0  # all from the tail
        assert got == await store.read_all(1, 100)  # what the server holds, decoded


async def test_another_writers_appends_in_between_are_read_from_the_server(
    options: JetStreamOptions,
) -> None:
    """Two writers take turns; a subscriber of each sees every event once, in order."""
    make = EventMaker()
    async with opened(options) as first, opened(options) as second:
        subscriptions = [first.subscribe_batches(1), second.subscribe_batches(1)]
        try:
            for i in range(20):
                writer = (first, second)[i % 3 == 0]
                await writer.append("node/a", [make(note("a", i))], ANY)
                await writer.append(f"heartbeat/{i % 4}", [make(hb(str(i % 4), i))], ANY)
            log = await first.read_all(1, 100)
            assert len(log) == 40
            for pages in subscriptions:
                assert await take(pages, 40) == log
            # And live: an append of the other after the subscriber caught up.
            await second.append("node/b", [make(note("b", 0))], NO_STREAM)
            await first.append("node/b", [make(note("b", 1))], ANY)
            last_two = await take(subscriptions[0], 42)
            assert [e.position for e in last_two] == [41, 42]
            assert [e.payload for e in last_two] == [note("b", 0), note("b", 1)]
        finally:
            for pages in subscriptions:
                await pages.aclose()


async def test_a_subscriber_behind_the_tail_reads_the_server_then_the_tail(
    options: JetStreamOptions,
) -> None:
    make = EventMaker()
    async with opened(options) as store:
        total = 0
        for turn in range(10):  # 10,000 events: more than the tail keeps
            appends = [
                (f"heartbeat/n{i}", [make(hb(f"n{i}", turn))], turn if turn else NO_STREAM)
                for i in range(1000)
            ]
            await store.append_many(appends)
            total += 1000
        reads = ServerReads(store)
        pages = store.subscribe_batches(1)
        try:
            got = await take(pages, total)
            assert reads.events > 0
            before = reads.events
            await store.append("node/a", [make(note("a", 0))], NO_STREAM)
            got += await take(pages, total + 1)
            assert reads.events == before  # the new one from the tail
        finally:
            await pages.aclose()
        assert [e.position for e in got] == list(range(1, total + 2))


async def test_compacted_heartbeats_leave_the_tail(options: JetStreamOptions) -> None:
    make = EventMaker(step_ns=1_000_000_000)
    async with opened(options) as store:
        for seq in range(5):
            await store.append("heartbeat/a", [make(hb("a", seq))], seq)
        await store.append("node/a", [make(note("a", 0))], NO_STREAM)
        assert await store.compact_heartbeats(make.now_ns + 1) == 4
        pages = store.subscribe_batches(1)
        try:
            got = await take(pages, 6)
        finally:
            await pages.aclose()
        assert [e.position for e in got] == [5, 6]
        assert got == await store.read_all(1, 100)
