"""The outbox publisher: every committed event, in commit order, onto the JetStream events stream.

The event store is the source of truth; the stream is a replayable copy for integrators. The
publisher tails the store and publishes each envelope to `gpumesh.v1.events.<kind>.<id>` with
`Nats-Msg-Id = event_id`, pipelining up to `window` unacknowledged publishes.

Where to resume is read from the stream itself (the `Gpumesh-Position` header of its last
message), so the publisher keeps no checkpoint of its own. Each publish also carries
`Nats-Expected-Last-Sequence`: the stream accepts message n+1 only right after message n. A
publish lost in a reconnect therefore cannot let a later one overtake it; instead the next one
is refused, the publisher re-reads the stream's tail and continues from there. That keeps the
stream gapless and in position order even across outages and crashes, and makes duplicates
impossible in normal operation; `Nats-Msg-Id` stays as a second guard (for example against
two publishers racing after a split).

Events deleted from the store (heartbeat compaction) are simply not published: positions on the
stream are increasing, not dense.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Final

import nats.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import PubAck, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from events import Envelope, EventStore
from events.codec import encode_envelope
from events.contract import subjects
from events.contract.subjects import POSITION_HEADER, VERSION_HEADER
from runtime.env import BusError
from wire.nats_bus import NatsBus, describe, ensure_stream

from .errors import ControllerError

log = structlog.get_logger("gpumesh.outbox")

DUPLICATE_WINDOW_S: Final = 600.0
DEFAULT_MAX_AGE_S: Final = 7 * 24 * 3600.0

# JetStream's error code for a failed Nats-Expected-Last-Sequence check.
_WRONG_LAST_SEQUENCE: Final = 10071
# How far back from the stream's end to look for a message the outbox wrote (only messages
# published by hand onto gpumesh.v1.events.> could be in the way).
_RESUME_SCAN_LIMIT: Final = 1000


class OutboxError(ControllerError, BusError):
    """The events stream is in a state the publisher will not guess its way out of (a Bus error
    too, so that what handles the bus's failures handles this one)."""


class _Resync(Exception):
    """The stream is not where this pass thought it was: re-read its tail and go on."""


@dataclass(frozen=True, slots=True)
class ResumePoint:
    last_sequence: int  # the stream's last sequence (0 for a new stream)
    last_position: int  # the store position of the last event on the stream (0: none)


@dataclass(slots=True)
class _InFlight:
    envelope: Envelope
    expected_sequence: int  # the stream sequence this publish must get
    ack: asyncio.Future[PubAck]


class OutboxPublisher:
    """Publishes the store's events onto EVENTS_STREAM. `run()` follows the store until
    cancelled; `publish_pending()` catches up once (tests, tools)."""

    def __init__(
        self,
        store: EventStore,
        bus: NatsBus,
        *,
        window: int = 256,
        max_age: float = DEFAULT_MAX_AGE_S,
        ack_timeout: float = 5.0,
        request_timeout: float = 1.0,
        retry_initial: float = 0.1,
        retry_max: float = 5.0,
    ) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        if request_timeout <= 0:
            raise ValueError("request_timeout must be positive")
        self.store = store
        self.bus = bus
        self.window = window
        self.max_age = max_age
        self.ack_timeout = ack_timeout
        self.retry_initial = retry_initial
        self.retry_max = retry_max
        self.published = 0  # events acknowledged by JetStream since this publisher was made
        self.acked_position = 0  # the store position of the last event known to be on the stream
        self.pauses = 0  # how many times an error made it back off (outages, mostly)
        self._progress: asyncio.Event | None = None  # set (and dropped) on the next ack
        self._js: JetStreamContext = bus.jetstream(timeout=ack_timeout)
        # For the JetStream API requests (the stream's set-up, its info, a message): answered at
        # once, or, while the stream or JetStream's meta group has no leader (seconds after the
        # server leading it dies), never, not even once a leader is elected. Waiting ack_timeout
        # for such an answer held the publisher up to 5 s past the election (and the back-off
        # on top, again per request); the log's writer resends within 1 s instead. A short
        # timeout, and run()'s retry, resume it within about a second of the election.
        self._api: JetStreamContext = bus.jetstream(timeout=request_timeout)
        self._stream_ready = False

    def stream_config(self) -> StreamConfig:
        return StreamConfig(
            name=subjects.EVENTS_STREAM,
            description="gpumesh committed events, in commit order (docs/subjects.md)",
            subjects=[subjects.EVENTS_ALL],
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
            max_age=self.max_age,
        )

    async def ensure_stream(self) -> None:
        await ensure_stream(self._api, self.stream_config(), replicas=self.bus.stream_replicas)
        self._stream_ready = True

    async def run(self) -> None:
        """Publish everything not yet on the stream, then follow the store, until cancelled or
        the store closes. NATS outages pause it (with back-off); nothing is skipped."""
        delay = self.retry_initial
        loop = asyncio.get_running_loop()
        while True:
            before = self.published
            began = loop.time()
            try:
                if not self._stream_ready:
                    await self.ensure_stream()
                await self._pass(follow=True)
                return  # the store closed
            except _Resync:
                continue
            except (BusError, nats.errors.Error, TimeoutError) as exc:
                if self.published > before:
                    delay = self.retry_initial
                self.pauses += 1
                # The back-off spaces the tries' starts: a try that waited out a timeout has
                # waited already (else each request_timeout, and the back-off on top, again).
                pause = max(0.0, delay - (loop.time() - began))
                log.warning("outbox_paused", error=describe(exc), retry_in_s=round(pause, 2))
                self._stream_ready = False  # a restarted server may have lost it
                await asyncio.sleep(pause)
                delay = min(delay * 2, self.retry_max)

    async def publish_pending(self) -> int:
        """One catch-up pass up to the store's current head; returns how many were published.
        Errors are raised, not retried (but a stream found ahead of us is re-read)."""
        if not self._stream_ready:
            await self.ensure_stream()
        published = 0
        for _ in range(10):
            before = self.published
            try:
                await self._pass(follow=False)
            except _Resync:
                published += self.published - before
                continue
            return published + self.published - before
        raise OutboxError("the events stream kept moving under the publisher (another writer?)")

    async def wait_for_position(self, position: int) -> None:
        """Return once the event at `position`, or a later one, is acknowledged by the stream
        (through `run()` or `publish_pending()`). Bound it with a timeout."""
        while self.acked_position < position:
            if self._progress is None:
                self._progress = asyncio.Event()
            await self._progress.wait()

    async def resume_point(self) -> ResumePoint:
        """Where the stream ends: its last sequence and the position of the last event on it."""
        try:
            info = await self._api.stream_info(subjects.EVENTS_STREAM)
        except nats.errors.Error as exc:
            raise BusError(f"cannot read {subjects.EVENTS_STREAM}: {describe(exc)}") from exc
        state = info.state
        last_seq = int(state.last_seq)
        if state.messages == 0:
            if last_seq > 0:
                # Every message aged out (max_age): nothing says how far we got, so publish the
                # store again (at-least-once) rather than risk skipping an event.
                log.warning("outbox_stream_aged_out", last_sequence=last_seq)
            return ResumePoint(last_sequence=last_seq, last_position=0)
        lowest = max(int(state.first_seq), last_seq - _RESUME_SCAN_LIMIT + 1)
        for seq in range(last_seq, lowest - 1, -1):
            try:
                raw = await self._api.get_msg(subjects.EVENTS_STREAM, seq)
            except NotFoundError:
                continue  # deleted or aged out in between
            except nats.errors.Error as exc:
                raise BusError(f"cannot read {subjects.EVENTS_STREAM}: {describe(exc)}") from exc
            position = (raw.headers or {}).get(POSITION_HEADER)
            if position is not None:
                return ResumePoint(last_sequence=last_seq, last_position=int(position))
        raise OutboxError(
            f"none of the last {last_seq - lowest + 1} messages of {subjects.EVENTS_STREAM} "
            f"has a {POSITION_HEADER} header: only the outbox may publish on "
            f"{subjects.EVENTS_ALL}"
        )

    async def _pass(self, *, follow: bool) -> None:
        start = await self.resume_point()
        self.acked_position = start.last_position
        window = _Window(self.window)
        # Acks of publishes written just before a disconnect never come; ones written after it
        # do. Rather than wait out ack_timeout to learn which, re-read the stream's tail.
        reconnected = asyncio.Event()

        async def on_reconnect() -> None:
            reconnected.set()

        self.bus.add_reconnect_callback(on_reconnect)
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(self._produce(start, window, follow=follow), name="outbox-produce")
                tg.create_task(self._settle(window, reconnected), name="outbox-settle")
        except BaseExceptionGroup as group:
            # One cause is enough for the caller's decision (re-read, or back off); the other
            # task only failed because the first one did.
            for other in group.exceptions[1:]:
                log.debug("outbox_secondary_error", error=describe(other))
            raise group.exceptions[0] from None
        finally:
            self.bus.remove_reconnect_callback(on_reconnect)
            window.abandon()

    async def _produce(self, start: ResumePoint, window: _Window, *, follow: bool) -> None:
        expected = start.last_sequence
        source = self._source(start.last_position + 1, follow=follow)
        async with contextlib.aclosing(source) as envelopes:
            async for envelope in envelopes:
                await window.slots.acquire()
                headers = {
                    "Nats-Msg-Id": envelope.event_id,
                    "Nats-Expected-Last-Sequence": str(expected),
                    POSITION_HEADER: str(envelope.position),
                    VERSION_HEADER: str(envelope.version),
                }
                try:
                    ack = await self._js.publish_async(
                        subjects.event(envelope.stream), encode_envelope(envelope), headers=headers
                    )
                except nats.errors.Error as exc:
                    raise BusError(f"publish of {envelope.event_id}: {describe(exc)}") from exc
                expected += 1
                window.push(_InFlight(envelope, expected, ack))
        window.finish()

    async def _source(self, first: int, *, follow: bool) -> AsyncGenerator[Envelope, None]:
        if follow:
            async with contextlib.aclosing(self.store.subscribe(first)) as events:
                async for envelope in events:
                    yield envelope
            return
        head = await self.store.head()
        position = first
        while position <= head:
            page = await self.store.read_all(position, self.window)
            if not page:
                return
            for envelope in page:
                if envelope.position > head:
                    return
                yield envelope
            position = page[-1].position + 1

    async def _settle(self, window: _Window, reconnected: asyncio.Event) -> None:
        while (item := await window.oldest()) is not None:
            ack = await self._ack_of(item, reconnected)
            if ack.seq != item.expected_sequence:
                # A duplicate of a message stored elsewhere on the stream: our numbering is off.
                log.warning(
                    "outbox_unexpected_sequence",
                    event_id=item.envelope.event_id,
                    expected=item.expected_sequence,
                    got=ack.seq,
                    duplicate=bool(ack.duplicate),
                )
                raise _Resync()
            window.pop()
            self.acked_position = item.envelope.position
            self.published += 1
            if self._progress is not None:
                self._progress.set()
                self._progress = None

    async def _ack_of(self, item: _InFlight, reconnected: asyncio.Event) -> PubAck:
        # Acks mostly arrive in bursts: taking the ones already there without suspending lets a
        # whole burst free its slots at once, so the producer refills the window in one go and
        # nats-py writes it in one syscall rather than one message per loop iteration.
        if not item.ack.done():
            reconnect = asyncio.ensure_future(reconnected.wait())
            try:
                await asyncio.wait(
                    (item.ack, reconnect),
                    timeout=self.ack_timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                reconnect.cancel()
            if not item.ack.done():
                if reconnected.is_set():
                    log.info("outbox_resync_after_reconnect", position=item.envelope.position)
                    raise _Resync()
                raise BusError(
                    f"no ack for event {item.envelope.event_id} within {self.ack_timeout:g} s"
                )
        try:
            return item.ack.result()
        except APIError as exc:
            if exc.err_code == _WRONG_LAST_SEQUENCE:
                log.info("outbox_resync", position=item.envelope.position)
                raise _Resync() from None
            raise BusError(f"event {item.envelope.event_id}: {describe(exc)}") from exc
        except nats.errors.Error as exc:
            raise BusError(f"event {item.envelope.event_id}: {describe(exc)}") from exc


class _Window:
    """The publishes awaiting their ack, oldest first, at most `size` of them."""

    def __init__(self, size: int) -> None:
        self.slots = asyncio.Semaphore(size)
        self._items: deque[_InFlight] = deque()
        self._changed = asyncio.Event()
        self._finished = False

    def push(self, item: _InFlight) -> None:
        self._items.append(item)
        self._changed.set()

    def finish(self) -> None:
        """The producer has nothing more: `oldest()` returns None once the window is empty."""
        self._finished = True
        self._changed.set()

    async def oldest(self) -> _InFlight | None:
        while not self._items:
            if self._finished:
                return None
            self._changed.clear()
            await self._changed.wait()
        return self._items[0]

    def pop(self) -> None:
        self._items.popleft()
        self.slots.release()

    def abandon(self) -> None:
        """Give up on every ack still awaited; nats-py frees a publish's slot when cancelled."""
        for item in self._items:
            if not item.ack.done():
                item.ack.cancel()
            elif not item.ack.cancelled():
                item.ack.exception()  # mark it retrieved, so asyncio does not log it
        self._items.clear()
