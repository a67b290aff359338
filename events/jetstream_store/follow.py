"""Subscriptions: a subscriber takes this store's own appends from its tail (tail.py) and reads
everything else from the server, in position order, with no gap and no duplicate.

Each subscriber keeps the next position it wants and asks, in turn:

- the tail, which holds what this store appended, as acknowledged: no message to receive and
  decode, which is what a leader's subscribers (the live state, the outbox) mostly want;
- the server (batch direct gets, store.py `_read`) when the position is not in the tail and
  this store knows the log reaches it (a higher position acknowledged, or seen at open):
  another writer's message, one whose acknowledgement never came, one compacted away, a
  subscriber behind the tail. It reads only up to the next position the tail holds;
- the server again, for another writer's appends past everything this store knows (a
  standby following the leader): after a wait of `_POLL_MIN_S`, then less often while
  nothing comes, up to `_POLL_MAX_S` apart; a full page is followed by the next at once.
  Not while this store's own appends await their acknowledgements: they would be read back
  and decoded before their acknowledgements put them in the tail, and the acknowledgements
  show whether another writer came in between (the position is then below what is known).

A page is what one of the two gave at once, at most `page` events: an atomic batch is
acknowledged, and so enters the tail, all at once, and one page holds it (a read from the
server stops at the page's size, as a catch-up must).

An ordered push consumer per subscriber did this before: every message came back over the
connection and was parsed and decoded by each subscriber, which at 2,000-20,000 heartbeats/s
cost the controller more than appending them (docs/performance.md, JetStream store).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Final

from events.envelope import Envelope

from .tail import Tail

_POLL_MIN_S: Final = 0.01
_POLL_MAX_S: Final = 0.1
_LAST_SEQ: Final = (1 << 63) - 1

ServerRead = Callable[[int, int], Awaitable[list[Envelope]]]


class Followers:
    def __init__(
        self,
        tail: Tail,
        read: ServerRead,
        known: Callable[[], int],
        writing: Callable[[], bool],
    ) -> None:
        """`read(start, limit)`: from the server; `known()`: the highest position this store
        has seen acknowledged; `writing()`: whether it has appends awaiting acknowledgement."""
        self._tail = tail
        self._read = read
        self._known = known
        self._writing = writing
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self._tail.wake()

    def _closed_meanwhile(self) -> bool:
        return self.closed

    async def envelopes(self, from_position: int) -> AsyncGenerator[Envelope, None]:
        async with contextlib.aclosing(self.pages(from_position)) as pages:
            async for page in pages:
                for envelope in page:
                    yield envelope

    async def pages(
        self, from_position: int, page: int = 1000
    ) -> AsyncGenerator[list[Envelope], None]:
        """Ends quietly when the store closes."""
        position = min(max(1, from_position), _LAST_SEQ)
        tail = self._tail
        poll = _POLL_MIN_S
        ask_server = True  # at first, after a full page from the server, after a wait
        while not self.closed:
            batch = tail.page(position, page)
            from_tail = bool(batch)
            if not batch:
                known = self._known()
                if position <= known:
                    # Not this store's, or not remembered: read up to the next it holds.
                    batch = await self._read(position, tail.gap(position, known, page))
                elif ask_server and not self._writing():
                    batch = await self._read(position, page)
                if self._closed_meanwhile():
                    return
            if batch:
                yield batch
                position = batch[-1].position + 1
                poll = _POLL_MIN_S
                ask_server = not from_tail and len(batch) == page  # the server may have more
                continue
            if ask_server:
                poll = min(2 * poll, _POLL_MAX_S)  # the server had nothing: ask less often
            known = self._known()
            await tail.wait(poll)
            # Woken by an append of this store's own: the tail has it, or a position below
            # it is another writer's (position <= known then). Otherwise the time was up: ask
            # the server, unless appends of this store's own are on their way, which would be
            # read back and decoded before their acknowledgements put them in the tail; the
            # next of those acknowledgements tells whether another writer came in between.
            ask_server = self._known() == known
