"""The stores side by side: the same random operations on a MemoryEventStore and on a
SqliteEventStore over a real file (or a JetStreamEventStore on a real nats-server), and after
every step the same outcome from each.

The contract tests pin the cases someone thought of. The SQLite store also batches appends,
caches stream versions, serves subscribers from an in-memory tail and compacts in SQL, and each
of those can drift from the memory store (the reference) in a sequence nobody wrote down: here
hypothesis writes the sequences, as its own database tests do for its backends.

The stores are async and a state machine's rules are not, so the machine owns an event loop
and runs each operation to completion on it, first on the memory store, then on the other.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import pytest
from hypothesis import Phase, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from events import (
    ANY,
    NO_STREAM,
    ConcurrencyConflict,
    DomainEvent,
    DuplicateEventId,
    Envelope,
    EventStore,
    EventStoreError,
    MemoryEventStore,
    NewEvent,
    NodeDrained,
    NodeHeartbeat,
    NodeRegistered,
    Snapshot,
    StoreClosed,
)
from events.sqlite_store import SqliteEventStore
from events.store import RebuildReader
from tests.contract.jetstream import (
    drop as drop_stream,
    fresh_options,
    open_store as open_jetstream,
)
from tests.factories import EPOCH_NS, EventMaker

T = TypeVar("T")

NODES = ("a", "b", "c")
STREAMS = tuple(f"{kind}/{node}" for kind in ("node", "heartbeat") for node in NODES)
TICK_NS = 1_000  # each event is recorded one tick after the one before
SUBSCRIPTION_TIMEOUT_S = 2.0  # a subscription that has not caught up by then is stuck

# How an append's expected version is chosen. "current" is listed more than once: appends that
# succeed should be the common case, or the log stays too short to be interesting.
EXPECTATIONS = (*["current"] * 4, "stale", "ahead", "no_stream", "any", "invalid")
# What an append carries: new events, nothing, or something check_batch refuses.
SHAPES = (*["fresh"] * 5, "empty", "foreign", "repeated_id", "bad_stream")
# How an earlier attempt is tried again: as it was (the idempotent retry), with ANY, at the
# stream's current version, with one new event beside the old ones, or its first id reused
# for an event of another stream.
RETRIES = ("same", "same", "any", "current", "mixed", "stolen")


@dataclass(frozen=True)
class Attempt:
    """An append as it was handed to both stores, whatever came of it."""

    stream: str
    events: tuple[NewEvent, ...]
    expected: int


def describe(result: object) -> object:
    """What the two stores must agree on: the value, or the error's type and its details."""
    if isinstance(result, ConcurrencyConflict):
        return ("ConcurrencyConflict", result.stream, result.expected, result.actual)
    if isinstance(result, DuplicateEventId):
        return ("DuplicateEventId", result.event_id)
    if isinstance(result, BaseException):
        return (type(result).__name__, str(result))
    if isinstance(result, list):
        return [describe(item) for item in result]
    return result


def node_of(stream: str) -> str:
    return stream.partition("/")[2]


def as_list(item: Envelope | list[Envelope]) -> list[Envelope]:
    """What subscribe (an envelope) or subscribe_batches (a non-empty page) yields, as a list."""
    if isinstance(item, list):
        assert 0 < len(item) <= 1000
        return item
    return [item]


async def take_until(
    source: AsyncIterator[Envelope | list[Envelope]], last: int, got: list[Envelope]
) -> bool:
    """Take from a subscription into `got` until position `last` arrives; False if it stalls
    first (an outcome to compare, not an error: a different error type would make hypothesis
    call the failure flaky while it shrinks)."""
    try:
        async with asyncio.timeout(SUBSCRIPTION_TIMEOUT_S):
            while not got or got[-1].position < last:
                got += as_list(await anext(source))
    except TimeoutError:
        return False
    return True


class StoreDifferential(RuleBasedStateMachine):
    """The memory store against the SQLite store; a subclass swaps the other store."""

    other_name = "sqlite"

    def __init__(self) -> None:
        super().__init__()
        self._dir = tempfile.TemporaryDirectory(prefix="gpumesh-differential-")
        self._path = Path(self._dir.name) / "events.db"
        # A loop of the machine's own, run to completion for each operation, so the stores see
        # a running loop exactly as they do in production, and each step ends with no work in
        # flight.
        self._loop = asyncio.new_event_loop()
        self.memory = MemoryEventStore()
        self.other: EventStore = self._run(self.open_other())
        self._now = EPOCH_NS
        self._ids = 0
        self._attempts: list[Attempt] = []

    async def open_other(self) -> EventStore:
        """The store compared with the memory store, opened again on the same log by
        `reopen`."""
        return await SqliteEventStore.open(self._path)

    async def drop_other(self) -> None:
        """After the last close: remove what the other store left outside the directory."""

    def teardown(self) -> None:
        try:
            self._run(self.other.close())
            self._run(self.drop_other())
            self._run(self.memory.close())
            self._run(self._loop.shutdown_asyncgens())
        finally:
            self._loop.close()
            self._dir.cleanup()

    # ------------------------------------------------------------------ running both

    def _run(self, awaitable: Awaitable[T]) -> T:
        async def wrapped() -> T:
            return await awaitable

        return self._loop.run_until_complete(wrapped())

    def _outcome(self, op: Callable[[EventStore], Awaitable[Any]], store: EventStore) -> object:
        try:
            return describe(self._run(op(store)))
        except EventStoreError as exc:
            return describe(exc)

    def _both(self, op: Callable[[EventStore], Awaitable[Any]]) -> object:
        """Run `op` on each store; both must return the same or raise the same."""
        expected = self._outcome(op, self.memory)
        actual = self._outcome(op, self.other)
        assert actual == expected, f"{self.other_name} {actual!r} != memory {expected!r}"
        return expected

    # ------------------------------------------------------------------ building appends

    def _event(self, stream: str, *, event_id: str | None = None) -> NewEvent:
        self._ids += 1
        self._now += TICK_NS
        node = node_of(stream)
        payload: DomainEvent
        if stream.startswith("heartbeat/"):
            payload = NodeHeartbeat(node_id=node, seq=self._ids)
        elif self._ids % 2:
            payload = NodeRegistered(node_id=node, hostname=f"host-{self._ids}")
        else:
            payload = NodeDrained(node_id=node, reason=f"reason {self._ids}")
        return NewEvent(
            event_id=event_id or f"event-{self._ids:06d}",
            payload=payload,
            recorded_at=self._now,
            correlation_id=f"corr-{self._ids % 3}",
        )

    def _version(self, stream: str) -> int:
        return self._run(self.memory.stream_version(stream))

    def _expected(self, how: str, current: int, data: st.DataObject) -> int:
        if how == "current":
            return current
        if how == "stale":
            return current - 1 if current > 0 else current + 1
        if how == "ahead":
            return current + data.draw(st.integers(1, 3), label="ahead by")
        if how == "no_stream":
            return NO_STREAM
        if how == "any":
            return ANY
        return ANY - data.draw(st.integers(1, 3), label="below ANY by")

    def _fresh(self, data: st.DataObject, versions: dict[str, int]) -> Attempt:
        """A new append. `versions` holds where the appends drawn before it for the same call
        leave their streams if they succeed, so that "current" can follow them."""
        stream = data.draw(st.sampled_from(STREAMS), label="stream")
        current = versions.get(stream)
        if current is None:
            current = self._version(stream)
        expected = self._expected(data.draw(st.sampled_from(EXPECTATIONS)), current, data)
        shape = data.draw(st.sampled_from(SHAPES), label="shape")
        count = data.draw(st.integers(1, 3), label="events")
        events = [self._event(stream) for _ in range(count)]
        if shape == "empty":
            events = []
        elif shape == "foreign":
            other = data.draw(st.sampled_from([s for s in STREAMS if s != stream]))
            events.insert(data.draw(st.integers(0, count)), self._event(other))
        elif shape == "repeated_id":
            events.append(self._event(stream, event_id=events[0].event_id))
        elif shape == "bad_stream":
            stream = f"{stream}.x"
        versions[stream] = expected + len(events) if expected >= 0 else current + len(events)
        return Attempt(stream, tuple(events), expected)

    def _retry(self, data: st.DataObject) -> Attempt:
        earlier = data.draw(st.sampled_from(self._attempts), label="retried")
        how = data.draw(st.sampled_from(RETRIES), label="retry")
        if how == "same":
            return earlier
        stream, events = earlier.stream, earlier.events
        if how == "any":
            return Attempt(stream, events, ANY)
        if how == "current":
            return Attempt(stream, events, self._version(stream))
        if how == "mixed":
            fresh = self._event(stream)
            return Attempt(stream, (*events, fresh), self._version(stream))
        # "stolen": the id of one of its events on a new event of another stream.
        if not events:
            return earlier
        other = data.draw(st.sampled_from([s for s in STREAMS if s != stream]), label="thief")
        thief = self._event(other, event_id=events[0].event_id)
        return Attempt(other, (thief,), self._version(other))

    def _attempt(self, data: st.DataObject, versions: dict[str, int]) -> Attempt:
        if self._attempts and data.draw(st.integers(0, 3), label="retry if 0") == 0:
            attempt = self._retry(data)
        else:
            attempt = self._fresh(data, versions)
        self._attempts.append(attempt)
        return attempt

    # ------------------------------------------------------------------ writes

    @initialize(counts=st.lists(st.integers(0, 4), min_size=len(STREAMS), max_size=len(STREAMS)))
    def seed(self, counts: list[int]) -> None:
        """Start from a log with something in it, so the first reads have something to read."""
        for stream, count in zip(STREAMS, counts, strict=True):
            if count:
                events = tuple(self._event(stream) for _ in range(count))
                self._attempts.append(Attempt(stream, events, NO_STREAM))
                self._both(lambda store, s=stream, e=events: store.append(s, e, NO_STREAM))

    @rule(data=st.data())
    def append(self, data: st.DataObject) -> None:
        a = self._attempt(data, {})
        self._both(lambda store: store.append(a.stream, a.events, a.expected))

    @rule(data=st.data(), count=st.integers(1, 5))
    def append_many(self, data: st.DataObject, count: int) -> None:
        versions: dict[str, int] = {}
        attempts = [self._attempt(data, versions) for _ in range(count)]
        appends = [(a.stream, a.events, a.expected) for a in attempts]
        self._both(lambda store: store.append_many(appends))

    @rule(data=st.data(), count=st.integers(2, 6))
    def concurrent_appends(self, data: st.DataObject, count: int) -> None:
        """Appends issued in one turn of the loop: one group-committed batch for SQLite, which
        must come out as if they had been made one after another, in call order."""
        versions: dict[str, int] = {}
        attempts = [self._attempt(data, versions) for _ in range(count)]
        # A snapshot save shares the appends' transaction; a compaction splits the batch.
        extra = data.draw(st.sampled_from([None, "snapshot", "compact"]), label="also")
        extra_at = data.draw(st.integers(0, count), label="at")
        snap = Snapshot(stream="node/a", version=self._ids, schema="s", state=b"x")
        cutoff = self._now

        async def gather(store: EventStore) -> list[object]:
            calls: list[Awaitable[object]] = [
                store.append(a.stream, a.events, a.expected) for a in attempts
            ]
            if extra == "snapshot":
                calls.insert(extra_at, store.save_snapshot(snap))
            elif extra == "compact":
                calls.insert(extra_at, store.compact_heartbeats(cutoff))
            return await asyncio.gather(*calls, return_exceptions=True)

        self._both(gather)

    @rule(data=st.data())
    def compact_heartbeats(self, data: st.DataObject) -> None:
        ticks = data.draw(st.integers(0, self._ids + 1), label="cutoff ticks")
        cutoff = EPOCH_NS + ticks * TICK_NS
        self._both(lambda store: store.compact_heartbeats(cutoff))

    @rule(
        stream=st.sampled_from(STREAMS),
        version=st.integers(0, 20),
        schema=st.sampled_from(["s1", "s2"]),
        state=st.binary(max_size=8),
    )
    def save_snapshot(self, stream: str, version: int, schema: str, state: bytes) -> None:
        snap = Snapshot(stream=stream, version=version, schema=schema, state=state)
        self._both(lambda store: store.save_snapshot(snap))

    @rule()
    def reopen(self) -> None:
        """A restart: the version cache, the next position and the tail (SQLite) or the
        index of ids, versions and heartbeats (JetStream) start again."""
        self._run(self.other.close())
        self.other = self._run(self.open_other())

    # ------------------------------------------------------------------ reads

    def _position(self, data: st.DataObject) -> int:
        """A position to read from: mostly inside the log, sometimes around or far past it."""
        head = self._run(self.memory.head())
        return data.draw(st.integers(-1, head + 2) | st.just(2**70), label="from position")

    @rule(data=st.data(), limit=st.integers(-2, 12) | st.just(2**70))
    def read_all(self, data: st.DataObject, limit: int) -> None:
        from_position = self._position(data)
        self._both(lambda store: store.read_all(from_position, limit))

    @rule(data=st.data(), stream=st.sampled_from(STREAMS))
    def read_stream(self, data: st.DataObject, stream: str) -> None:
        version = self._version(stream)
        from_version = data.draw(st.integers(-1, version + 1) | st.just(2**70), label="from")
        self._both(lambda store: store.read_stream(stream, from_version))

    @rule(page=st.integers(1, 8))
    def rebuild(self, page: int) -> None:
        """A whole rebuild, page by page, with nothing written in between: the SQLite store
        takes each stream's latest heartbeat once per rebuild, at its first page."""

        async def pages(store: EventStore) -> list[list[Envelope]]:
            assert isinstance(store, RebuildReader)
            found: list[list[Envelope]] = []
            position = 1
            while batch := await store.read_for_rebuild(position, page):
                found.append(batch)
                position = batch[-1].position + 1
            return found

        self._both(pages)

    @rule(data=st.data(), batches=st.booleans(), live=st.booleans())
    def subscribe(self, data: st.DataObject, batches: bool, live: bool) -> None:
        """Subscribe, take everything up to the head; with `live`, append while subscribed and
        take what that committed too; then stop."""
        head = self._run(self.memory.head())
        start = max(1, data.draw(st.integers(-1, head + 1), label="from position"))
        append = self._attempt(data, {}) if live else None

        async def take(store: EventStore) -> tuple[list[Envelope], object, bool]:
            got: list[Envelope] = []
            source = (store.subscribe_batches if batches else store.subscribe)(start)
            try:
                caught_up = head < start or await take_until(source, head, got)
                if head < start and append is None:
                    # Nothing to take: whatever arrives in a moment is wrong.
                    with contextlib.suppress(TimeoutError):
                        got += as_list(await asyncio.wait_for(anext(source), 0.01))
                if append is None or not caught_up:
                    return got, None, caught_up
                try:
                    written = await store.append(append.stream, append.events, append.expected)
                except EventStoreError as exc:
                    return got, describe(exc), caught_up
                # The store's own head: a store that misnumbers the append is caught by
                # comparing `written`, not left waiting for a position it never wrote.
                last = await store.head()
                if last >= max(start, head + 1):
                    caught_up = await take_until(source, last, got)
                return got, written, caught_up
            finally:
                await source.aclose()

        self._both(take)

    # ------------------------------------------------------------------ after every step

    @invariant()
    def the_stores_agree(self) -> None:
        async def everything(store: EventStore) -> dict[str, object]:
            # Gathered, so the SQLite store's reads queue up on its reader thread together
            # instead of paying a round trip each: this runs after every step.
            reads: dict[str, Awaitable[object]] = {
                "head": store.head(),
                "read_all": store.read_all(1, 10_000),
            }
            for stream in STREAMS:
                reads[f"stream_version {stream}"] = store.stream_version(stream)
                reads[f"read_stream {stream}"] = store.read_stream(stream)
                reads[f"load_snapshot {stream}"] = store.load_snapshot(stream)
            return dict(zip(reads, await asyncio.gather(*reads.values()), strict=True))

        self._both(everything)


# Each example opens a real SQLite file and fsyncs every commit: the profile's examples, 50
# steps each, take about 10 s under `ci` on a 2-core runner. No explain phase: it replays a
# failure under a line tracer, a minute here, and the shrunk steps already say what happened.
StoreDifferential.TestCase.settings = settings(
    stateful_step_count=50,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
TestStoreDifferential = StoreDifferential.TestCase


class JetStreamDifferential(StoreDifferential):
    """The memory store against the JetStream store, on the nats-server the session shares
    (tests/contract/jetstream.py), with a stream of its own per example; `reopen` is a second
    store object on the same stream, which rebuilds its index from the server.

    It stays clear of one known difference (test_jetstream_rewrites_a_compacted_id_late in
    test_jetstream_store.py): the ids of events compacted away before a reopen are not
    appended again."""

    other_name = "jetstream"

    def __init__(self) -> None:
        self._options = fresh_options()
        self._ever_stored: set[str] = set()
        self._compacted_before_reopen: set[str] = set()
        super().__init__()

    async def open_other(self) -> EventStore:
        live = {e.event_id for e in self.memory.read_all_now()}
        # Every id ever attempted, not only those seen stored after a step: a step can store
        # an event and compact it away before the invariant looks (concurrent appends with a
        # compaction among them).
        self._ever_stored |= {e.event_id for a in getattr(self, "_attempts", ()) for e in a.events}
        self._compacted_before_reopen |= self._ever_stored - live
        return await open_jetstream(self._options)

    @invariant()
    def note_what_is_stored(self) -> None:
        self._ever_stored |= {e.event_id for e in self.memory.read_all_now()}

    def _attempt(self, data: st.DataObject, versions: dict[str, int]) -> Attempt:
        attempt = super()._attempt(data, versions)
        if any(e.event_id in self._compacted_before_reopen for e in attempt.events):
            self._attempts.pop()
            attempt = self._fresh(data, versions)
            self._attempts.append(attempt)
        return attempt

    async def drop_other(self) -> None:
        await drop_stream(self._options)


JetStreamDifferential.TestCase.settings = settings(
    stateful_step_count=50,
    deadline=None,
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink],
)
TestJetStreamDifferential = JetStreamDifferential.TestCase


# -- where the stores are known to differ ---------------------------------------------------
# The machine stays clear of these (limits start at 1, it never closes a store); each test fails
# while the difference is there, and turns into an XPASS, which fails, once it is gone.


async def _both_stores(tmp_path: Path) -> tuple[MemoryEventStore, SqliteEventStore]:
    memory, sqlite = MemoryEventStore(), await SqliteEventStore.open(tmp_path / "events.db")
    for store in (memory, sqlite):
        maker = EventMaker()
        beats = [maker(NodeHeartbeat(node_id="a", seq=i)) for i in range(3)]
        await store.append("heartbeat/a", beats, NO_STREAM)
    return memory, sqlite


async def test_a_limit_below_one_reads_nothing_from_either_store(tmp_path: Path) -> None:
    memory, sqlite = await _both_stores(tmp_path)
    try:
        for store in (memory, sqlite):
            assert await store.read_all(1, -1) == []
            assert await store.read_for_rebuild(1, 0) == []
    finally:
        await memory.close()
        await sqlite.close()


async def test_a_closed_store_refuses_every_operation(tmp_path: Path) -> None:
    memory, sqlite = await _both_stores(tmp_path)
    snap = Snapshot(stream="node/a", version=1, schema="s", state=b"")
    await memory.close()
    await sqlite.close()
    for store in (memory, sqlite):
        operations: list[Callable[[], Awaitable[object]]] = [
            partial(store.read_stream, "heartbeat/a"),
            partial(store.stream_version, "heartbeat/a"),
            store.head,
            partial(store.load_snapshot, "node/a"),
            partial(store.save_snapshot, snap),
            partial(store.compact_heartbeats, 0),
            store.read_for_rebuild,
        ]
        for operation in operations:
            with pytest.raises(StoreClosed):
                await operation()
