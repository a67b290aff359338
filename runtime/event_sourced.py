"""EventSourcedActor: an actor whose state is the fold of its own stream in the event store."""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Generic, TypeVar, final

import msgspec

from events import ConcurrencyConflict, DomainEvent, EventStore, Snapshot, Undecodable

from .actor import Actor, ActorContext, MsgT
from .errors import RecoveryFailed

StateT = TypeVar("StateT")


class EventSourcedActor(Actor[MsgT], Generic[MsgT, StateT]):
    """Override `stream`, `initial_state`, `evolve` and `handle`; optionally `on_recovered`,
    `on_stop`, `snapshot_type`, `snapshot_version` and `snapshot_every`.

    `on_start` is final: it recovers `state` and `version` from the store (latest snapshot,
    then the events after it) and then calls `on_recovered`. Handlers decide, then call
    `persist`, which appends with the expected version and folds the new events in. On a
    ConcurrencyConflict `persist` reloads state from the store and re-raises: decide again.

    Snapshots are a cache: deleting them, or changing `snapshot_version`, only makes recovery
    replay more events. Set `snapshot_type` to the state's msgspec Struct type to enable them.
    """

    snapshot_type: type[StateT] | None = None
    snapshot_version: ClassVar[int] = 1  # bump when the state's encoding changes
    snapshot_every: ClassVar[int] = 500

    _state: StateT
    _version: int = 0

    @property
    @abstractmethod
    def stream(self) -> str:
        """The stream this actor owns, e.g. `node/<node_id>` (see events.stream_name)."""

    @abstractmethod
    def initial_state(self) -> StateT:
        """The state of an empty stream."""

    @abstractmethod
    def evolve(self, state: StateT, payload: DomainEvent) -> StateT:
        """Fold one event into the state. Pure: no I/O, no clock, no randomness."""

    async def on_recovered(self, ctx: ActorContext[MsgT]) -> None:
        """Runs after recovery, before the first message; the default does nothing."""

    @property
    @final
    def state(self) -> StateT:
        return self._state

    @property
    @final
    def version(self) -> int:
        """The stream version `state` reflects (0 for an empty stream)."""
        return self._version

    @final
    async def on_start(self, ctx: ActorContext[MsgT]) -> None:
        await self._recover(ctx.env.store)
        await self.on_recovered(ctx)

    @final
    async def persist(
        self,
        ctx: ActorContext[MsgT],
        payloads: Sequence[DomainEvent],
        *,
        correlation_id: str = "",
        causation_id: str = "",
    ) -> list[int]:
        """Append `payloads` to `stream` at the current version and fold them into `state`.

        Returns the global positions. Every event of one call shares one correlation id (the
        first event's id unless given).
        """
        if not payloads:
            return []
        env = ctx.env
        first = env.new_event(payloads[0], correlation_id=correlation_id, causation_id=causation_id)
        events = [first] + [
            env.new_event(p, correlation_id=first.correlation_id, causation_id=causation_id)
            for p in payloads[1:]
        ]
        try:
            positions = await env.store.append(self.stream, events, self._version)
        except ConcurrencyConflict:
            # Another writer got there first: catch up so the caller re-decides on fresh state.
            await self._recover(env.store)
            raise
        state = self._state
        for payload in payloads:
            state = self.evolve(state, payload)
        before = self._version
        self._state = state
        self._version = before + len(events)
        if self.snapshot_type is not None and (
            self._version // self.snapshot_every > before // self.snapshot_every
        ):
            await self._save_snapshot(ctx)
        return positions

    async def _recover(self, store: EventStore) -> None:
        state, version = await self._load_snapshot(store)
        for envelope in await store.read_stream(self.stream, version + 1):
            payload = envelope.payload
            if isinstance(payload, Undecodable):
                raise RecoveryFailed(self.stream, envelope.version, payload.error)
            state = self.evolve(state, payload)
            version = envelope.version
        self._state = state
        self._version = version

    async def _load_snapshot(self, store: EventStore) -> tuple[StateT, int]:
        if self.snapshot_type is None:
            return self.initial_state(), 0
        snapshot = await store.load_snapshot(self.stream)
        if snapshot is None or snapshot.schema != self._schema():
            return self.initial_state(), 0
        try:
            state = msgspec.msgpack.decode(snapshot.state, type=self.snapshot_type)
        except msgspec.DecodeError:
            return self.initial_state(), 0  # a cache we cannot read is a cache miss
        return state, snapshot.version

    async def _save_snapshot(self, ctx: ActorContext[Any]) -> None:
        snapshot = Snapshot(
            stream=self.stream,
            version=self._version,
            schema=self._schema(),
            state=msgspec.msgpack.encode(self._state),
        )
        try:
            await ctx.env.store.save_snapshot(snapshot)
        except Exception:
            # The events are committed; a missing snapshot only makes the next recovery longer.
            ctx.log.exception("snapshot_failed", stream=self.stream, version=self._version)

    def _schema(self) -> str:
        kind = self.snapshot_type
        name = "none" if kind is None else f"{kind.__module__}.{kind.__qualname__}"
        return f"{name}/v{self.snapshot_version}"
