"""OutboxPublisher: the store's events on the EVENTS stream, in order, once, through crashes."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest
import structlog

from actors.outbox import OutboxError, OutboxPublisher
from events import Envelope, EventStore, MemoryEventStore
from events.codec import decode_envelope
from events.contract import subjects
from events.contract.subjects import POSITION_HEADER, VERSION_HEADER
from events.synthetic import Step, fleet_history
from wire.nats_bus import NatsBus
from wire.nats_server import EmbeddedNats

from .helpers import collect, reconnected, stream_messages, wait_until

pytestmark = pytest.mark.integration

Connect = Callable[[str], Awaitable[NatsBus]]


def history(count: int, seed: int = 7) -> list[Step]:
    return list(fleet_history(random.Random(seed), nodes=8, clusters=2, replicas=2, limit=count))


async def append(store: EventStore, steps: list[Step]) -> None:
    for step in steps:
        await store.append(step.stream, [step.event], step.expected_version)


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[EventStore]:
    s: EventStore
    if request.param == "memory":
        s = MemoryEventStore()
    else:
        from events.sqlite_store import SqliteEventStore

        s = await SqliteEventStore.open(tmp_path / "events.db")
    try:
        yield s
    finally:
        await s.close()


async def assert_stream_is_the_log(bus: NatsBus, store: EventStore) -> None:
    """The stream holds every event of the store once, in position order, headers and all."""
    log = await store.read_all(1, limit=100_000)
    messages = await stream_messages(bus.jetstream(), subjects.EVENTS_STREAM)
    assert len(messages) == len(log)
    for msg, envelope in zip(messages, log, strict=True):
        assert msg.subject == subjects.event(envelope.stream)
        assert msg.headers["Nats-Msg-Id"] == envelope.event_id
        assert msg.headers[POSITION_HEADER] == str(envelope.position)
        assert msg.headers[VERSION_HEADER] == str(envelope.version)
        assert decode_envelope(msg.data) == envelope


async def stream_count(bus: NatsBus) -> int:
    info = await bus.jetstream().stream_info(subjects.EVENTS_STREAM)
    return int(info.state.messages)


async def test_every_event_appears_once_in_position_order(store: EventStore, bus: NatsBus) -> None:
    await append(store, history(300))
    publisher = OutboxPublisher(store, bus, window=32)
    assert await publisher.publish_pending() == 300
    assert publisher.acked_position == await store.head()
    await assert_stream_is_the_log(bus, store)

    # Nothing new: nothing published, nothing duplicated, by this or by a fresh publisher.
    assert await publisher.publish_pending() == 0
    assert await OutboxPublisher(store, bus).publish_pending() == 0
    assert await stream_count(bus) == 300

    info = await bus.jetstream().stream_info(subjects.EVENTS_STREAM)
    assert info.config.subjects == [subjects.EVENTS_ALL]
    assert info.config.duplicate_window == 600
    assert info.config.max_age == 7 * 24 * 3600
    assert info.config.storage == "file"


class StopsAfter:
    """A store whose live feed hangs after `limit` events, announcing it: the moment to crash
    the publisher with publishes still in flight."""

    def __init__(self, inner: EventStore, limit: int) -> None:
        self.inner = inner
        self.limit = limit
        self.reached = asyncio.Event()

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)

    async def _feed(self, from_position: int) -> AsyncGenerator[Envelope, None]:
        given = 0
        async for envelope in self.inner.subscribe(from_position):
            if given == self.limit:
                self.reached.set()
                await asyncio.Event().wait()  # hang until cancelled
            given += 1
            yield envelope

    def subscribe(self, from_position: int = 1) -> AsyncGenerator[Envelope, None]:
        return self._feed(from_position)


async def test_a_crashed_publisher_is_resumed_without_gap_or_duplicate(
    store: EventStore, bus: NatsBus
) -> None:
    await append(store, history(1000))
    crashing = StopsAfter(store, limit=600)
    first = OutboxPublisher(crashing, bus, window=64)  # type: ignore[arg-type]
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(first.run())
        await asyncio.wait_for(crashing.reached.wait(), 20)
        task.cancel()  # up to 64 publishes were still waiting for their ack
    assert first.published <= 600

    second = OutboxPublisher(store, bus, window=64)
    resumed = await second.publish_pending()
    assert 400 <= resumed <= 1000 - first.published
    assert await stream_count(bus) == 1000
    await assert_stream_is_the_log(bus, store)


async def test_a_nats_outage_pauses_the_publisher_and_loses_nothing(
    nats_server: EmbeddedNats, bus: NatsBus, connect: Connect
) -> None:
    store = MemoryEventStore()
    steps = history(3000)
    await append(store, steps[:2000])
    watcher = await connect("watcher")
    seen = await watcher.subscribe(subjects.EVENTS_ALL)
    publisher = OutboxPublisher(
        store, bus, window=64, ack_timeout=0.3, retry_initial=0.05, retry_max=0.2
    )
    back = await reconnected(bus)
    with structlog.testing.capture_logs() as logs:
        async with asyncio.TaskGroup() as tg:
            task = tg.create_task(publisher.run())
            await collect(seen, 1)  # it is publishing: pull the plug mid-flight
            await nats_server.stop()
            await append(store, steps[2000:])  # commits go on while NATS is down
            await wait_until(lambda: _paused(publisher, 2))  # it backs off and retries
            await nats_server.start()
            await asyncio.wait_for(back.wait(), 10)
            await asyncio.wait_for(publisher.wait_for_position(await store.head()), 30)
            task.cancel()
    assert "outbox_paused" in [entry["event"] for entry in logs]
    await assert_stream_is_the_log(bus, store)


async def _paused(publisher: OutboxPublisher, times: int) -> bool:
    return publisher.pauses >= times


async def test_run_follows_new_commits(store: EventStore, bus: NatsBus, connect: Connect) -> None:
    steps = history(120)
    await append(store, steps[:20])
    watcher = await connect("watcher")
    seen = await watcher.subscribe(subjects.EVENTS_ALL)
    publisher = OutboxPublisher(store, bus)
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(publisher.run())
        assert len(await collect(seen, 20)) == 20
        await append(store, steps[20:])
        later = await collect(seen, 100)
        assert [decode_envelope(m.data).position for m in later] == list(range(21, 121))
        await asyncio.wait_for(publisher.wait_for_position(120), 10)
        task.cancel()
    await assert_stream_is_the_log(bus, store)


async def test_an_integrator_sees_only_node_events_with_a_wildcard(
    bus: NatsBus, connect: Connect
) -> None:
    store = MemoryEventStore()
    await append(store, history(400))
    # A node's heartbeats (stream heartbeat/<id>) are published on its node subject too.
    node_events = [
        e for e in await store.read_all(1, 1000) if e.stream.startswith(("node/", "heartbeat/"))
    ]
    assert 0 < len(node_events) < 400
    assert any(e.stream.startswith("heartbeat/") for e in node_events)

    integrator = await connect("integrator")
    nodes = await integrator.subscribe("gpumesh.v1.events.node.*")
    await OutboxPublisher(store, bus).publish_pending()
    got = await collect(nodes, len(node_events))
    await integrator.flush()
    assert nodes.pending == 0  # and nothing else
    assert [decode_envelope(m.data) for m in got] == node_events
    assert all(m.subject.startswith("gpumesh.v1.events.node.") for m in got)


async def test_resume_skips_a_message_published_by_hand(bus: NatsBus) -> None:
    store = MemoryEventStore()
    steps = history(50)
    await append(store, steps[:30])
    publisher = OutboxPublisher(store, bus)
    assert await publisher.publish_pending() == 30
    await bus.jetstream().publish(subjects.event("node/intruder"), b"{}")
    await append(store, steps[30:])
    assert await OutboxPublisher(store, bus).publish_pending() == 20
    assert await stream_count(bus) == 51


async def test_a_stream_of_foreign_messages_is_refused(bus: NatsBus) -> None:
    store = MemoryEventStore()
    await append(store, history(5))
    publisher = OutboxPublisher(store, bus)
    await publisher.ensure_stream()
    await bus.jetstream().publish(subjects.event("node/intruder"), b"{}")
    with pytest.raises(OutboxError, match="only the outbox may publish"):
        await publisher.publish_pending()
