"""The durable event store: one SQLite file in WAL mode, written by one group-committing writer.

Design (shared notes, sections 1.9 and 3.3-3.5):

- Exactly one writer connection, living in its own single-thread executor. `append()` only
  queues work; a dispatcher on the event loop hands up to `max_batch` queued appends at a time
  to that thread, which commits them in ONE transaction, so the fsync of `synchronous=FULL` is
  paid once per batch instead of once per append. One batch is in flight at a time: whatever
  queues meanwhile forms the next batch (group commit).
- Appends are validated against an in-memory cache of stream versions before anything is
  written, so a conflicting append fails alone and its batch-mates are written with a single
  `executemany`. The UNIQUE constraints stay as the backstop: if one ever fires, the batch is
  rolled back and replayed carefully, one SAVEPOINT per append, against fresh reads.
- Reads use a second connection in a second thread; WAL lets them run beside the writer.
- sqlite3 exceptions never leave this module: they become StoreFull or StoreIOError.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from collections import deque
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Final, TypeVar, cast

import sqlite_utils

from ._append_rules import check_batch
from ._commit_signal import CommitSignal, follow, follow_batches
from .catalog import HEARTBEAT_TYPE
from .codec import decode_payload, encode_payload
from .envelope import Envelope, NewEvent, Undecodable
from .errors import (
    ConcurrencyConflict,
    DuplicateEventId,
    EventStoreError,
    InvalidAppend,
    StoreClosed,
    StoreFull,
    StoreIOError,
)
from .store import ANY, Snapshot

__all__ = ["SCHEMA_VERSION", "SqliteEventStore", "StoreStats"]

T = TypeVar("T")

SCHEMA_VERSION: Final = 1
"""Stored in PRAGMA user_version; bump it and add a step to _MIGRATIONS for every change."""

_SYNCHRONOUS_MODES: Final = ("FULL", "NORMAL", "OFF")

# A cache, not the truth: when it grows past this many streams it is dropped and refilled from
# the database on demand, so replica churn cannot grow the writer's memory without bound.
_VERSION_CACHE_LIMIT: Final = 200_000

_COLUMNS: Final = (
    "position, event_id, stream, version, type, recorded_at, correlation_id, causation_id, data"
)
_INSERT_EVENT: Final = f"INSERT INTO events ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)"
_SELECT_EVENTS: Final = f"SELECT {_COLUMNS} FROM events"
_READ_ALL: Final = f"{_SELECT_EVENTS} WHERE position >= ? ORDER BY position LIMIT ?"
# Heartbeats that a later heartbeat of their stream supersedes are skipped in SQLite's C loop.
# ?5 is a JSON array of each stream's latest heartbeat as of position ?3; newer ones are kept.
_LATEST_HEARTBEATS: Final = "SELECT MAX(position) FROM events WHERE type = ? GROUP BY stream"
_READ_FOR_REBUILD: Final = (
    f"{_SELECT_EVENTS} WHERE position >= ?1 AND (type != ?4 OR position > ?3 OR position IN "
    "(SELECT value FROM json_each(?5))) ORDER BY position LIMIT ?2"
)
_READ_STREAM: Final = f"{_SELECT_EVENTS} WHERE stream = ? AND version >= ? ORDER BY version"
_STREAM_VERSION: Final = "SELECT MAX(version) FROM events WHERE stream = ?"
_FIND_ID: Final = "SELECT stream, position FROM events WHERE event_id = ?"
_UPSERT_SNAPSHOT: Final = (
    "INSERT INTO snapshots (stream, version, schema, state) VALUES (?, ?, ?, ?) "
    "ON CONFLICT (stream) DO UPDATE SET "
    "version = excluded.version, schema = excluded.schema, state = excluded.state"
)
# The latest heartbeat of every stream survives whatever its age, as in the memory store.
_COMPACT: Final = (
    "DELETE FROM events WHERE type = ? AND recorded_at < ? AND position NOT IN "
    "(SELECT MAX(position) FROM events WHERE type = ? GROUP BY stream)"
)

# WAL pages before an automatic checkpoint (about 40 MiB at 4 KiB pages). Each commit rewrites
# the (stream, version) index leaf of every stream it touches; a longer WAL lets a checkpoint
# copy such a page once instead of once per commit. Measured with 1,000 streams on a 500k-row
# file, FULL: 14k events/s at the default 1,000 pages, 27k at 10,000.
_WAL_AUTOCHECKPOINT: Final = 10_000

# The latest commits kept in memory, so subscribers that follow the head (the live state, the
# outbox) take them from here instead of each reading and decoding them back from the file; each
# is decoded once, by the first reader. Holds between this many and twice as many; a subscriber
# further behind reads SQLite.
_TAIL_EVENTS: Final = 4096

_INT64_MIN: Final = -(2**63)
_INT64_MAX: Final = 2**63 - 1

# Failures that belong to one append's rows, not to the storage: the batch is replayed with a
# SAVEPOINT per append so only the append that caused one fails. IntegrityError is a UNIQUE or
# NOT NULL constraint; the others are values SQLite cannot bind.
_ROW_ERRORS: Final = (
    sqlite3.IntegrityError,
    sqlite3.InterfaceError,
    sqlite3.ProgrammingError,
    OverflowError,
    TypeError,
    ValueError,
)

# A row as the writer binds it, in _COLUMNS order. `append()` builds it on the loop thread with
# position and version left at 0; the writer thread fills both in place when it plans the batch.
_Row = list[Any]


def _migrate_to_1(db: sqlite_utils.Database) -> None:
    events = db.table("events")
    events.create(
        {
            "position": int,
            "event_id": str,
            "stream": str,
            "version": int,
            "type": str,
            "recorded_at": int,
            "correlation_id": str,
            "causation_id": str,
            "data": bytes,
        },
        pk="position",
        not_null={"event_id", "stream", "version", "type", "recorded_at"},
    )
    events.create_index(["event_id"], index_name="events_event_id", unique=True)
    events.create_index(["stream", "version"], index_name="events_stream_version", unique=True)
    db.table("snapshots").create(
        {"stream": str, "version": int, "schema": str, "state": bytes},
        pk="stream",
        not_null={"version", "schema", "state"},
    )


# _MIGRATIONS[n] takes a file at user_version n to n + 1.
_MIGRATIONS: Final[dict[int, Callable[[sqlite_utils.Database], None]]] = {0: _migrate_to_1}


@dataclass
class StoreStats:
    """Counters for tests and benchmarks; updated on the event loop after each write."""

    transactions: int = 0  # committed write transactions
    failed_transactions: int = 0  # rolled back because of a storage error
    appends: int = 0  # appends that wrote events
    events: int = 0  # events written
    largest_batch: int = 0  # most jobs committed in one transaction
    careful_replays: int = 0  # batches replayed with one SAVEPOINT per job


def _settle(future: asyncio.Future[T], error: BaseException | None, result: T) -> None:
    """Resolve a job's future on the loop thread, unless its caller already gave up on it."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass(slots=True, eq=False)
class _Group:
    """The appends of one append_many: one future for all of them, resolved by the last."""

    future: asyncio.Future[None]
    results: list[list[int] | EventStoreError]
    waiting: int = 0

    def settle(self, index: int, error: BaseException | None, positions: list[int]) -> None:
        if self.future.done():
            return
        if error is None:
            self.results[index] = positions
        elif isinstance(error, EventStoreError):
            self.results[index] = error
        else:  # a bug, not a storage outcome: the caller sees it raised
            self.future.set_exception(error)
            return
        self.waiting -= 1
        if self.waiting == 0:
            self.future.set_result(None)


@dataclass(slots=True, eq=False)
class _Append:
    stream: str
    expected: int
    rows: list[_Row]
    future: asyncio.Future[Any]
    positions: list[int] | None = None
    error: BaseException | None = None
    wrote: bool = False
    group: _Group | None = None  # set when this append is one of an append_many
    index: int = 0

    def settle(self) -> None:
        assert self.error is not None or self.positions is not None
        if self.group is None:
            _settle(self.future, self.error, self.positions or [])
        else:
            self.group.settle(self.index, self.error, self.positions or [])


@dataclass(slots=True, eq=False)
class _SaveSnapshot:
    snapshot: Snapshot
    future: asyncio.Future[None]
    error: BaseException | None = None

    def settle(self) -> None:
        _settle(self.future, self.error, None)


@dataclass(slots=True, eq=False)
class _Compact:
    older_than_ns: int
    future: asyncio.Future[int]
    removed: int = 0
    error: BaseException | None = None

    def settle(self) -> None:
        _settle(self.future, self.error, self.removed)


_Job = _Append | _SaveSnapshot | _Compact


@dataclass(slots=True)
class _BatchOutcome:
    committed: bool = False
    appends: int = 0
    events: int = 0
    careful: bool = False


@dataclass(slots=True)
class _Plan:
    """What one transaction will write; applied to the writer's state only after COMMIT."""

    next_position: int
    versions: dict[str, int] = field(default_factory=dict)
    ids: dict[str, tuple[str, int]] = field(default_factory=dict)
    appends: int = 0  # appends that write events
    events: int = 0


def _clamp(value: int) -> int:
    """Positions, versions and times are stored in 64 bits: a bound past them means "all"."""
    return min(max(value, _INT64_MIN), _INT64_MAX)


def _check_storable(events: Sequence[NewEvent]) -> None:
    """Refuse, before it is queued, what SQLite could not bind: it would fail a whole batch."""
    for e in events:
        if type(e.recorded_at) is not int or not _INT64_MIN <= e.recorded_at <= _INT64_MAX:
            raise InvalidAppend(f"recorded_at {e.recorded_at!r} is not a 64-bit integer")
        if not (type(e.event_id) is type(e.correlation_id) is type(e.causation_id) is str):
            for name in ("event_id", "correlation_id", "causation_id"):
                if type(getattr(e, name)) is not str:
                    raise InvalidAppend(f"{name} {getattr(e, name)!r} is not a string")


def _is_disk_full(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF == sqlite3.SQLITE_FULL
    return "database or disk is full" in str(exc)


def _as_bytes(value: object) -> bytes:
    """Hand-edited or damaged rows can hold TEXT or NULL where a BLOB belongs."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if value is None:
        return b""
    return str(value).encode()


def _envelope(row: Sequence[Any]) -> Envelope:
    position, event_id, stream, version, type_, recorded_at, correlation, causation, data = row
    if (
        type(data) is bytes
        and type(type_) is str
        and type(event_id) is str
        and type(stream) is str
        and type(version) is int
        and type(recorded_at) is int
    ):
        return Envelope(
            event_id=event_id,
            stream=stream,
            version=version,
            position=position,
            type=type_,
            recorded_at=recorded_at,
            correlation_id=correlation or "",
            causation_id=causation or "",
            payload=decode_payload(type_, data),
        )
    return _damaged_envelope(row)


def _damaged_envelope(row: Sequence[Any]) -> Envelope:
    """A row _envelope found a column of the wrong type in."""
    position, event_id, stream, version, type_, recorded_at, correlation, causation, data = row
    if type(data) is not bytes:
        data = _as_bytes(data)
    type_tag = type_ if type(type_) is str else ("" if type_ is None else str(type_))
    # A damaged row (a column not of the schema's type) reads back in place as Undecodable,
    # with safe values, rather than handing a fold or an actor bytes where it expects text.
    wrong = [
        name
        for name, value, kind in (
            ("event_id", event_id, str),
            ("stream", stream, str),
            ("version", version, int),
            ("recorded_at", recorded_at, int),
        )
        if type(value) is not kind
    ]
    if wrong:
        return Envelope(
            event_id=event_id if type(event_id) is str else "",
            stream=stream if type(stream) is str else "",
            version=version if type(version) is int else 0,
            position=position,
            type=type_tag,
            recorded_at=recorded_at if type(recorded_at) is int else 0,
            payload=Undecodable(
                raw=data, error=f"damaged row: {', '.join(wrong)} not of the schema's type"
            ),
        )
    # Only the payload or its type tag was off: read as a clean row, which decodes what it can.
    return _envelope(
        (position, event_id, stream, version, type_tag, recorded_at, correlation, causation, data)
    )


class SqliteEventStore:
    """The EventStore protocol on one SQLite file; create it with `await SqliteEventStore.open()`.

    Not thread-safe: use it from the event loop it was opened on.
    """

    def __init__(
        self, path: Path, synchronous: str, max_batch: int, loop: asyncio.AbstractEventLoop
    ) -> None:
        self.path = path
        self.synchronous = synchronous
        self.max_batch = max_batch
        self.stats = StoreStats()
        self._signal = CommitSignal()
        self._loop = loop
        self._pending: deque[_Job] = deque()
        self._busy = False  # a batch is on the writer thread
        self._dispatch_scheduled = False
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._closing = False  # set by close(): no new work is accepted from then on
        self._close_task: asyncio.Task[None] | None = None
        # Both executors have exactly one thread, so each connection is only ever used by the
        # thread that created it, and blocking sqlite calls never run on the event loop.
        self._write_executor = ThreadPoolExecutor(1, thread_name_prefix="eventstore-writer")
        self._read_executor = ThreadPoolExecutor(1, thread_name_prefix="eventstore-reader")
        self._latest_heartbeats: tuple[int, str] | None = None  # see _read_for_rebuild_sync
        # The last commits, contiguous from position _tail_start (see _TAIL_EVENTS): each a row
        # as written until a reader decodes it in place. Touched on the loop thread only.
        self._tail: list[Envelope | _Row] = []
        self._tail_start = 0
        # Writer-thread state: touched only by code running in _write_executor.
        self._wconn: sqlite3.Connection | None = None
        self._versions: dict[str, int] = {}
        self._next_position = 1
        # Reader-thread state.
        self._rconn: sqlite3.Connection | None = None

    @classmethod
    async def open(
        cls, path: str | Path, *, synchronous: str = "FULL", max_batch: int = 1000
    ) -> SqliteEventStore:
        """Open or create the store at `path`; an existing file resumes where it stopped."""
        mode = synchronous.upper()
        if mode not in _SYNCHRONOUS_MODES:
            raise ValueError(
                f"synchronous must be one of {_SYNCHRONOUS_MODES}, not {synchronous!r}"
            )
        if max_batch < 1:
            raise ValueError(f"max_batch must be at least 1, not {max_batch}")
        loop = asyncio.get_running_loop()
        store = cls(Path(path), mode, max_batch, loop)
        try:
            await loop.run_in_executor(store._write_executor, store._open_writer)
            await loop.run_in_executor(store._read_executor, store._open_reader)
        except BaseException:
            await store._shutdown_connections()
            raise
        return store

    # ---------------------------------------------------------------- protocol: writes

    async def append(
        self, stream: str, events: Sequence[NewEvent], expected_version: int
    ) -> list[int]:
        if self._closing:
            raise StoreClosed()
        check_batch(stream, events, expected_version)
        if not events:
            return []
        _check_storable(events)
        future: asyncio.Future[list[int]] = self._loop.create_future()
        self._enqueue(_Append(stream, expected_version, self._rows(stream, events), future))
        return await future

    async def append_many(
        self, appends: Sequence[tuple[str, Sequence[NewEvent], int]]
    ) -> list[list[int] | EventStoreError]:
        if self._closing:
            raise StoreClosed()
        results: list[list[int] | EventStoreError] = [[] for _ in appends]
        group = _Group(self._loop.create_future(), results)
        jobs: list[_Append] = []
        for index, (stream, events, expected_version) in enumerate(appends):
            try:
                check_batch(stream, events, expected_version)
                _check_storable(events)
            except EventStoreError as exc:
                results[index] = exc
                continue
            if events:
                rows = self._rows(stream, events)
                jobs.append(
                    _Append(stream, expected_version, rows, group.future, group=group, index=index)
                )
        if not jobs:
            return results
        group.waiting = len(jobs)
        self._pending.extend(jobs)
        self._schedule_dispatch()
        await group.future
        return results

    @staticmethod
    def _rows(stream: str, events: Sequence[NewEvent]) -> list[_Row]:
        # Rows are built here so the writer thread, through which every write must pass, only
        # numbers and binds them.
        return [
            [
                0,
                e.event_id,
                stream,
                0,
                e.type,
                e.recorded_at,
                e.correlation_id,
                e.causation_id,
                encode_payload(e.payload),
            ]
            for e in events
        ]

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        if self._closing:
            raise StoreClosed()
        if type(snapshot.version) is not int or not _INT64_MIN <= snapshot.version <= _INT64_MAX:
            raise InvalidAppend(f"snapshot version {snapshot.version!r} is not a 64-bit integer")
        future: asyncio.Future[None] = self._loop.create_future()
        self._enqueue(_SaveSnapshot(snapshot, future))
        await future

    async def compact_heartbeats(self, older_than_ns: int) -> int:
        if self._closing:
            raise StoreClosed()
        future: asyncio.Future[int] = self._loop.create_future()
        self._enqueue(_Compact(older_than_ns, future))
        return await future

    # ---------------------------------------------------------------- protocol: reads

    async def read_stream(self, stream: str, from_version: int = 1) -> list[Envelope]:
        return await self._read(self._read_stream_sync, stream, _clamp(from_version))

    async def stream_version(self, stream: str) -> int:
        return await self._read(self._stream_version_sync, stream)

    async def read_for_rebuild(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        """See events.store.RebuildReader."""
        if limit <= 0:
            return []
        return await self._read(self._read_for_rebuild_sync, from_position, limit)

    async def read_all(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        if self._closing:
            raise StoreClosed()
        if limit <= 0:
            return []
        cached = self._from_tail(from_position, limit)
        if cached is not None:
            return cached
        return await self._read(self._read_all_sync, _clamp(from_position), _clamp(limit))

    def subscribe(self, from_position: int = 1) -> AsyncGenerator[Envelope, None]:
        return follow(self._read_for_subscriber, self._signal, from_position)

    def subscribe_batches(self, from_position: int = 1) -> AsyncGenerator[list[Envelope], None]:
        return follow_batches(self._read_for_subscriber, self._signal, from_position)

    async def head(self) -> int:
        return await self._read(self._head_sync)

    async def load_snapshot(self, stream: str) -> Snapshot | None:
        return await self._read(self._load_snapshot_sync, stream)

    async def close(self) -> None:
        """Flush queued appends, stop the writer and close both connections. Idempotent."""
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    # ---------------------------------------------------------------- diagnostics

    async def run_on_writer(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(connection)` on the writer thread, between transactions.

        For tests and operators: read back pragmas, or lower `PRAGMA max_page_count` (a
        per-connection setting, so only the writer's own connection can simulate a full disk).
        sqlite3 errors are translated like any other.
        """
        if self._closing:
            raise StoreClosed()

        def call() -> T:
            return fn(self._writer_conn())

        try:
            return await asyncio.get_running_loop().run_in_executor(self._write_executor, call)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    # ---------------------------------------------------------------- the dispatcher (loop)

    def _enqueue(self, job: _Job) -> None:
        self._pending.append(job)
        self._schedule_dispatch()

    def _schedule_dispatch(self) -> None:
        # call_soon, not an immediate dispatch: every append made in this turn of the loop
        # (say, 1,000 actors woken by the last commit) joins the batch before it leaves.
        if not self._busy and not self._dispatch_scheduled:
            self._dispatch_scheduled = True
            self._loop.call_soon(self._dispatch)

    def _take_batch(self) -> list[_Job]:
        """Queued appends and snapshot saves share a transaction; a compaction runs alone."""
        batch: list[_Job] = []
        pending = self._pending
        while pending and len(batch) < self.max_batch:
            job = pending[0]
            if job.future.cancelled():
                # Its caller gave up before the write started: nobody is waiting for it.
                pending.popleft()
                continue
            if isinstance(job, _Compact):
                if not batch:
                    batch.append(pending.popleft())
                break
            batch.append(pending.popleft())
        return batch

    def _dispatch(self) -> None:
        self._dispatch_scheduled = False
        if self._busy:
            return
        batch = self._take_batch()
        if not batch:
            waiters, self._idle_waiters = self._idle_waiters, []
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_result(None)
            return
        self._busy = True
        done = self._write_executor.submit(self._write_batch, batch)
        done.add_done_callback(partial(self._wake_loop, batch))

    def _wake_loop(self, batch: list[_Job], done: Future[_BatchOutcome]) -> None:
        """Runs on the writer thread when a batch is finished."""
        self._loop.call_soon_threadsafe(self._batch_done, batch, done)

    def _batch_done(self, batch: list[_Job], done: Future[_BatchOutcome]) -> None:
        self._busy = False
        try:
            outcome = done.result()
        except Exception as exc:  # a bug, not a storage error: fail the batch and go on
            for job in batch:
                job.error = exc
            outcome = _BatchOutcome()
        if outcome.events:
            self._remember(batch)
        elif outcome.committed and type(batch[0]) is _Compact:
            # Deleted rows may be in the tail; the file is the truth for what is still there.
            self._tail.clear()
        for job in batch:
            job.settle()
        self._record(outcome, len(batch))
        if outcome.events:
            self._signal.fire()
        # Appends that queued while this batch was being written leave together, now.
        self._dispatch()

    def _remember(self, batch: list[_Job]) -> None:
        """Keep the rows just committed for the subscribers at the head (see _TAIL_EVENTS)."""
        tail = self._tail
        for job in batch:
            if type(job) is not _Append or not job.wrote or job.error is not None:
                continue
            for row in job.rows:
                if row[0] != self._tail_start + len(tail):
                    # A gap (only another writer on the file makes one): start again from here.
                    tail.clear()
                    self._tail_start = row[0]
                tail.append(row)
        if len(tail) > 2 * _TAIL_EVENTS:
            drop = len(tail) - _TAIL_EVENTS
            del tail[:drop]
            self._tail_start += drop

    def _from_tail(self, from_position: int, limit: int) -> list[Envelope] | None:
        """The page from the tail, or None when the tail does not hold `from_position`."""
        tail = self._tail
        offset = from_position - self._tail_start
        if offset < 0 or offset >= len(tail):
            return None
        end = min(offset + limit, len(tail))
        for i in range(offset, end):
            item = tail[i]
            if type(item) is list:
                tail[i] = _envelope(item)
        return cast(list[Envelope], tail[offset:end])  # every item decoded just above

    def _record(self, outcome: _BatchOutcome, jobs: int) -> None:
        stats = self.stats
        if outcome.committed:
            stats.transactions += 1
            stats.largest_batch = max(stats.largest_batch, jobs)
        else:
            stats.failed_transactions += 1
        stats.appends += outcome.appends
        stats.events += outcome.events
        if outcome.careful:
            stats.careful_replays += 1

    async def _close(self) -> None:
        self._closing = True
        while self._busy or self._pending:
            waiter: asyncio.Future[None] = self._loop.create_future()
            self._idle_waiters.append(waiter)
            self._schedule_dispatch()
            await waiter
        try:
            await self._shutdown_connections()
        finally:
            self._signal.close()

    async def _shutdown_connections(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Queued behind any read or write in flight, so those finish first.
            await loop.run_in_executor(self._write_executor, self._close_writer)
            await loop.run_in_executor(self._read_executor, self._close_reader)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        finally:
            # Both threads are idle now; joining them would only block the loop.
            self._write_executor.shutdown(wait=False)
            self._read_executor.shutdown(wait=False)

    # ---------------------------------------------------------------- writer thread

    def _writer_conn(self) -> sqlite3.Connection:
        if self._wconn is None:
            raise StoreClosed()
        return self._wconn

    def _open_writer(self) -> None:
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=5.0)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        self._wconn = conn
        try:
            mode = conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if str(mode).lower() != "wal":
                raise StoreIOError(f"event store {self.path}: cannot enable WAL (got {mode})")
            conn.execute(f"PRAGMA synchronous = {self.synchronous}")
            # A larger page cache keeps the event_id and (stream, version) index pages hot.
            conn.execute("PRAGMA cache_size = -65536")
            conn.execute("PRAGMA temp_store = MEMORY")
            conn.execute(f"PRAGMA wal_autocheckpoint = {_WAL_AUTOCHECKPOINT}")
            self._migrate(conn)
            top = conn.execute("SELECT MAX(position) FROM events").fetchone()[0]
            self._next_position = (top or 0) + 1
        except sqlite3.Error as exc:
            self._close_writer()
            raise self._translate(exc) from exc
        except BaseException:
            self._close_writer()
            raise

    def _migrate(self, conn: sqlite3.Connection) -> None:
        if int(conn.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION:
            # Current already: take no write lock, so opening beside a live writer (e.g.
            # `gpumesh events tail`) does not wait for it.
            return
        db = sqlite_utils.Database(conn, execute_plugins=False)
        conn.execute("BEGIN IMMEDIATE")
        try:
            version = int(conn.execute("PRAGMA user_version").fetchone()[0])
            if version > SCHEMA_VERSION:
                raise StoreIOError(
                    f"event store {self.path} has schema version {version}; this build "
                    f"understands up to {SCHEMA_VERSION}: upgrade gpumesh"
                )
            while version < SCHEMA_VERSION:
                _MIGRATIONS[version](db)
                version += 1
            conn.execute(f"PRAGMA user_version = {version}")
            conn.execute("COMMIT")
        except BaseException:
            self._rollback(conn)
            raise

    def _close_writer(self) -> None:
        conn, self._wconn = self._wconn, None
        if conn is not None:
            conn.close()

    @staticmethod
    def _rollback(conn: sqlite3.Connection) -> None:
        # After SQLITE_FULL or an I/O error SQLite may already have rolled back by itself.
        if conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except sqlite3.Error:
                pass

    def _write_batch(self, batch: list[_Job]) -> _BatchOutcome:
        """Runs on the writer thread. Sets each job's result or error; never raises sqlite3."""
        conn = self._writer_conn()
        if len(batch) == 1 and isinstance(batch[0], _Compact):
            return self._compact(conn, batch[0])
        try:
            plan = self._transaction(conn, batch, careful=False)
            outcome = _BatchOutcome()
        except _ROW_ERRORS:
            # A constraint fired (the version cache disagreed with the file, which nothing in
            # this process causes, or an id was taken by another stream) or a value could not
            # be bound: forget the cache and replay against fresh reads, isolating each job.
            self._rollback(conn)
            self._versions.clear()
            outcome = _BatchOutcome(careful=True)
            try:
                plan = self._transaction(conn, batch, careful=True)
            except sqlite3.Error as exc:
                return self._fail_batch(conn, batch, exc, outcome)
        except sqlite3.Error as exc:
            return self._fail_batch(conn, batch, exc, _BatchOutcome())
        self._next_position = plan.next_position
        if len(self._versions) + len(plan.versions) > _VERSION_CACHE_LIMIT:
            self._versions.clear()
        self._versions.update(plan.versions)
        outcome.committed = True
        outcome.appends = plan.appends
        outcome.events = plan.events
        return outcome

    def _fail_batch(
        self,
        conn: sqlite3.Connection,
        batch: list[_Job],
        exc: sqlite3.Error,
        outcome: _BatchOutcome,
    ) -> _BatchOutcome:
        """The transaction is gone, so every job in it fails with the same storage error."""
        self._rollback(conn)
        for job in batch:
            error = self._translate(exc)
            error.__cause__ = exc
            job.error = error
            if isinstance(job, _Append):
                job.positions = None
                job.wrote = False
        return outcome

    def _transaction(self, conn: sqlite3.Connection, batch: list[_Job], *, careful: bool) -> _Plan:
        conn.execute("BEGIN IMMEDIATE")
        try:
            plan = _Plan(next_position=self._next_position)
            if careful:
                top = conn.execute("SELECT MAX(position) FROM events").fetchone()[0]
                plan.next_position = max(plan.next_position, (top or 0) + 1)
                for job in batch:
                    self._reset(job)
                    self._careful(conn, job, plan)
            else:
                rows = self._plan_batch(conn, batch, plan)
                if rows:
                    conn.executemany(_INSERT_EVENT, rows)
            conn.execute("COMMIT")
        except BaseException:
            self._rollback(conn)
            raise
        return plan

    @staticmethod
    def _reset(job: _Job) -> None:
        job.error = None
        if isinstance(job, _Append):
            job.positions, job.wrote = None, False

    @staticmethod
    def _save_snapshot(conn: sqlite3.Connection, job: _SaveSnapshot) -> None:
        s = job.snapshot
        conn.execute(_UPSERT_SNAPSHOT, (s.stream, s.version, s.schema, s.state))

    def _plan_batch(self, conn: sqlite3.Connection, batch: list[_Job], plan: _Plan) -> list[_Row]:
        """The hot path: check each append against the version cache and number its rows.

        An append whose expected version matches, in a batch with no id repeated, needs
        nothing else: it cannot be a retry of a stored append (that would have moved the
        stream past the version it expects). Everything else takes the general path.
        """
        ids = [row[1] for job in batch if type(job) is _Append for row in job.rows]
        ids_repeat = len(set(ids)) != len(ids)
        rows: list[_Row] = []
        versions = plan.versions
        cache = self._versions
        # Jobs arrive fresh (no error, no positions), so the hot path skips _reset.
        for job in batch:
            if type(job) is not _Append:
                if isinstance(job, _SaveSnapshot):
                    self._save_snapshot(conn, job)
                continue
            stream = job.stream
            actual = versions.get(stream)
            if actual is None:
                actual = cache.get(stream)
                if actual is None:
                    actual = self._stored_version(conn, stream)
            if ids_repeat or job.expected != actual:  # ANY (-1) never equals a version
                self._plan_append(conn, job, plan, rows, actual)
                continue
            start = position = plan.next_position
            version = actual
            job_rows = job.rows
            for row in job_rows:
                version += 1
                row[0] = position
                row[3] = version
                position += 1
            rows.extend(job_rows)
            job.positions = [start] if position == start + 1 else list(range(start, position))
            job.wrote = True
            plan.next_position = position
            plan.appends += 1
            plan.events += len(job_rows)
            versions[stream] = version
        return rows

    @staticmethod
    def _stored_version(conn: sqlite3.Connection, stream: str) -> int:
        found = conn.execute(_STREAM_VERSION, (stream,)).fetchone()[0]
        return int(found or 0)

    def _current_version(self, conn: sqlite3.Connection, stream: str, plan: _Plan) -> int:
        version = plan.versions.get(stream)
        if version is not None:
            return version
        version = self._versions.get(stream)
        if version is not None:
            return version
        return self._stored_version(conn, stream)

    def _stored_ids(
        self, conn: sqlite3.Connection, job: _Append, plan: _Plan, *, in_file: bool
    ) -> list[tuple[str, int] | None]:
        """Where each of the job's ids already lives: earlier in this batch, or in the file."""
        found: list[tuple[str, int] | None] = []
        for row in job.rows:
            event_id = row[1]
            hit = plan.ids.get(event_id)
            if hit is None and in_file:
                stored = conn.execute(_FIND_ID, (event_id,)).fetchone()
                if stored is not None:
                    hit = (stored[0], stored[1])
            found.append(hit)
        return found

    def _dedup(self, job: _Append, found: list[tuple[str, int] | None]) -> bool:
        """Settle a retried append from its stored positions; True when the job is decided."""
        if all(hit is None for hit in found):
            return False
        if all(hit is not None and hit[0] == job.stream for hit in found):
            job.positions = [hit[1] for hit in found if hit is not None]
            return True
        first = next(row[1] for row, hit in zip(job.rows, found, strict=True) if hit is not None)
        job.error = DuplicateEventId(first)
        return True

    def _plan_append(
        self, conn: sqlite3.Connection, job: _Append, plan: _Plan, rows: list[_Row], actual: int
    ) -> None:
        """The general path, in the memory store's order: dedup first, then the version."""
        if self._dedup(job, self._stored_ids(conn, job, plan, in_file=False)):
            return
        if job.expected == ANY or job.expected != actual:
            # A retry of a stored append always lands here: its events moved the stream past
            # the version it expected. So only these appends pay for an id lookup; an id stolen
            # from another stream by a passing append is caught by the UNIQUE index instead.
            if self._dedup(job, self._stored_ids(conn, job, plan, in_file=True)):
                return
            if job.expected != ANY:
                job.error = ConcurrencyConflict(job.stream, job.expected, actual)
                return
        rows.extend(self._claim(job, actual, plan))

    def _careful(self, conn: sqlite3.Connection, job: _Job, plan: _Plan) -> None:
        """One job of a replayed batch, inside its own SAVEPOINT so its failure stays its own."""
        actual = 0
        if isinstance(job, _Append):
            if self._dedup(job, self._stored_ids(conn, job, plan, in_file=True)):
                return
            actual = self._current_version(conn, job.stream, plan)
            if job.expected != ANY and job.expected != actual:
                job.error = ConcurrencyConflict(job.stream, job.expected, actual)
                return
        saved = (plan.next_position, plan.appends, plan.events)
        conn.execute("SAVEPOINT job")
        try:
            if isinstance(job, _Append):
                conn.executemany(_INSERT_EVENT, self._claim(job, actual, plan))
            elif isinstance(job, _SaveSnapshot):
                self._save_snapshot(conn, job)
        except _ROW_ERRORS as exc:
            conn.execute("ROLLBACK TO job")
            conn.execute("RELEASE job")
            plan.next_position, plan.appends, plan.events = saved
            if isinstance(job, _Append) and job.wrote:
                # Undo what _claim recorded for this job alone.
                plan.versions[job.stream] = actual
                for row in job.rows:
                    plan.ids.pop(row[1], None)
            self._reset(job)
            job.error = self._row_error(job, exc)
            return
        conn.execute("RELEASE job")

    def _row_error(self, job: _Job, exc: Exception) -> EventStoreError:
        what = f"append to {job.stream!r}" if isinstance(job, _Append) else "snapshot"
        if isinstance(exc, sqlite3.IntegrityError):
            error: EventStoreError = StoreIOError(
                f"event store {self.path}: {what} refused by a constraint: {exc}"
            )
        else:
            error = InvalidAppend(f"{what} holds a value SQLite cannot store: {exc}")
        error.__cause__ = exc
        return error

    @staticmethod
    def _claim(job: _Append, actual: int, plan: _Plan) -> list[_Row]:
        """Give the job its versions and positions inside the plan, filling in its rows."""
        start = plan.next_position
        for offset, row in enumerate(job.rows):
            row[0] = start + offset
            row[3] = actual + 1 + offset
            plan.ids[row[1]] = (job.stream, row[0])
        count = len(job.rows)
        plan.next_position = start + count
        plan.appends += 1
        plan.events += count
        plan.versions[job.stream] = actual + count
        job.positions = list(range(start, start + count))
        job.wrote = True
        return job.rows

    def _compact(self, conn: sqlite3.Connection, job: _Compact) -> _BatchOutcome:
        try:
            conn.execute("BEGIN IMMEDIATE")
            cutoff = _clamp(job.older_than_ns)
            removed = conn.execute(_COMPACT, (HEARTBEAT_TYPE, cutoff, HEARTBEAT_TYPE)).rowcount
            conn.execute("COMMIT")
        except sqlite3.Error as exc:
            return self._fail_batch(conn, [job], exc, _BatchOutcome())
        # The latest event of a stream is never deleted, so cached versions stay right.
        job.removed = removed
        return _BatchOutcome(committed=True)

    # ---------------------------------------------------------------- reader thread

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closing:
            raise StoreClosed()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._read_executor, fn, *args)
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc

    async def _read_for_subscriber(self, from_position: int, limit: int) -> list[Envelope]:
        # An empty page makes follow() wait on the signal, which close() fires: so a subscriber
        # that races close() ends quietly instead of raising StoreClosed.
        try:
            return await self.read_all(from_position, limit)
        except StoreClosed:
            return []

    def _reader_conn(self) -> sqlite3.Connection:
        if self._rconn is None:
            raise StoreClosed()
        return self._rconn

    def _open_reader(self) -> None:
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=5.0)
            conn.execute("PRAGMA query_only = ON")
            conn.execute("PRAGMA cache_size = -65536")
        except sqlite3.Error as exc:
            raise self._translate(exc) from exc
        self._rconn = conn

    def _close_reader(self) -> None:
        conn, self._rconn = self._rconn, None
        if conn is not None:
            conn.close()

    def _read_all_sync(self, from_position: int, limit: int) -> list[Envelope]:
        rows = self._reader_conn().execute(_READ_ALL, (from_position, limit)).fetchall()
        return [_envelope(row) for row in rows]

    def _read_for_rebuild_sync(self, from_position: int, limit: int) -> list[Envelope]:
        conn = self._reader_conn()
        if from_position <= 1 or self._latest_heartbeats is None:
            # Computed once per rebuild; heartbeats committed later are newer than `as_of`.
            as_of = self._head_sync()
            latest = [row[0] for row in conn.execute(_LATEST_HEARTBEATS, (HEARTBEAT_TYPE,))]
            self._latest_heartbeats = (as_of, json.dumps(latest))
        as_of, latest_json = self._latest_heartbeats
        rows = conn.execute(
            _READ_FOR_REBUILD, (from_position, limit, as_of, HEARTBEAT_TYPE, latest_json)
        ).fetchall()
        return [_envelope(row) for row in rows]

    def _read_stream_sync(self, stream: str, from_version: int) -> list[Envelope]:
        rows = self._reader_conn().execute(_READ_STREAM, (stream, from_version)).fetchall()
        return [_envelope(row) for row in rows]

    def _stream_version_sync(self, stream: str) -> int:
        found = self._reader_conn().execute(_STREAM_VERSION, (stream,)).fetchone()[0]
        return int(found or 0)

    def _head_sync(self) -> int:
        found = self._reader_conn().execute("SELECT MAX(position) FROM events").fetchone()[0]
        return int(found or 0)

    def _load_snapshot_sync(self, stream: str) -> Snapshot | None:
        row = (
            self._reader_conn()
            .execute("SELECT version, schema, state FROM snapshots WHERE stream = ?", (stream,))
            .fetchone()
        )
        if row is None:
            return None
        return Snapshot(stream=stream, version=row[0], schema=row[1], state=_as_bytes(row[2]))

    # ---------------------------------------------------------------- errors

    def _translate(self, exc: sqlite3.Error) -> EventStoreError:
        if _is_disk_full(exc):
            return StoreFull(str(self.path))
        return StoreIOError(f"event store {self.path}: {type(exc).__name__}: {exc}")
