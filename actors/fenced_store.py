"""A leader's event store: every write of a term asks the lease first.

The log itself refuses a writer that did not see the last append to the stream it extends (each
store's expected version, checked by SQLite in its transaction and by JetStream on the server).
That fences a deposed leader out of every stream its successor has written since; this fences
it out of the others too. Before each write the store asks the leadership whether this
controller still holds its lease by its own clock (actors/leadership.py, holds_lease: the
expiry is counted from when the last renewal was *sent*, so it passes before the key can
expire on the server). A leader paused past its lease (SIGSTOP, a frozen VM) or cut off from
NATS therefore writes nothing once it could have been replaced, tells the leadership to step
down, and says why.

What remains is the instant between the check and the write reaching the log: a pause that
long (longer than the lease's time to live, landing exactly there) is caught only by the
per-stream check above. docs/operations.md, Terms and fencing.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from typing import Protocol

from events.envelope import Envelope, NewEvent
from events.errors import EventStoreError
from events.store import EventStore, RebuildReader, Snapshot
from runtime.env import Bus, BusError, Msg, MsgHandler, ReconnectCallback, Subscription

from .errors import ControllerError


class LeaseGuard(Protocol):
    def holds_lease(self) -> bool: ...

    def deposed(self, reason: str) -> None: ...


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

    async def append(
        self, stream: str, events: Sequence[NewEvent], expected_version: int
    ) -> list[int]:
        self._check()
        return await self.inner.append(stream, events, expected_version)

    async def append_many(
        self, appends: Sequence[tuple[str, Sequence[NewEvent], int]]
    ) -> list[list[int] | EventStoreError]:
        self._check()
        return await self.inner.append_many(appends)

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
