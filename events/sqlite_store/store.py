"""SqliteEventStore: the EventStore protocol on one SQLite file, tying the writer thread, its
group commit, the reader thread and the in-memory tail together."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import AsyncGenerator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Final, TypeVar

from events._append_rules import check_batch
from events._commit_signal import CommitSignal, follow, follow_batches
from events.envelope import Envelope, NewEvent
from events.errors import EventStoreError, InvalidAppend, StoreClosed
from events.store import Snapshot

from .failures import translate
from .group_commit import GroupCommit, StoreStats
from .jobs import Append, Compact, Group, SaveSnapshot
from .reader import Reader
from .rows import INT64_MAX, INT64_MIN, check_storable, clamp, new_rows
from .tail import Tail
from .writer import Writer

T = TypeVar("T")

_SYNCHRONOUS_MODES: Final = ("FULL", "NORMAL", "OFF")


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
        self._closing = False  # set by close(): no new work is accepted from then on
        self._close_task: asyncio.Task[None] | None = None
        # Both executors have exactly one thread, so each connection is only ever used by the
        # thread that created it, and blocking sqlite calls never run on the event loop.
        self._write_executor = ThreadPoolExecutor(1, thread_name_prefix="eventstore-writer")
        self._read_executor = ThreadPoolExecutor(1, thread_name_prefix="eventstore-reader")
        self._tail = Tail()
        self._writer = Writer(path, synchronous)
        self._reader = Reader(path)
        self._commits = GroupCommit(
            loop,
            self._writer,
            self._write_executor,
            max_batch,
            tail=self._tail,
            signal=self._signal,
            stats=self.stats,
        )

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
            await loop.run_in_executor(store._write_executor, store._writer.open)
            await loop.run_in_executor(store._read_executor, store._reader.open)
        except BaseException:
            await store._shutdown_connections()
            raise
        return store

    async def append(
        self, stream: str, events: Sequence[NewEvent], expected_version: int
    ) -> list[int]:
        if self._closing:
            raise StoreClosed()
        check_batch(stream, events, expected_version)
        if not events:
            return []
        check_storable(events)
        future: asyncio.Future[list[int]] = self._loop.create_future()
        self._commits.enqueue(Append(stream, expected_version, new_rows(stream, events), future))
        return await future

    async def append_many(
        self, appends: Sequence[tuple[str, Sequence[NewEvent], int]]
    ) -> list[list[int] | EventStoreError]:
        if self._closing:
            raise StoreClosed()
        results: list[list[int] | EventStoreError] = [[] for _ in appends]
        group = Group(self._loop.create_future(), results)
        jobs: list[Append] = []
        for index, (stream, events, expected_version) in enumerate(appends):
            try:
                check_batch(stream, events, expected_version)
                check_storable(events)
            except EventStoreError as exc:
                results[index] = exc
                continue
            if events:
                rows = new_rows(stream, events)
                jobs.append(
                    Append(stream, expected_version, rows, group.future, group=group, index=index)
                )
        if not jobs:
            return results
        group.waiting = len(jobs)
        self._commits.enqueue_all(jobs)
        await group.future
        return results

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        if self._closing:
            raise StoreClosed()
        if type(snapshot.version) is not int or not INT64_MIN <= snapshot.version <= INT64_MAX:
            raise InvalidAppend(f"snapshot version {snapshot.version!r} is not a 64-bit integer")
        future: asyncio.Future[None] = self._loop.create_future()
        self._commits.enqueue(SaveSnapshot(snapshot, future))
        await future

    async def compact_heartbeats(self, older_than_ns: int) -> int:
        if self._closing:
            raise StoreClosed()
        future: asyncio.Future[int] = self._loop.create_future()
        self._commits.enqueue(Compact(older_than_ns, future))
        return await future

    async def read_stream(self, stream: str, from_version: int = 1) -> list[Envelope]:
        return await self._read(self._reader.read_stream, stream, clamp(from_version))

    async def stream_version(self, stream: str) -> int:
        return await self._read(self._reader.stream_version, stream)

    async def read_for_rebuild(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        """See events.store.RebuildReader."""
        if limit <= 0:
            return []
        return await self._read(self._reader.read_for_rebuild, from_position, limit)

    async def read_all(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        if self._closing:
            raise StoreClosed()
        if limit <= 0:
            return []
        cached = self._tail.page(from_position, limit)
        if cached is not None:
            return cached
        return await self._read(self._reader.read_all, clamp(from_position), clamp(limit))

    def subscribe(self, from_position: int = 1) -> AsyncGenerator[Envelope, None]:
        return follow(self._read_for_subscriber, self._signal, from_position)

    def subscribe_batches(self, from_position: int = 1) -> AsyncGenerator[list[Envelope], None]:
        return follow_batches(self._read_for_subscriber, self._signal, from_position)

    async def head(self) -> int:
        return await self._read(self._reader.head)

    async def load_snapshot(self, stream: str) -> Snapshot | None:
        return await self._read(self._reader.load_snapshot, stream)

    async def close(self) -> None:
        """Flush queued appends, stop the writer and close both connections. Idempotent."""
        if self._close_task is None:
            self._close_task = asyncio.get_running_loop().create_task(self._close())
        await asyncio.shield(self._close_task)

    async def run_on_writer(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run `fn(connection)` on the writer thread, between transactions.

        For tests and operators: read back pragmas, or lower `PRAGMA max_page_count` (a
        per-connection setting, so only the writer's own connection can simulate a full disk).
        sqlite3 errors are translated like any other.
        """
        if self._closing:
            raise StoreClosed()

        def call() -> T:
            return fn(self._writer.conn())

        try:
            return await asyncio.get_running_loop().run_in_executor(self._write_executor, call)
        except sqlite3.Error as exc:
            raise translate(self.path, exc) from exc

    async def _close(self) -> None:
        self._closing = True
        await self._commits.drain()
        try:
            await self._shutdown_connections()
        finally:
            self._signal.close()

    async def _shutdown_connections(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            # Queued behind any read or write in flight, so those finish first.
            await loop.run_in_executor(self._write_executor, self._writer.close)
            await loop.run_in_executor(self._read_executor, self._reader.close)
        except sqlite3.Error as exc:
            raise translate(self.path, exc) from exc
        finally:
            # Both threads are idle now; joining them would only block the loop.
            self._write_executor.shutdown(wait=False)
            self._read_executor.shutdown(wait=False)

    async def _read(self, fn: Callable[..., T], *args: Any) -> T:
        if self._closing:
            raise StoreClosed()
        try:
            return await asyncio.get_running_loop().run_in_executor(self._read_executor, fn, *args)
        except sqlite3.Error as exc:
            raise translate(self.path, exc) from exc

    async def _read_for_subscriber(self, from_position: int, limit: int) -> list[Envelope]:
        # An empty page makes follow() wait on the signal, which close() fires: so a subscriber
        # that races close() ends quietly instead of raising StoreClosed.
        try:
            return await self.read_all(from_position, limit)
        except StoreClosed:
            return []
