"""The latest commits kept in memory, so subscribers that follow the head (the live state, the
outbox) take them from here instead of each reading and decoding them back from the file.

Touched on the event loop's thread only.
"""

from __future__ import annotations

from typing import Final, cast

from events.envelope import Envelope

from .jobs import Append, Job
from .rows import Row, to_envelope

# Holds between this many and twice as many; a subscriber further behind reads SQLite.
_TAIL_EVENTS: Final = 4096


class Tail:
    """The last commits, contiguous from position `_start`: each a row as written until a
    reader decodes it in place, so each is decoded once, by the first reader."""

    def __init__(self) -> None:
        self._items: list[Envelope | Row] = []
        self._start = 0

    def remember(self, batch: list[Job]) -> None:
        """Keep the rows just committed."""
        tail = self._items
        for job in batch:
            if type(job) is not Append or not job.wrote or job.error is not None:
                continue
            for row in job.rows:
                if row[0] != self._start + len(tail):
                    # A gap (only another writer on the file makes one): start again from here.
                    tail.clear()
                    self._start = row[0]
                tail.append(row)
        if len(tail) > 2 * _TAIL_EVENTS:
            drop = len(tail) - _TAIL_EVENTS
            del tail[:drop]
            self._start += drop

    def page(self, from_position: int, limit: int) -> list[Envelope] | None:
        """The page from the tail, or None when the tail does not hold `from_position`."""
        tail = self._items
        offset = from_position - self._start
        if offset < 0 or offset >= len(tail):
            return None
        end = min(offset + limit, len(tail))
        for i in range(offset, end):
            item = tail[i]
            if type(item) is list:
                tail[i] = to_envelope(item)
        return cast(list[Envelope], tail[offset:end])  # every item decoded just above

    def clear(self) -> None:
        self._items.clear()
