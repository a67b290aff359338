"""JetStreamEventStore: the EventStore protocol on one JetStream stream, tying the writer, the
index, the followers and the reads together."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Sequence
from typing import Any, Final

import msgspec
import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import KeyValueConfig, StorageType
from nats.js.kv import KeyValue

from events._append_rules import check_batch
from events.catalog import check_stream
from events.envelope import Envelope, NewEvent
from events.errors import EventStoreError, InvalidAppend, StoreClosed
from events.store import Snapshot

from . import messages as m
from .follow import Followers
from .index import Beat, LogIndex, StreamState
from .jsapi import Api, sequence_of, subject_of, translated
from .options import MAX_BATCH, JetStreamOptions
from .tail import Tail
from .writer import Writer

_LAST_SEQ: Final = (1 << 63) - 1
_UNBOUNDED: Final = 1 << 62
_REBUILD_PAGE: Final = 1000
_STALE_READS: Final = 50  # tries, 20 ms apart, before a short read is taken as the truth
_STALE_WAIT_S: Final = 0.02
_COMPACTIONS_IN_FLIGHT: Final = 64

_snapshot_encoder = msgspec.msgpack.Encoder()
_snapshot_decoder = msgspec.msgpack.Decoder(Snapshot)


class JetStreamEventStore:
    """The EventStore protocol on JetStream; create it with `await JetStreamEventStore.open(nc)`.

    `nc` is a connected nats-py client; the store does not close it unless it was opened with
    `connect()`. Use the store from the event loop it was opened on.
    """

    def __init__(self, nc: Client, options: JetStreamOptions, *, owns_connection: bool) -> None:
        self.options = options
        self._nc = nc
        self._owns_connection = owns_connection
        self._api = Api(nc, options)
        self._index = LogIndex(options)
        self._tail = Tail()
        self._writer = Writer(self._api, self._index, self._tail)
        self._followers = Followers(
            self._tail, self._read_envelopes, self._known, self._api.awaiting_acks
        )
        self._snapshots: KeyValue | None = None
        self._closed = False

    @classmethod
    async def open(
        cls, nc: Client, options: JetStreamOptions | None = None, *, owns_connection: bool = False
    ) -> JetStreamEventStore:
        """Create the stream and the snapshot bucket if they are missing, then read the whole
        log's headers once (see index.py) and resume where the log stands."""
        store = cls(nc, options or JetStreamOptions(), owns_connection=owns_connection)
        try:
            await store._api.start()
            await store._api.ensure_stream()
            store._snapshots = await store._bucket()
            await store._index.scan(store._api)
        except BaseException:
            await store._api.stop()
            raise
        return store

    @classmethod
    async def connect(
        cls, url: str, options: JetStreamOptions | None = None, **connect_options: Any
    ) -> JetStreamEventStore:
        """Open on a connection of its own, which `close()` closes."""
        o = options or JetStreamOptions()
        with translated(o):
            nc = await nats.connect(url, **connect_options)
        try:
            return await cls.open(nc, o, owns_connection=True)
        except BaseException:
            await nc.close()
            raise

    # ------------------------------------------------------------------ writes

    async def append(
        self, stream: str, events: Sequence[NewEvent], expected_version: int
    ) -> list[int]:
        self._check_open()
        check_batch(stream, events, expected_version)
        if not events:
            return []
        _check_publishable(events)
        return await self._writer.append(stream, events, expected_version)

    async def append_many(
        self, appends: Sequence[tuple[str, Sequence[NewEvent], int]]
    ) -> list[list[int] | EventStoreError]:
        self._check_open()
        results: list[list[int] | EventStoreError] = [[] for _ in appends]
        work: list[tuple[str, Sequence[NewEvent], int]] = []
        where: list[int] = []
        for index, (stream, events, expected_version) in enumerate(appends):
            try:
                check_batch(stream, events, expected_version)
                _check_publishable(events)
            except EventStoreError as exc:
                results[index] = exc
                continue
            if events:
                work.append((stream, events, expected_version))
                where.append(index)
        for index, outcome in zip(where, await self._writer.append_many(work), strict=True):
            results[index] = outcome
        return results

    async def fence(self, stream: str) -> int:
        """From now on every append is conditional on `stream` still ending where this store
        last appended to it: a leader fences its writes with its term record
        (actors/fenced_store.py), so that none lands once a successor has recorded its own
        term, however long the old leader was paused. Before that, the index learns every
        message up to the record, so that it can check each stream's version itself (see
        writer.py). Returns the sequence fenced on."""
        self._check_open()
        async with self._writer.turns.alone():
            state = self._index.state(stream)
            fence_seq = state.last_seq
            if fence_seq == 0:
                raise InvalidAppend(f"cannot fence on {stream!r}: this store wrote nothing there")
            start = self._index.learned_through + 1
            while start <= fence_seq:
                msgs = await self._read(start, fence_seq - start + 1, None, fence_seq)
                for msg in msgs:
                    if sequence_of(msg) <= fence_seq:
                        self._index.learn(subject_of(msg), sequence_of(msg), msg.headers or {})
                if not msgs:
                    break
                start = sequence_of(msgs[-1]) + 1
            self._index.learned_all_through(fence_seq)
            self._writer.fence = (self.options.subject(stream), fence_seq)
        return fence_seq

    def unfence(self) -> None:
        """Appends are conditional on their own streams again (the term is over)."""
        self._writer.fence = None

    async def compact_heartbeats(self, older_than_ns: int) -> int:
        """Purge, per heartbeat subject, what is older than the bound, keeping the latest.

        Appends made before the call are waited for, so the outcome is the one of running it
        after them, as in the other stores. The usual shape, a run of old heartbeats at the
        front of a stream, is one purge request with a sequence bound; anything else, one
        delete per message. Positions of what remains do not change.
        """
        self._check_open()
        # Appends made after this wait for it; each stream's lock waits for the appends made
        # before it, still in flight there: the outcome is that of running it between them.
        async with self._writer.turns.alone():
            plans = [
                (stream, state)
                for stream, state in list(self._index.streams.items())
                if state.beats is not None and (len(state.beats) > 1 or state.lock.locked())
            ]
            slots = asyncio.Semaphore(_COMPACTIONS_IN_FLIGHT)

            async def one(stream: str, state: StreamState) -> int:
                async with slots, state.lock:
                    beats = state.beats or []
                    doomed = [b for b in beats[:-1] if b.recorded_at < older_than_ns]
                    return await self._compact(stream, state, doomed) if doomed else 0

            counts = await asyncio.gather(*(one(*plan) for plan in plans))
        return sum(counts)

    async def _compact(self, stream: str, state: StreamState, doomed: list[Beat]) -> int:
        beats = state.beats
        assert beats is not None
        subject = self.options.subject(stream)
        if beats[: len(doomed)] == doomed:
            removed = await self._api.purge(subject, beats[len(doomed)].seq)
        else:
            deleted = [await self._api.delete(b.seq) for b in doomed]
            removed = sum(deleted)
        gone = {b.seq for b in doomed}
        state.beats = [b for b in beats if b.seq not in gone]
        self._index.forget(doomed, stream)
        self._tail.forget(list(gone))
        return removed

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        self._check_open()
        try:
            data = _snapshot_encoder.encode(snapshot)
        except (OverflowError, TypeError) as exc:
            raise InvalidAppend(f"snapshot of {snapshot.stream!r} cannot be stored: {exc}") from exc
        if not _valid_stream(snapshot.stream):
            raise InvalidAppend(f"snapshot of an invalid stream {snapshot.stream!r}")
        with translated(self.options):
            await self._bucket_now().put(_key(snapshot.stream), data)

    async def load_snapshot(self, stream: str) -> Snapshot | None:
        self._check_open()
        if not _valid_stream(stream):
            return None
        with translated(self.options):
            try:
                entry = await self._bucket_now().get(_key(stream))
            except nats.js.errors.KeyNotFoundError:
                return None
        if entry.value is None:
            return None
        try:
            return _snapshot_decoder.decode(entry.value)
        except msgspec.DecodeError:
            return None  # a snapshot is only a cache: one that cannot be read is none

    async def _bucket(self) -> KeyValue:
        js = self._nc.jetstream(timeout=self.options.request_timeout_s)
        with translated(self.options):
            try:
                return await js.key_value(self.options.bucket)
            except nats.js.errors.BucketNotFoundError:
                return await js.create_key_value(
                    KeyValueConfig(
                        bucket=self.options.bucket,
                        history=1,
                        storage=StorageType(self.options.storage),
                        replicas=self.options.replicas,
                    )
                )

    def _bucket_now(self) -> KeyValue:
        assert self._snapshots is not None, "opened by open()"
        return self._snapshots

    # ------------------------------------------------------------------ reads

    async def read_all(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        self._check_open()
        start = max(1, from_position)
        if limit < 1 or start > _LAST_SEQ:
            return []
        return await self._read_envelopes(start, limit)

    async def _read_envelopes(self, start: int, limit: int) -> list[Envelope]:
        msgs = await self._read(start, min(limit, _UNBOUNDED), None, self._writer.acked_max)
        return [self._envelope(msg) for msg in msgs]

    def _known(self) -> int:
        """The highest position this store knows to be in the log."""
        return max(self._writer.acked_max, self._index.learned_through)

    async def read_for_rebuild(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        """See events.store.RebuildReader. The index knows every stream's last sequence, so a
        superseded heartbeat is skipped from its headers, its body never decoded."""
        self._check_open()
        found: list[Envelope] = []
        position = max(1, from_position)
        while len(found) < limit and position <= _LAST_SEQ:
            want = max(limit - len(found), _REBUILD_PAGE)
            msgs = await self._read(position, want, None, self._writer.acked_max)
            for msg in msgs:
                stream = self.options.stream_of(subject_of(msg))
                state = self._index.streams.get(stream)
                if (
                    state is not None
                    and state.beats is not None
                    and sequence_of(msg) < state.last_seq
                ):
                    continue
                found.append(self._envelope(msg))
                if len(found) == limit:
                    break
            if len(msgs) < want:
                break
            position = sequence_of(msgs[-1]) + 1
        return found

    async def read_stream(self, stream: str, from_version: int = 1) -> list[Envelope]:
        self._check_open()
        if not _valid_stream(stream):
            return []
        state = self._index.streams.get(stream)
        subject = self.options.subject(stream)
        msgs = await self._read(1, _UNBOUNDED, subject, state.last_seq if state else 0)
        return [
            self._envelope(msg) for msg in msgs if m.version_of(msg.headers or {}) >= from_version
        ]

    async def stream_version(self, stream: str) -> int:
        self._check_open()
        if not _valid_stream(stream):
            return 0
        msg = await self._api.get_one({"last_by_subj": self.options.subject(stream)})
        state = self._index.streams.get(stream)
        # A replica that answers direct gets may lag the leader; this store's own appends
        # are never forgotten.
        if msg is None or (state is not None and state.last_seq > sequence_of(msg)):
            return state.version if state is not None else 0
        return m.version_of(msg.headers or {})

    async def head(self) -> int:
        self._check_open()
        last_seq, _ = await self._api.last_sequence()
        return max(last_seq, self._writer.acked_max)

    def observe(self, envelopes: Sequence[Envelope]) -> None:
        """Bring the index up to date with events another writer committed, as a subscriber
        of this store saw them. For a standby that follows the log while another controller
        writes it: when it takes over, its appends find each stream where it is, instead of
        being refused once per stream the old leader wrote and reading their way there. Only
        while this store object itself appends nothing (its own appends keep the index)."""
        for envelope in envelopes:
            self._index.learn_committed(envelope)

    def subscribe(self, from_position: int = 1) -> AsyncGenerator[Envelope, None]:
        return self._followers.envelopes(from_position)

    def subscribe_batches(self, from_position: int = 1) -> AsyncGenerator[list[Envelope], None]:
        return self._followers.pages(from_position)

    async def _read(self, start: int, limit: int, subject: str | None, known: int) -> list[Msg]:
        """Direct gets may be answered by a replica behind the leader: a read that stops short
        of a sequence this store knows is committed (`known`) is asked again, briefly."""
        msgs: list[Msg] = []
        for _ in range(_STALE_READS):
            msgs = await self._api.read(start, limit, subject)
            reached = sequence_of(msgs[-1]) if msgs else start - 1
            if len(msgs) >= limit or known < start or reached >= known:
                return msgs
            await asyncio.sleep(_STALE_WAIT_S)
        return msgs

    def _envelope(self, msg: Msg) -> Envelope:
        stream = self.options.stream_of(subject_of(msg))
        return m.envelope(stream, sequence_of(msg), msg.headers or {}, msg.data)

    # ------------------------------------------------------------------ lifecycle

    def _check_open(self) -> None:
        if self._closed:
            raise StoreClosed()

    async def close(self) -> None:
        """End the subscriptions, let appends under way finish, then let go. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._followers.close()
        async with self._writer.turns.alone():
            for state in list(self._index.streams.values()):
                if state.lock.locked():
                    async with state.lock:
                        pass
        await self._api.stop()
        if self._owns_connection:
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._nc.close()


def _check_publishable(events: Sequence[NewEvent]) -> None:
    """What a header cannot carry, and what one atomic batch cannot hold."""
    if len(events) > MAX_BATCH:
        raise InvalidAppend(
            f"an append of {len(events)} events: JetStream commits at most {MAX_BATCH} "
            "atomically (split it into appends with consecutive expected versions)"
        )
    for e in events:
        if type(e.recorded_at) is not int:
            raise InvalidAppend(f"recorded_at {e.recorded_at!r} is not an integer")
        if type(e.event_id) is not str or "\r" in e.event_id or "\n" in e.event_id:
            raise InvalidAppend(f"event id {e.event_id!r} cannot be a NATS header value")


def _valid_stream(stream: str) -> bool:
    try:
        check_stream(stream)
    except InvalidAppend:
        return False
    return True


def _key(stream: str) -> str:
    return stream.replace("/", ".", 1)
