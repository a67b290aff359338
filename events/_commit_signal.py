"""Wakes subscribers after each commit, without lost wake-ups."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Awaitable, Callable

from .envelope import Envelope


class CommitSignal:
    """A subscriber takes `current()` *before* it reads, then waits on it if it found nothing.

    `fire()` sets the current event and installs a fresh one, so a commit between the read and
    the wait is never missed.
    """

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self.closed = False

    def current(self) -> asyncio.Event:
        return self._event

    def fire(self) -> None:
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
    next_position = max(1, from_position)
    while True:
        waiter = signal.current()
        if signal.closed:
            return
        batch = await read_all(next_position, page)
        if batch:
            for envelope in batch:
                yield envelope
            next_position = batch[-1].position + 1
            continue
        await waiter.wait()
