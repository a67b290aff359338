"""Wakes subscribers after each commit, without lost wake-ups."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable

from .envelope import Envelope


class CommitSignal:
    """A subscriber takes `current()` *before* it reads, then waits on it if it found nothing.

    `fire()` sets the current event and installs a fresh one, so a commit between the read and
    the wait is never missed. A store that knows its last committed position passes it to
    `fire` (and starts the signal at 0): a subscriber already past it waits without reading,
    which spares every subscriber an empty read after each commit.
    """

    def __init__(self, head: int | None = None) -> None:
        self._event = asyncio.Event()
        self.closed = False
        self.head = head  # the last committed position, None when the store does not say

    def current(self) -> asyncio.Event:
        return self._event

    def fire(self, head: int | None = None) -> None:
        if head is not None:
            self.head = head
        event, self._event = self._event, asyncio.Event()
        event.set()

    def close(self) -> None:
        self.closed = True
        self.fire()


async def follow(
    read_all: Callable[[int, int], Awaitable[list[Envelope]]],
    signal: CommitSignal,
    from_position: int,
    page: int = 1000,
) -> AsyncGenerator[Envelope, None]:
    """Catch up page by page, then wait for commits. Ends quietly when the store closes."""
    async with contextlib.aclosing(follow_batches(read_all, signal, from_position, page)) as pages:
        async for batch in pages:
            for envelope in batch:
                yield envelope


async def follow_batches(
    read_all: Callable[[int, int], Awaitable[list[Envelope]]],
    signal: CommitSignal,
    from_position: int,
    page: int = 1000,
) -> AsyncGenerator[list[Envelope], None]:
    """`follow`, a page at a time: everything committed since the last page (at most `page`
    events), never empty. A subscriber that folds a page can then tell its waiters once per
    commit instead of once per event."""
    next_position = max(1, from_position)
    while True:
        waiter = signal.current()
        if signal.closed:
            return
        if signal.head is None or signal.head >= next_position:
            batch = await read_all(next_position, page)
            if batch:
                yield batch
                next_position = batch[-1].position + 1
                continue
        await waiter.wait()
