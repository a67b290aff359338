"""The EventStore protocol that actors, projectors and the simulator program against."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from .envelope import Envelope, NewEvent
from .errors import EventStoreError

NO_STREAM = 0
"""Expected version for a stream that must not exist yet."""

ANY = -1
"""Expected version that skips the check: admin and migration tools only."""


class Snapshot(msgspec.Struct, frozen=True, kw_only=True):
    """A cache of a fold's state at a version. Deleting every snapshot changes no behaviour."""

    stream: str
    version: int
    schema: str  # which state type and version is encoded in `state`
    state: bytes


class EventStore(Protocol):
    async def append(
        self, stream: str, events: Sequence[NewEvent], expected_version: int
    ) -> list[int]:
        """Append atomically; return the global positions.

        Raises ConcurrencyConflict when the stream is not at `expected_version`. Re-appending
        events whose ids are already stored returns their positions and writes nothing.
        """
        ...

    async def append_many(
        self, appends: Sequence[tuple[str, Sequence[NewEvent], int]]
    ) -> list[list[int] | EventStoreError]:
        """Several independent appends, each `(stream, events, expected_version)`, submitted
        together: each is atomic and checked exactly as `append` checks it, and none waits for
        another's outcome. Returns, in order, each one's positions or the error `append` would
        have raised for it. Raises only what fails them all (StoreClosed).

        One trip to the writer for many streams: the controller records a turn of the loop's
        heartbeats this way instead of paying an append (and a wake-up) per node.
        """
        ...

    async def read_stream(self, stream: str, from_version: int = 1) -> list[Envelope]: ...

    async def stream_version(self, stream: str) -> int:
        """The stream's last version; 0 when it has no events."""
        ...

    async def read_all(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        """Events with position >= from_position, in commit order, at most `limit`."""
        ...

    def subscribe(self, from_position: int = 1) -> AsyncGenerator[Envelope, None]:
        """Catch up from `from_position`, then follow live: no gap, no duplicate."""
        ...

    def subscribe_batches(self, from_position: int = 1) -> AsyncGenerator[list[Envelope], None]:
        """`subscribe`, a list at a time: what was committed since the last list (a page of at
        most 1,000 while catching up), never empty. The same events in the same order."""
        ...

    async def head(self) -> int:
        """The highest committed position (0 for an empty log)."""
        ...

    async def compact_heartbeats(self, older_than_ns: int) -> int:
        """Delete heartbeats recorded before `older_than_ns`, keeping each node's latest.

        Returns the number removed. No projection changes: folds keep only the latest heartbeat.
        """
        ...

    async def save_snapshot(self, snapshot: Snapshot) -> None: ...

    async def load_snapshot(self, stream: str) -> Snapshot | None: ...

    async def close(self) -> None: ...


@runtime_checkable
class RebuildReader(Protocol):
    """A store that can hand a rebuild only the events that can change a fold.

    Every projection keeps just a node's latest heartbeat, so a heartbeat superseded by a later
    one in the same stream changes nothing a fold keeps (the compaction property test in
    tests/projections proves folding the compacted log gives the same state). Skipping them
    turns a rebuild that is mostly heartbeats into one proportional to everything else.
    """

    async def read_for_rebuild(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        """Like read_all, minus heartbeats superseded by a later heartbeat in their stream."""
        ...
