"""What the store keeps in memory about the log: every stream's last sequence and version, the
event ids it holds, and each heartbeat stream's live heartbeats.

Rebuilt at open from a headers-only read of the whole stream (bodies stay on the server), and
kept current by this store's own appends and compactions. Another writer's appends are not
seen here: the server's conditional publish catches every append that would rely on them (the
writer then refreshes a stream from the server), so a stale entry costs a round trip, never a
wrong result. The cost is memory in proportion to the live events, like the memory store's.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from events.envelope import Envelope, NewEvent
from events.errors import DuplicateEventId, StoreIOError

from . import messages as m
from .jsapi import Api, translated
from .options import JetStreamOptions

_SCAN_IDLE_S = 5.0  # a scan that hears nothing for this long has lost its consumer
# Past this many, an old forgotten id that is retried meets the server's duplicate check and
# is written again after it (writer.py): the same outcome, a little later.
_FORGOTTEN_KEPT = 1 << 16
# Positions learned past `learned_through`, waiting for the gap before them to fill. Past this
# many the index stops counting them: the next fence reads a longer stretch, nothing worse.
_AHEAD_KEPT = 1 << 16


class Beat(NamedTuple):
    seq: int
    recorded_at: int
    event_id: str


@dataclass(slots=True)
class StreamState:
    """One log stream as this store last saw it. `stale` after an append whose outcome is
    unknown (the ack never came): the next append asks the server first."""

    last_seq: int = 0
    version: int = 0
    stale: bool = False
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    beats: list[Beat] | None = None  # heartbeat streams only, oldest first


class LogIndex:
    def __init__(self, options: JetStreamOptions) -> None:
        self.options = options
        self.streams: dict[str, StreamState] = {}
        self.ids: dict[str, tuple[str, int]] = {}  # event id -> (stream, position)
        # Ids compaction removed lately, oldest first: the server may still hold them in its
        # duplicate window, so they are written again without Nats-Msg-Id.
        self._forgotten: dict[str, None] = {}
        self._sending: dict[str, tuple[str, int]] = {}
        # Every position up to this one is known here (scanned, read, appended or observed):
        # what a fence reads past to make the index exact (store.py, fence).
        self.learned_through = 0
        self._ahead: set[int] = set()

    def state(self, stream: str) -> StreamState:
        state = self.streams.get(stream)
        if state is None:
            state = self.streams[stream] = StreamState()
            if stream.startswith("heartbeat/"):
                state.beats = []
        return state

    def already_stored(self, stream: str, events: Sequence[NewEvent]) -> list[int] | None:
        """The positions of a retried append, None for new events; DuplicateEventId when some
        ids are stored and others are not, or stored under another stream (as the memory
        store decides it)."""
        ids = self.ids
        sending = self._sending
        if len(events) == 1 and events[0].event_id not in ids and events[0].event_id not in sending:
            return None
        found = [ids.get(e.event_id) or sending.get(e.event_id) for e in events]
        if all(f is None for f in found):
            return None
        if all(f is not None and f[0] == stream for f in found):
            return [f[1] for f in found if f is not None]
        first = next(e.event_id for e, f in zip(events, found, strict=True) if f is not None)
        raise DuplicateEventId(first)

    def sending(self, stream: str, events: Sequence[NewEvent]) -> None:
        """Sent, not yet acknowledged: an append to another stream made after this one must
        find these ids taken, as it would once this one is stored."""
        for event in events:
            self._sending[event.event_id] = (stream, 0)

    def settled(self, events: Sequence[NewEvent]) -> None:
        for event in events:
            self._sending.pop(event.event_id, None)

    def record(self, stream: str, events: Sequence[NewEvent], positions: Sequence[int]) -> None:
        """An append committed at `positions`."""
        state = self.state(stream)
        state.last_seq = max(state.last_seq, positions[-1])
        state.version += len(events)
        for event, position in zip(events, positions, strict=True):
            self.ids[event.event_id] = (stream, position)
            self._learned(position)
        if state.beats is not None:
            state.beats += [
                Beat(p, e.recorded_at, e.event_id) for e, p in zip(events, positions, strict=True)
            ]

    def learn(self, subject: str, seq: int, hdrs: dict[str, str]) -> None:
        """A message read from the server, in sequence order."""
        stream = self.options.stream_of(subject)
        state = self.state(stream)
        self._learned(seq)
        if seq <= state.last_seq:
            return
        state.last_seq = seq
        state.version = m.version_of(hdrs)
        event_id = m.event_id_of(hdrs)
        self.ids[event_id] = (stream, seq)
        if state.beats is not None:
            state.beats.append(Beat(seq, m.recorded_at_of(hdrs), event_id))

    def learn_committed(self, envelope: Envelope) -> None:
        """An event another writer committed, as a subscriber saw it (in position order)."""
        state = self.state(envelope.stream)
        self._learned(envelope.position)
        if envelope.position <= state.last_seq:
            return
        state.last_seq = envelope.position
        state.version = envelope.version
        self.ids[envelope.event_id] = (envelope.stream, envelope.position)
        if state.beats is not None:
            state.beats.append(Beat(envelope.position, envelope.recorded_at, envelope.event_id))

    def _learned(self, position: int) -> None:
        if position <= self.learned_through:
            return
        if position != self.learned_through + 1:
            if len(self._ahead) < _AHEAD_KEPT:
                self._ahead.add(position)
            return
        self.learned_through = position
        self._pull_ahead()

    def learned_all_through(self, position: int) -> None:
        """Every message up to `position` has been read (a scan, a fence's read): a gap below
        it is a message since deleted, not one unknown."""
        if position > self.learned_through:
            self.learned_through = position
            self._ahead = {p for p in self._ahead if p > position}
            self._pull_ahead()

    def _pull_ahead(self) -> None:
        ahead = self._ahead
        while ahead and self.learned_through + 1 in ahead:
            self.learned_through += 1
            ahead.discard(self.learned_through)

    def forget(self, beats: Sequence[Beat], stream: str) -> None:
        for beat in beats:
            if self.ids.get(beat.event_id) == (stream, beat.seq):
                del self.ids[beat.event_id]
                self._forgotten[beat.event_id] = None
        excess = len(self._forgotten) - _FORGOTTEN_KEPT
        if excess > 0:
            for event_id in list(itertools.islice(self._forgotten, excess)):
                del self._forgotten[event_id]

    def recently_forgotten(self, events: Sequence[NewEvent]) -> bool:
        return bool(self._forgotten) and any(e.event_id in self._forgotten for e in events)

    async def scan(self, api: Api) -> None:
        """Read every message's headers once, oldest first, through an ordered consumer."""
        last_seq, count = await api.last_sequence()
        if count == 0:
            self.learned_all_through(last_seq)
            return
        js = api.nc.jetstream(timeout=self.options.request_timeout_s)
        queue: asyncio.Queue[Msg] = asyncio.Queue()

        async def take(msg: Msg) -> None:
            queue.put_nowait(msg)

        with translated(self.options):
            sub = await js.subscribe(
                self.options.filter,
                stream=self.options.stream,
                cb=take,
                ordered_consumer=True,
                config=ConsumerConfig(
                    deliver_policy=DeliverPolicy.ALL, headers_only=True, mem_storage=True
                ),
            )
        try:
            while True:
                try:
                    async with asyncio.timeout(_SCAN_IDLE_S):
                        msg = await queue.get()
                except TimeoutError:
                    raise StoreIOError(
                        f"event store on NATS stream {self.options.stream}: reading the log "
                        f"at open stalled (nothing for {_SCAN_IDLE_S:g} s)"
                    ) from None
                meta = msg.metadata
                self.learn(msg.subject, meta.sequence.stream, msg.headers or {})
                if meta.num_pending == 0 or meta.sequence.stream >= last_seq:
                    self.learned_all_through(meta.sequence.stream)
                    return
        finally:
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()
