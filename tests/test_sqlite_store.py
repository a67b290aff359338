"""SQLite-only behaviour: durability across reopen, damaged rows, full disk, group commit."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest

from events import (
    ANY,
    NO_STREAM,
    ConcurrencyConflict,
    DuplicateEventId,
    Envelope,
    InvalidAppend,
    NewEvent,
    NodeDrained,
    NodeHeartbeat,
    NodeRegistered,
    Snapshot,
    StoreClosed,
    StoreFull,
    Undecodable,
)
from events.errors import StoreIOError
from events.sqlite_store import SCHEMA_VERSION, SqliteEventStore
from tests.factories import EventMaker


def hb(node: str, seq: int) -> NodeHeartbeat:
    return NodeHeartbeat(node_id=node, seq=seq)


def note(node: str, seq: int) -> NodeDrained:
    """Any event of a node's own stream (heartbeats have a stream of their own)."""
    return NodeDrained(node_id=node, reason=f"note {seq}")


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "events.db"


@pytest.fixture
async def store(db_path: Path) -> AsyncIterator[SqliteEventStore]:
    s = await SqliteEventStore.open(db_path)
    try:
        yield s
    finally:
        await s.close()


def raw_insert(path: Path, rows: list[tuple[Any, ...]]) -> None:
    """Write rows behind the store's back, as a damaged file or a foreign tool would."""
    conn = sqlite3.connect(path)
    try:
        with conn:
            conn.executemany(
                "INSERT INTO events (position, event_id, stream, version, type, recorded_at, "
                "correlation_id, causation_id, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows,
            )
    finally:
        conn.close()


async def test_reopen_resumes_positions_versions_and_snapshots(db_path: Path) -> None:
    make = EventMaker()
    store = await SqliteEventStore.open(db_path)
    await store.append("node/a", [make(NodeRegistered(node_id="a")), make(note("a", 1))], NO_STREAM)
    await store.append("node/b", [make(NodeRegistered(node_id="b"))], NO_STREAM)
    await store.save_snapshot(Snapshot(stream="node/a", version=2, schema="s1", state=b"st"))
    retry = make(note("a", 2))
    assert await store.append("node/a", [retry], 2) == [4]
    await store.close()

    store = await SqliteEventStore.open(db_path)
    try:
        assert await store.head() == 4
        assert await store.stream_version("node/a") == 3
        assert await store.append("node/a", [make(note("a", 3))], 3) == [5]
        assert await store.append("node/c", [make(NodeRegistered(node_id="c"))], NO_STREAM) == [6]
        with pytest.raises(ConcurrencyConflict) as info:
            await store.append("node/b", [make(note("b", 1))], NO_STREAM)
        assert info.value.actual == 1
        # Dedup is permanent: a retry after a restart still finds its stored position.
        assert await store.append("node/a", [retry], 2) == [4]
        assert [e.version for e in await store.read_stream("node/a")] == [1, 2, 3, 4]
        assert [e.position for e in await store.read_all(1, 100)] == [1, 2, 3, 4, 5, 6]
        snap = await store.load_snapshot("node/a")
        assert snap == Snapshot(stream="node/a", version=2, schema="s1", state=b"st")
    finally:
        await store.close()


async def test_schema_is_versioned(db_path: Path) -> None:
    store = await SqliteEventStore.open(db_path)
    await store.close()
    conn = sqlite3.connect(db_path)
    try:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
        conn.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    finally:
        conn.close()
    with pytest.raises(StoreIOError, match="schema version"):
        await SqliteEventStore.open(db_path)


async def test_damaged_rows_come_back_undecodable_in_place(db_path: Path) -> None:
    make = EventMaker()
    store = await SqliteEventStore.open(db_path)
    await store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
    await store.close()
    raw_insert(
        db_path,
        [
            (2, "bad-json", "node/a", 2, "node.heartbeat.v1", 1, "", "", b'{"type": "node.hea'),
            (
                3,
                "unknown-type",
                "node/a",
                3,
                "node.exploded.v9",
                2,
                "",
                "",
                b'{"type": "node.exploded.v9", "node_id": "a"}',
            ),
            (4, "null-data", "node/a", 4, "node.heartbeat.v1", 3, None, None, None),
        ],
    )

    store = await SqliteEventStore.open(db_path)
    try:
        everything = await store.read_all(1, 100)
        assert [e.position for e in everything] == [1, 2, 3, 4]
        assert isinstance(everything[0].payload, NodeRegistered)
        bad, unknown, null = everything[1:]
        assert isinstance(bad.payload, Undecodable)
        assert bad.payload.raw == b'{"type": "node.hea'
        assert (bad.event_id, bad.version, bad.type) == ("bad-json", 2, "node.heartbeat.v1")
        assert isinstance(unknown.payload, Undecodable)
        assert unknown.type == "node.exploded.v9"
        assert b"node.exploded.v9" in unknown.payload.raw
        assert isinstance(null.payload, Undecodable)
        assert null.correlation_id == ""
        assert [e.position for e in await store.read_stream("node/a", 2)] == [2, 3, 4]

        # Subscribers see them too: a damaged row is never skipped.
        seen: list[Envelope] = []
        async for envelope in store.subscribe(2):
            seen.append(envelope)
            if len(seen) == 3:
                break
        assert [e.position for e in seen] == [2, 3, 4]

        # Appends continue after the damaged rows.
        assert await store.append("node/a", [make(note("a", 9))], 4) == [5]
    finally:
        await store.close()


def fat_registration(make: EventMaker, node: str) -> NewEvent:
    return make(NodeRegistered(node_id=node, hostname="h" * 3000))


async def test_full_disk_fails_the_whole_batch_then_recovers(store: SqliteEventStore) -> None:
    make = EventMaker()
    await store.append("node/first", [fat_registration(make, "first")], NO_STREAM)

    def freeze_size(conn: sqlite3.Connection) -> int:
        pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
        return int(conn.execute(f"PRAGMA max_page_count = {pages}").fetchone()[0])

    await store.run_on_writer(freeze_size)
    before = store.stats.transactions
    attempts = [
        store.append(f"node/n{i}", [fat_registration(make, f"n{i}")], NO_STREAM) for i in range(200)
    ]
    results = await asyncio.gather(*attempts, return_exceptions=True)
    assert all(isinstance(r, StoreFull) for r in results), results[:3]
    message = str(results[0])
    assert "disk is full" in message and "\n" not in message
    assert store.stats.transactions == before
    assert store.stats.failed_transactions >= 1
    # Nothing partial: the log and every stream are as before the batch.
    assert await store.head() == 1
    assert await store.read_all(2, 1000) == []
    assert await store.stream_version("node/n0") == 0
    check = await store.run_on_writer(lambda c: c.execute("PRAGMA integrity_check").fetchall())
    assert check == [("ok",)]

    await store.run_on_writer(
        lambda conn: conn.execute("PRAGMA max_page_count = 1073741823").fetchone()
    )
    retried = await asyncio.gather(
        *(
            store.append(f"node/n{i}", [fat_registration(make, f"n{i}")], NO_STREAM)
            for i in range(200)
        )
    )
    assert sorted(p for r in retried for p in r) == list(range(2, 202))
    assert await store.head() == 201


async def test_group_commit_batches_concurrent_appends(store: SqliteEventStore) -> None:
    make = EventMaker()
    before = store.stats.transactions
    results = await asyncio.gather(
        *(
            store.append(f"node/n{i}", [make(NodeRegistered(node_id=f"n{i}"))], NO_STREAM)
            for i in range(200)
        )
    )
    assert sorted(p for r in results for p in r) == list(range(1, 201))
    transactions = store.stats.transactions - before
    assert 1 <= transactions <= 10
    assert store.stats.largest_batch >= 20
    assert store.stats.events == 200


async def test_max_batch_caps_a_transaction(db_path: Path) -> None:
    make = EventMaker()
    store = await SqliteEventStore.open(db_path, max_batch=16)
    try:
        await asyncio.gather(
            *(
                store.append(f"node/n{i}", [make(NodeRegistered(node_id=f"n{i}"))], NO_STREAM)
                for i in range(100)
            )
        )
        assert store.stats.largest_batch <= 16
        assert store.stats.transactions >= 7
    finally:
        await store.close()


async def test_a_bad_append_fails_alone_in_its_batch(store: SqliteEventStore) -> None:
    make = EventMaker()
    taken = make(NodeRegistered(node_id="taken"))
    await store.append("node/taken", [taken], NO_STREAM)
    stolen = type(taken)(
        event_id=taken.event_id, payload=NodeRegistered(node_id="thief"), recorded_at=1
    )
    before = store.stats.transactions
    results = await asyncio.gather(
        store.append("node/x", [make(NodeRegistered(node_id="x"))], NO_STREAM),
        store.append("node/x", [make(NodeRegistered(node_id="x"))], NO_STREAM),  # loses
        store.append("node/y", [make(NodeRegistered(node_id="y"))], 3),  # wrong version
        store.append("node/thief", [stolen], NO_STREAM),  # id already used elsewhere
        store.append("node/z", [make(NodeRegistered(node_id="z")), make(note("z", 1))], NO_STREAM),
        return_exceptions=True,
    )
    assert results[0] == [2]
    assert isinstance(results[1], ConcurrencyConflict) and results[1].actual == 1
    assert isinstance(results[2], ConcurrencyConflict) and results[2].actual == 0
    assert isinstance(results[3], DuplicateEventId)
    assert results[4] == [3, 4]
    # One transaction, not one per append; the stolen id took the careful SAVEPOINT replay.
    assert store.stats.transactions - before == 1
    assert store.stats.careful_replays == 1
    assert await store.head() == 4
    assert await store.stream_version("node/thief") == 0


async def test_retry_racing_its_original_in_one_batch_writes_once(
    store: SqliteEventStore,
) -> None:
    make = EventMaker()
    batch = [make(NodeRegistered(node_id="a")), make(note("a", 1))]
    first, second = await asyncio.gather(
        store.append("node/a", batch, NO_STREAM), store.append("node/a", batch, NO_STREAM)
    )
    assert first == second == [1, 2]
    assert await store.head() == 2
    # ANY is no licence to write a retried event twice.
    assert await store.append("node/a", batch, ANY) == [1, 2]
    assert await store.head() == 2


async def test_values_sqlite_cannot_store_are_refused_up_front(store: SqliteEventStore) -> None:
    make = EventMaker()
    event = make(NodeRegistered(node_id="a"))
    odd = NewEvent(
        event_id=event.event_id,
        payload=event.payload,
        recorded_at=event.recorded_at,
        correlation_id=cast(Any, ["not", "a", "string"]),
    )
    with pytest.raises(InvalidAppend, match="correlation_id"):
        await store.append("node/a", [odd], NO_STREAM)
    assert await store.head() == 0


async def test_a_job_sqlite_cannot_bind_fails_alone_in_its_batch(store: SqliteEventStore) -> None:
    """Defence in depth behind the up-front checks: the SAVEPOINT replay isolates the job."""
    make = EventMaker()
    unbindable = Snapshot(stream="node/a", version=1, schema="s", state=cast(Any, ["x"]))
    results = await asyncio.gather(
        store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM),
        store.save_snapshot(unbindable),
        store.append("node/c", [make(NodeRegistered(node_id="c"))], NO_STREAM),
        return_exceptions=True,
    )
    assert results[0] == [1]
    assert isinstance(results[1], InvalidAppend)
    assert results[2] == [2]
    assert store.stats.careful_replays == 1
    assert await store.load_snapshot("node/a") is None


async def test_numbers_beyond_64_bits_are_refused_or_clamped(store: SqliteEventStore) -> None:
    make = EventMaker()
    with pytest.raises(InvalidAppend, match="64-bit"):
        await store.append("node/a", [make(note("a", 0), at_ns=2**63)], NO_STREAM)
    with pytest.raises(InvalidAppend, match="64-bit"):
        await store.save_snapshot(Snapshot(stream="node/a", version=2**64, schema="s", state=b""))
    await store.append("heartbeat/a", [make(hb("a", 0)), make(hb("a", 1))], NO_STREAM)
    assert await store.compact_heartbeats(2**70) == 1
    assert await store.read_all(2**70, 2**70) == []
    assert [e.version for e in await store.read_all(-(2**70), 2**70)] == [2]
    assert await store.read_stream("heartbeat/a", 2**70) == []


async def test_rows_written_behind_the_writers_back_are_caught(
    store: SqliteEventStore, db_path: Path
) -> None:
    """The version cache can go stale only if something else writes the file: the UNIQUE
    constraints catch it and the careful replay reports an honest conflict."""
    make = EventMaker()
    await store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
    raw_insert(db_path, [(2, "foreign", "node/a", 2, "node.heartbeat.v1", 1, "", "", b"{}")])
    results = await asyncio.gather(
        store.append("node/a", [make(note("a", 1))], 1),
        store.append("node/b", [make(NodeRegistered(node_id="b"))], NO_STREAM),
        return_exceptions=True,
    )
    assert isinstance(results[0], ConcurrencyConflict) and results[0].actual == 2
    assert results[1] == [3]
    assert await store.append("node/a", [make(note("a", 1))], 2) == [4]


@pytest.mark.parametrize(("mode", "code"), [("FULL", 2), ("NORMAL", 1), ("off", 0)])
async def test_synchronous_setting_is_applied(db_path: Path, mode: str, code: int) -> None:
    store = await SqliteEventStore.open(db_path, synchronous=mode)
    try:

        def pragmas(conn: sqlite3.Connection) -> tuple[int, str]:
            sync = int(conn.execute("PRAGMA synchronous").fetchone()[0])
            journal = str(conn.execute("PRAGMA journal_mode").fetchone()[0])
            return sync, journal

        assert await store.run_on_writer(pragmas) == (code, "wal")
    finally:
        await store.close()


async def test_bad_settings_are_refused(db_path: Path) -> None:
    with pytest.raises(ValueError, match="synchronous"):
        await SqliteEventStore.open(db_path, synchronous="EXTRA")
    with pytest.raises(ValueError, match="max_batch"):
        await SqliteEventStore.open(db_path, max_batch=0)


async def test_sqlite_calls_never_run_on_the_loop_thread(
    db_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: dict[str, set[int]] = {}
    real_connect: Callable[..., sqlite3.Connection] = sqlite3.connect

    def traced_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        conn = real_connect(*args, **kwargs)

        def trace(sql: str) -> None:
            threads.setdefault(sql.split()[0].upper(), set()).add(threading.get_ident())

        conn.set_trace_callback(trace)
        return conn

    monkeypatch.setattr(sqlite3, "connect", traced_connect)
    make = EventMaker()
    store = await SqliteEventStore.open(db_path)
    try:
        await store.append("node/a", [make(note("a", 0))], NO_STREAM)
        await store.save_snapshot(Snapshot(stream="node/a", version=1, schema="s", state=b""))
        await store.compact_heartbeats(0)
        await store.read_all()
        await store.read_stream("node/a")
        await store.stream_version("node/a")
        await store.load_snapshot("node/a")
        await store.head()
    finally:
        await store.close()
    loop_thread = threading.get_ident()
    used = set().union(*threads.values())
    assert {"BEGIN", "INSERT", "COMMIT", "SELECT", "DELETE"} <= set(threads)
    assert loop_thread not in used
    # One writer thread and one reader thread, each owning its connection.
    assert len(used) == 2
    assert threads["INSERT"] == threads["BEGIN"] == threads["DELETE"]


async def test_close_flushes_queued_appends_and_refuses_later_calls(db_path: Path) -> None:
    make = EventMaker()
    store = await SqliteEventStore.open(db_path)
    tasks = [
        asyncio.create_task(
            store.append(f"node/n{i}", [make(NodeRegistered(node_id=f"n{i}"))], NO_STREAM)
        )
        for i in range(50)
    ]
    await asyncio.sleep(0)  # the appends are queued, not yet written
    await asyncio.gather(store.close(), store.close())
    assert sorted(p for t in tasks for p in t.result()) == list(range(1, 51))
    with pytest.raises(StoreClosed):
        await store.append("node/late", [make(NodeRegistered(node_id="late"))], NO_STREAM)
    with pytest.raises(StoreClosed):
        await store.read_all()
    with pytest.raises(StoreClosed):
        await store.save_snapshot(Snapshot(stream="node/a", version=1, schema="s", state=b""))
    await store.close()

    reopened = await SqliteEventStore.open(db_path)
    try:
        assert await reopened.head() == 50
    finally:
        await reopened.close()


async def test_an_append_cancelled_while_queued_is_not_written(store: SqliteEventStore) -> None:
    make = EventMaker()
    task = asyncio.create_task(
        store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
    )
    await asyncio.sleep(0)  # queued; the batch leaves on the next turn of the loop
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await store.head() == 0
    assert await store.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM) == [1]


async def test_read_all_returns_large_pages_in_order(store: SqliteEventStore) -> None:
    make = EventMaker()
    await asyncio.gather(
        *(
            store.append(f"node/n{i}", [make(note(f"n{i}", j)) for j in range(50)], NO_STREAM)
            for i in range(100)
        )
    )
    page = await store.read_all(1, 50_000)
    assert [e.position for e in page] == list(range(1, 5001))
    assert [e.position for e in await store.read_all(4990, 50_000)] == list(range(4990, 5001))
    assert await store.read_all(1, 0) == []


async def test_recent_commits_read_back_as_the_file_holds_them(
    store: SqliteEventStore, db_path: Path
) -> None:
    """Pages at the head come from memory (decoded once for every subscriber): they must be
    what a fresh reader of the file gets, field for field."""
    make = EventMaker()
    await store.append("node/a", [make(NodeRegistered(node_id="a", region="eu"))], NO_STREAM)
    await asyncio.gather(
        *(store.append(f"node/n{i}", [make(note(f"n{i}", 1))], NO_STREAM) for i in range(20))
    )
    await store.append("node/a", [make(note("a", 1)), make(note("a", 2))], 1)
    fresh = await SqliteEventStore.open(db_path)
    try:
        for start in (1, 2, 21, 23, 24):
            assert await store.read_all(start, 5) == await fresh.read_all(start, 5)
    finally:
        await fresh.close()


async def test_a_second_writer_leaves_no_hole_in_what_subscribers_read(
    store: SqliteEventStore, db_path: Path
) -> None:
    """Another writer on the file puts rows between this store's commits; the events this
    store keeps in memory then have a gap, and a reader must get those rows from the file."""
    make = EventMaker()
    await store.append("node/a", [make(NodeRegistered(node_id="a")), make(note("a", 1))], NO_STREAM)
    other = await SqliteEventStore.open(db_path)
    try:
        assert await other.append("node/b", [make(NodeRegistered(node_id="b"))], NO_STREAM) == [3]
    finally:
        await other.close()
    assert await store.append("node/a", [make(note("a", 2))], 2) == [4]
    assert [e.stream for e in await store.read_all(1, 10)] == ["node/a"] * 2 + ["node/b", "node/a"]
    assert [e.position for e in await store.read_all(3, 10)] == [3, 4]


async def test_compaction_is_seen_by_readers_at_the_head(store: SqliteEventStore) -> None:
    make = EventMaker(step_ns=1_000_000_000)
    await store.append("heartbeat/a", [make(hb("a", i)) for i in range(5)], NO_STREAM)
    assert await store.compact_heartbeats(make.now_ns + 1) == 4
    assert [e.position for e in await store.read_all(1, 10)] == [5]


async def test_compaction_survives_reopen(db_path: Path) -> None:
    make = EventMaker(step_ns=1_000_000_000)
    store = await SqliteEventStore.open(db_path)
    await store.append("heartbeat/a", [make(hb("a", i)) for i in range(10)], NO_STREAM)
    assert await store.compact_heartbeats(make.now_ns + 1) == 9
    await store.close()
    store = await SqliteEventStore.open(db_path)
    try:
        assert [e.version for e in await store.read_stream("heartbeat/a")] == [10]
        assert await store.append("heartbeat/a", [make(hb("a", 10))], 10) == [11]
    finally:
        await store.close()


async def test_storage_errors_are_translated(tmp_path: Path) -> None:
    with pytest.raises(StoreIOError, match="unable to open"):
        await SqliteEventStore.open(tmp_path)  # a directory, not a file


async def test_append_many_is_one_transaction_for_many_streams(db_path: Path) -> None:
    """The point of append_many: a turn's heartbeats from 500 nodes cost one commit, and more
    than a batch's worth still all commit, in order."""
    store = await SqliteEventStore.open(db_path, max_batch=1000)
    try:
        make = EventMaker()
        before = store.stats.transactions
        results = await store.append_many(
            [(f"heartbeat/n{i}", [make(hb(f"n{i}", 1))], NO_STREAM) for i in range(500)]
        )
        assert store.stats.transactions - before == 1
        assert results == [[i] for i in range(1, 501)]
        results = await store.append_many(
            [(f"heartbeat/m{i}", [make(hb(f"m{i}", 1))], NO_STREAM) for i in range(2500)]
        )
        assert results == [[i] for i in range(501, 3001)]
        assert await store.head() == 3000
    finally:
        await store.close()


async def test_append_many_reports_storage_errors_per_append(db_path: Path) -> None:
    store = await SqliteEventStore.open(db_path)
    try:
        make = EventMaker()
        await store.run_on_writer(
            lambda conn: conn.execute(
                "PRAGMA max_page_count = " + str(conn.execute("PRAGMA page_count").fetchone()[0])
            )
        )
        big = "x" * 200_000  # more than the file's free pages can take
        results = await store.append_many(
            [("node/a", [make(NodeRegistered(node_id="a", hostname=big))], NO_STREAM)]
        )
        assert isinstance(results[0], StoreFull)
        assert await store.head() == 0
    finally:
        await store.close()


async def test_a_log_from_before_heartbeat_streams_still_folds_and_grows(db_path: Path) -> None:
    """Logs written before 2026-11-24 hold heartbeats in node/<id>. They stay readable: the
    folds key heartbeats by node, not stream; the node stream keeps its versions for the
    NodeActor; new heartbeats start heartbeat/<id> at 1; compaction and the rebuild reader
    handle both."""
    import projections
    from events.codec import encode_payload

    make = EventMaker(step_ns=1_000_000_000)
    old = [make(NodeRegistered(node_id="a")), make(hb("a", 1)), make(hb("a", 2))]
    store = await SqliteEventStore.open(db_path)  # creates the schema
    await store.close()
    raw_insert(
        db_path,
        [
            (
                i,
                e.event_id,
                "node/a",
                i,
                e.type,
                e.recorded_at,
                e.correlation_id,
                "",
                encode_payload(e.payload),
            )
            for i, e in enumerate(old, start=1)
        ],
    )
    store = await SqliteEventStore.open(db_path)
    try:
        state = projections.rebuild(await store.read_all(1, 100))
        assert state.nodes.nodes["a"].last_heartbeat_seq == 2
        assert await store.stream_version("node/a") == 3  # the NodeActor goes on from here
        await store.append("node/a", [make(note("a", 1))], 3)
        assert await store.append_many([("heartbeat/a", [make(hb("a", 3))], 0)]) == [[5]]
        everything = await store.read_all(1, 100)
        state = projections.rebuild(everything)
        assert state.nodes.nodes["a"].last_heartbeat_seq == 3
        fast = projections.rebuild(await store.read_for_rebuild(1, 100))
        assert fast == state
        # Each stream's latest heartbeat is kept: the old stream's last one, and the new one.
        assert await store.compact_heartbeats(make.now_ns + 1) == 1
        assert projections.rebuild(await store.read_all(1, 100)) == state
    finally:
        await store.close()
