"""The in-memory event store: the simulator's store, and the reference for the contract tests."""

from __future__ import annotations

import bisect
from collections.abc import AsyncGenerator, Sequence

from ._append_rules import check_batch
from ._commit_signal import CommitSignal, follow, follow_batches
from .catalog import HEARTBEAT_TYPE
from .envelope import Envelope, NewEvent
from .errors import ConcurrencyConflict, DuplicateEventId, EventStoreError, StoreClosed
from .store import ANY, Snapshot


class MemoryEventStore:
    """Everything lives in lists and dicts; appends commit at once, in call order."""

    def __init__(self) -> None:
        self._log: list[Envelope] = []
        self._positions: list[int] = []
        self._streams: dict[str, list[Envelope]] = {}
        self._by_id: dict[str, Envelope] = {}
        self._snapshots: dict[str, Snapshot] = {}
        self._next_position = 1
        self._signal = CommitSignal(head=0)
        self._closed = False

    async def append(
        self, stream: str, events: Sequence[NewEvent], expected_version: int
    ) -> list[int]:
        return self.append_now(stream, events, expected_version)

    async def append_many(
        self, appends: Sequence[tuple[str, Sequence[NewEvent], int]]
    ) -> list[list[int] | EventStoreError]:
        self._check_open()
        results: list[list[int] | EventStoreError] = []
        for stream, events, expected_version in appends:
            try:
                results.append(self.append_now(stream, events, expected_version))
            except EventStoreError as exc:
                results.append(exc)
        return results

    def append_now(
        self, stream: str, events: Sequence[NewEvent], expected_version: int
    ) -> list[int]:
        """The synchronous core of append, for callers that cannot await (sim internals)."""
        self._check_open()
        check_batch(stream, events, expected_version)
        if not events:
            return []
        stored = self._already_stored(stream, events)
        if stored is not None:
            return stored
        history = self._streams.get(stream)
        actual = history[-1].version if history else 0
        if expected_version != ANY and expected_version != actual:
            raise ConcurrencyConflict(stream, expected_version, actual)
        if history is None:
            history = self._streams[stream] = []
        positions = []
        for offset, event in enumerate(events, start=1):
            envelope = Envelope(
                event_id=event.event_id,
                stream=stream,
                version=actual + offset,
                position=self._next_position,
                type=event.type,
                recorded_at=event.recorded_at,
                correlation_id=event.correlation_id,
                causation_id=event.causation_id,
                payload=event.payload,
            )
            self._next_position += 1
            self._log.append(envelope)
            self._positions.append(envelope.position)
            history.append(envelope)
            self._by_id[envelope.event_id] = envelope
            positions.append(envelope.position)
        self._signal.fire(self._next_position - 1)
        return positions

    def _already_stored(self, stream: str, events: Sequence[NewEvent]) -> list[int] | None:
        by_id = self._by_id
        if len(events) == 1 and events[0].event_id not in by_id:
            return None  # the common case: one new event
        found = [by_id.get(e.event_id) for e in events]
        if all(f is None for f in found):
            return None
        if all(f is not None and f.stream == stream for f in found):
            return [f.position for f in found if f is not None]
        first = next(e.event_id for e, f in zip(events, found, strict=True) if f is not None)
        raise DuplicateEventId(first)

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed()

    async def read_stream(self, stream: str, from_version: int = 1) -> list[Envelope]:
        self._check_open()
        history = self._streams.get(stream, [])
        return [e for e in history if e.version >= from_version]

    async def stream_version(self, stream: str) -> int:
        return self.version_now(stream)

    def version_now(self, stream: str) -> int:
        """The synchronous core of stream_version (the simulator's term fence checks it in
        the same step as the append it guards)."""
        self._check_open()
        history = self._streams.get(stream)
        return history[-1].version if history else 0

    async def read_all(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        self._check_open()
        if limit < 1:
            return []
        start = bisect.bisect_left(self._positions, from_position)
        return self._log[start : start + limit]

    async def read_for_rebuild(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        self._check_open()
        if limit < 1:
            return []
        latest: dict[str, int] = {}
        for envelope in self._log:
            if envelope.type == HEARTBEAT_TYPE:
                latest[envelope.stream] = envelope.position
        keep = set(latest.values())
        start = bisect.bisect_left(self._positions, from_position)
        found: list[Envelope] = []
        for envelope in self._log[start:]:
            if envelope.type != HEARTBEAT_TYPE or envelope.position in keep:
                found.append(envelope)
                if len(found) == limit:
                    break
        return found

    def read_all_now(self) -> list[Envelope]:
        """The whole log, synchronously (simulator invariants)."""
        return list(self._log)

    def subscribe(self, from_position: int = 1) -> AsyncGenerator[Envelope, None]:
        return follow(self.read_all, self._signal, from_position)

    def subscribe_batches(self, from_position: int = 1) -> AsyncGenerator[list[Envelope], None]:
        return follow_batches(self.read_all, self._signal, from_position)

    async def head(self) -> int:
        self._check_open()
        return self._positions[-1] if self._positions else 0

    async def compact_heartbeats(self, older_than_ns: int) -> int:
        self._check_open()
        latest: dict[str, int] = {}
        for envelope in self._log:
            if envelope.type == HEARTBEAT_TYPE:
                latest[envelope.stream] = envelope.position
        keep_positions = set(latest.values())

        def doomed(e: Envelope) -> bool:
            return (
                e.type == HEARTBEAT_TYPE
                and e.recorded_at < older_than_ns
                and e.position not in keep_positions
            )

        removed = [e for e in self._log if doomed(e)]
        if not removed:
            return 0
        self._log = [e for e in self._log if not doomed(e)]
        self._positions = [e.position for e in self._log]
        for stream in sorted({e.stream for e in removed}):
            self._streams[stream] = [e for e in self._streams[stream] if not doomed(e)]
        for e in removed:
            del self._by_id[e.event_id]
        return len(removed)

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        self._check_open()
        self._snapshots[snapshot.stream] = snapshot

    async def load_snapshot(self, stream: str) -> Snapshot | None:
        self._check_open()
        return self._snapshots.get(stream)

    async def close(self) -> None:
        self._closed = True
        self._signal.close()
