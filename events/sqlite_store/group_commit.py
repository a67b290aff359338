"""Group commit, the event loop's side: queued jobs leave for the writer thread in batches, one
batch in flight at a time; whatever queues meanwhile forms the next batch. So the fsync of
`synchronous=FULL` is paid once per batch instead of once per append.

Everything here runs on the event loop's thread but `_wake_loop`, which only hands back.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial

from events._commit_signal import CommitSignal

from .jobs import BatchOutcome, Compact, Job
from .tail import Tail
from .writer import Writer


@dataclass
class StoreStats:
    """Counters for tests and benchmarks; updated on the event loop after each write."""

    transactions: int = 0  # committed write transactions
    failed_transactions: int = 0  # rolled back because of a storage error
    appends: int = 0  # appends that wrote events
    events: int = 0  # events written
    largest_batch: int = 0  # most jobs committed in one transaction
    careful_replays: int = 0  # batches replayed with one SAVEPOINT per job


class GroupCommit:
    """Queues jobs and hands up to `max_batch` of them at a time to the writer thread."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        writer: Writer,
        executor: ThreadPoolExecutor,
        max_batch: int,
        *,
        tail: Tail,
        signal: CommitSignal,
        stats: StoreStats,
    ) -> None:
        self.max_batch = max_batch
        self._loop = loop
        self._writer = writer
        self._executor = executor
        self._tail = tail
        self._signal = signal
        self._stats = stats
        self._pending: deque[Job] = deque()
        self._busy = False  # a batch is on the writer thread
        self._dispatch_scheduled = False
        self._idle_waiters: list[asyncio.Future[None]] = []

    def enqueue(self, job: Job) -> None:
        self._pending.append(job)
        self._schedule_dispatch()

    def enqueue_all(self, jobs: Iterable[Job]) -> None:
        self._pending.extend(jobs)
        self._schedule_dispatch()

    async def drain(self) -> None:
        """Return once every queued job is written and no batch is in flight."""
        while self._busy or self._pending:
            waiter: asyncio.Future[None] = self._loop.create_future()
            self._idle_waiters.append(waiter)
            self._schedule_dispatch()
            await waiter

    def _schedule_dispatch(self) -> None:
        # call_soon, not an immediate dispatch: every append made in this turn of the loop
        # (say, 1,000 actors woken by the last commit) joins the batch before it leaves.
        if not self._busy and not self._dispatch_scheduled:
            self._dispatch_scheduled = True
            self._loop.call_soon(self._dispatch)

    def _take_batch(self) -> list[Job]:
        """Queued appends and snapshot saves share a transaction; a compaction runs alone."""
        batch: list[Job] = []
        pending = self._pending
        while pending and len(batch) < self.max_batch:
            job = pending[0]
            if job.future.cancelled():
                # Its caller gave up before the write started: nobody is waiting for it.
                pending.popleft()
                continue
            if isinstance(job, Compact):
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
        done = self._executor.submit(self._writer.write_batch, batch)
        done.add_done_callback(partial(self._wake_loop, batch))

    def _wake_loop(self, batch: list[Job], done: Future[BatchOutcome]) -> None:
        """Runs on the writer thread when a batch is finished."""
        self._loop.call_soon_threadsafe(self._batch_done, batch, done)

    def _batch_done(self, batch: list[Job], done: Future[BatchOutcome]) -> None:
        self._busy = False
        try:
            outcome = done.result()
        except Exception as exc:  # a bug, not a storage error: fail the batch and go on
            for job in batch:
                job.error = exc
            outcome = BatchOutcome()
        if outcome.events:
            self._tail.remember(batch)
        elif outcome.committed and type(batch[0]) is Compact:
            # Deleted rows may be in the tail; the file is the truth for what is still there.
            self._tail.clear()
        for job in batch:
            job.settle()
        self._record(outcome, len(batch))
        if outcome.events:
            self._signal.fire()
        # Appends that queued while this batch was being written leave together, now.
        self._dispatch()

    def _record(self, outcome: BatchOutcome, jobs: int) -> None:
        stats = self._stats
        if outcome.committed:
            stats.transactions += 1
            stats.largest_batch = max(stats.largest_batch, jobs)
        else:
            stats.failed_transactions += 1
        stats.appends += outcome.appends
        stats.events += outcome.events
        if outcome.careful:
            stats.careful_replays += 1
