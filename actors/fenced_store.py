"""A leader's event store: a term begins with its record in the log, and every write of the
term asks the lease first.

Two fences, one in the process and one in the log:

- Before each write the store asks the leadership whether this controller still holds its
  lease by its own clock (actors/leadership.py, holds_lease: the expiry is counted from when
  the last renewal was *sent*, so it passes before the key can expire on the server). A leader
  paused past its lease (SIGSTOP, a frozen VM) or cut off from NATS therefore writes nothing
  once it could have been replaced, tells the leadership to step down, and says why.
- A term begins by appending its record (`controller.term.v1`) to `leadership/terms`. On
  JetStream every later append of the term is conditional, on the server, on that stream
  still ending at this record (events/jetstream_store/store.py, fence): once a successor has
  recorded its term, an append of the old one is refused whole (TermEnded, here Deposed),
  whatever instant it reaches the log. That covers what the first fence cannot: a leader
  paused between its check and its write. The SQLite log, one file on one machine, has only
  the first fence and each stream's expected version. docs/operations.md, Terms and fencing.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol, runtime_checkable

from events.controller import TERMS_STREAM, LeaderTermBegan
from events.envelope import Envelope, NewEvent
from events.errors import ConcurrencyConflict, EventStoreError, TermEnded
from events.store import EventStore, RebuildReader, Snapshot
from runtime.env import Bus, BusError, Msg, MsgHandler, ReconnectCallback, Subscription

from .errors import ControllerError


class LeaseGuard(Protocol):
    def holds_lease(self) -> bool: ...

    def deposed(self, reason: str) -> None: ...


@runtime_checkable
class TermFencing(Protocol):
    """A store that can make its appends conditional on the term record (JetStream's)."""

    async def fence(self, stream: str) -> int: ...

    def unfence(self) -> None: ...


class Deposed(EventStoreError, ControllerError):
    """This controller may no longer lead: nothing was written. An EventStoreError too, so
    that every caller that already handles a failed append handles this one."""


class FencedStore:
    """The EventStore protocol over `inner`, refusing writes once `guard` no longer holds the
    lease. Reads pass through: a deposed leader may still look."""

    def __init__(self, inner: EventStore, guard: LeaseGuard, *, term: int = 0) -> None:
        self.inner = inner
        self._guard = guard
        self._term = term
        self.refused = 0  # writes refused: a paused leader's, after waking

    def _check(self) -> None:
        if not self._guard.holds_lease():
            self.refused += 1
            reason = (
                f"term {self._term}: the lease may have expired; this controller writes "
                "nothing more"
            )
            self._guard.deposed(reason)
            raise Deposed(reason)

    def _ended(self, exc: TermEnded) -> Deposed:
        self.refused += 1
        reason = f"term {self._term}: a newer term is recorded in the log ({exc})"
        self._guard.deposed(reason)
        return Deposed(reason)

    async def begin_term(self, record: NewEvent) -> int:
        """Append `record` (a LeaderTermBegan of this term) to `leadership/terms`, then fence
        every later write on it where the store can. Refuses (Deposed) when the log already
        holds a newer term. Returns the record's position; asked again, the same record is
        found where it was stored."""
        mine = record.payload
        assert isinstance(mine, LeaderTermBegan) and mine.term == self._term, record
        self._check()
        while True:
            version = await self.inner.stream_version(TERMS_STREAM)
            for envelope in await self.inner.read_stream(TERMS_STREAM, max(1, version)):
                last = envelope.payload
                if isinstance(last, LeaderTermBegan) and last.term > mine.term:
                    raise self._ended(TermEnded(f"{last.controller_id} leads term {last.term}"))
            self._check()
            try:
                [position] = await self.inner.append(TERMS_STREAM, [record], version)
            except ConcurrencyConflict:
                continue  # another controller's record came first: is it newer?
            break
        if isinstance(self.inner, TermFencing):
            await self.inner.fence(TERMS_STREAM)
        return position

    def end_term(self) -> None:
        if isinstance(self.inner, TermFencing):
            self.inner.unfence()

    async def append(
        self, stream: str, events: Sequence[NewEvent], expected_version: int
    ) -> list[int]:
        self._check()
        try:
            return await self.inner.append(stream, events, expected_version)
        except TermEnded as exc:
            raise self._ended(exc) from exc

    async def append_many(
        self, appends: Sequence[tuple[str, Sequence[NewEvent], int]]
    ) -> list[list[int] | EventStoreError]:
        self._check()
        results = await self.inner.append_many(appends)
        ended = next((r for r in results if isinstance(r, TermEnded)), None)
        if ended is None:
            return results
        deposed = self._ended(ended)
        return [deposed if isinstance(r, TermEnded) else r for r in results]

    async def compact_heartbeats(self, older_than_ns: int) -> int:
        self._check()
        return await self.inner.compact_heartbeats(older_than_ns)

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        self._check()
        await self.inner.save_snapshot(snapshot)

    async def read_stream(self, stream: str, from_version: int = 1) -> list[Envelope]:
        return await self.inner.read_stream(stream, from_version)

    async def stream_version(self, stream: str) -> int:
        return await self.inner.stream_version(stream)

    async def read_all(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        return await self.inner.read_all(from_position, limit)

    def subscribe(self, from_position: int = 1) -> AsyncGenerator[Envelope, None]:
        return self.inner.subscribe(from_position)

    def subscribe_batches(self, from_position: int = 1) -> AsyncGenerator[list[Envelope], None]:
        return self.inner.subscribe_batches(from_position)

    async def head(self) -> int:
        return await self.inner.head()

    async def load_snapshot(self, stream: str) -> Snapshot | None:
        return await self.inner.load_snapshot(stream)

    async def close(self) -> None:
        await self.inner.close()


class FencedRebuildStore(FencedStore):
    """A FencedStore over a store that can skip superseded heartbeats in a rebuild."""

    def __init__(self, inner: RebuildReader, guard: LeaseGuard, *, term: int = 0) -> None:
        super().__init__(inner, guard, term=term)  # type: ignore[arg-type]
        self._reader = inner

    async def read_for_rebuild(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        return await self._reader.read_for_rebuild(from_position, limit)


class FencedBus:
    """The Bus protocol over `inner`, refusing every publish once `guard` no longer holds the
    lease: a leader paused past its lease, waking to the heartbeats queued for it, must not
    answer them with leases of its old term (an agent that has not yet heard the new leader
    would take one and serve a replica the new leader has moved: the simulator's
    leader-failover scenario found it), nor publish an old routing table. Raises BusError,
    which every publisher of the controller already handles as a publish that failed."""

    def __init__(self, inner: Bus, guard: LeaseGuard) -> None:
        self._inner = inner
        self._guard = guard

    @property
    def is_connected(self) -> bool:
        return self._inner.is_connected

    @property
    def max_payload(self) -> int:
        return self._inner.max_payload

    def new_inbox(self) -> str:
        return self._inner.new_inbox()

    def add_reconnect_callback(self, callback: ReconnectCallback) -> None:
        self._inner.add_reconnect_callback(callback)

    def remove_reconnect_callback(self, callback: ReconnectCallback) -> None:
        self._inner.remove_reconnect_callback(callback)

    async def publish(
        self, subject: str, data: bytes, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        if not self._guard.holds_lease():
            reason = "the lease may have expired; this controller publishes nothing more"
            self._guard.deposed(reason)
            raise BusError(reason)
        await self._inner.publish(subject, data, reply=reply, headers=headers)

    async def subscribe(
        self, subject: str, *, queue: str = "", handler: MsgHandler | None = None
    ) -> Subscription:
        return await self._inner.subscribe(subject, queue=queue, handler=handler)

    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        return await self._inner.request(subject, data, timeout=timeout, headers=headers)


def fenced(store: EventStore, guard: LeaseGuard, *, term: int = 0) -> FencedStore:
    """`store` behind the lease; keeps the rebuild shortcut when the store has it."""
    if isinstance(store, RebuildReader):
        return FencedRebuildStore(store, guard, term=term)
    return FencedStore(store, guard, term=term)
