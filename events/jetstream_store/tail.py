"""This store's own latest appends, kept in memory as they are acknowledged, so its subscribers
(the live state, the outbox) take them from here instead of each receiving every message back
from the server and decoding it: what the SQLite store's tail (events/sqlite_store/tail.py)
does for its file.

An event is kept under the position its acknowledgement gave it, with the version its message
carries, and becomes an envelope when a subscriber first asks for it (sharing the payload, as
the memory store does). A position this store did not write (another writer's, or an append
whose acknowledgement never came) is not here: a subscriber reads it from the server. Touched
on the event loop's thread only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Final

from events.envelope import Envelope, NewEvent

# Holds between this many and twice as many; a subscriber further behind reads the server.
_TAIL_EVENTS: Final = 4096


class Tail:
    def __init__(self) -> None:
        # position -> its envelope, or (stream, version, event) until a subscriber asks;
        # in the order acknowledgements came, which is about the order of positions
        self._items: dict[int, Envelope | tuple[str, int, NewEvent]] = {}
        self._waiters: list[asyncio.Future[None]] = []

    def remember(
        self, stream: str, events: Sequence[NewEvent], positions: Sequence[int], version: int
    ) -> None:
        """An append acknowledged at `positions`; `version` is its first event's."""
        items = self._items
        for i, (event, position) in enumerate(zip(events, positions, strict=True)):
            items[position] = (stream, version + i, event)
        if len(items) > 2 * _TAIL_EVENTS:
            oldest = list(items)[: len(items) - _TAIL_EVENTS]
            for position in oldest:
                del items[position]
        self.wake()

    def forget(self, positions: Sequence[int]) -> None:
        """Deleted from the log (compaction)."""
        for position in positions:
            self._items.pop(position, None)

    def gap(self, start: int, known: int, limit: int) -> int:
        """How many positions from `start` (which this tail does not hold) up to the next it
        does hold, at most `limit` and not past `known`: what to read from the server."""
        items = self._items
        end = min(start + limit, known + 1)
        position = start + 1
        while position < end and position not in items:
            position += 1
        return max(1, position - start)

    def page(self, start: int, limit: int) -> list[Envelope]:
        """The events at `start`, `start + 1`, ... as far as this tail holds them without a
        gap, at most `limit`; empty when it does not hold `start`."""
        items = self._items
        found: list[Envelope] = []
        position = start
        while len(found) < limit:
            item = items.get(position)
            if item is None:
                break
            if type(item) is tuple:
                stream, version, event = item
                item = items[position] = Envelope(
                    event_id=event.event_id,
                    stream=stream,
                    version=version,
                    position=position,
                    type=event.type,
                    recorded_at=event.recorded_at,
                    correlation_id=event.correlation_id,
                    causation_id=event.causation_id,
                    payload=event.payload,
                )
            assert type(item) is Envelope
            found.append(item)
            position += 1
        return found

    async def wait(self, timeout: float) -> None:
        """Until the next append is remembered, `wake()` is called, or `timeout` passes."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            async with asyncio.timeout(timeout):
                await waiter
        except TimeoutError:
            pass
        finally:
            if not waiter.done():
                waiter.cancel()
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def wake(self) -> None:
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)
