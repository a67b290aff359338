"""A fenced writer's publishes, sent one at a time as group commits.

Every append of a fenced writer (a leader's) is conditional on the one terms subject, and a
clustered stream takes one conditional publish per subject while it replicates it, answering
any other 10164 (measured on three nats-servers: eight appends to different streams sent
together lost three in eight; `append_many` of a hundred heartbeats, 45% of them). So the
appends a fenced writer has checked wait here, in the order they were made, and whoever finds
nobody sending sends all that waits, as one atomic batch (up to MAX_BATCH events) fenced on its
first message, then the next lot, until its own append is answered; then another waiter takes
over. Under load a replication round carries every append that arrived during the one before
(a group commit); alone, an append is one plain conditional publish, as before.

The sender settles what the server's answer settles for every append in the batch: stored
(each gets the positions of its own messages), TermEnded (a newer term is recorded: nothing
stored), or a failure whose outcome is unknown (StoreIOError: its append may be stored). It
sends again what the server refused without storing anything and expects to take soon: 10164
(another writer's conditional publish on the terms subject in flight, a successor's term
record), 10176 (an abandoned batch), 10201 (an id the server remembers, sent again without
`Nats-Msg-Id`, as the writer does for any batch), and "no responders" while the stream elects a
leader.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from events.envelope import NewEvent
from events.errors import EventStoreError, StoreIOError, TermEnded

from . import messages as m
from .index import LogIndex
from .jsapi import (
    BATCH_DUPLICATE_MSG_ID,
    BATCH_INCOMPLETE,
    EXPECTATION_IN_FLIGHT,
    WRONG_LAST_SEQUENCE,
    Api,
    Leaderless,
    NoStreamResponder,
    PubAck,
    Sent,
    api_failure,
)
from .options import MAX_BATCH

# (the terms subject, the sequence of the term record) an append is conditional on
Fence = tuple[str, int]

_ATTEMPTS: Final = 8
_BACKOFF_S: Final = 0.02


@dataclass(slots=True)
class Pending:
    """One checked append waiting to be sent: `done` gets the acknowledgement of its last
    message (its positions end at `seq`), or the error that settles it."""

    stream: str
    events: Sequence[NewEvent]
    version: int  # the stream version its first event takes
    dedupe: bool
    fence: Fence
    done: asyncio.Future[PubAck]


class FencedCommits:
    def __init__(self, api: Api, index: LogIndex) -> None:
        self._api = api
        self._options = api.options
        self._index = index
        self._queue: deque[Pending] = deque()
        self._sending = False
        self._handover: asyncio.Future[None] | None = None
        self._batches = 0
        self.batches_sent = 0  # atomic batches, for tests and benches
        self.appends_sent = 0

    def submit(
        self, stream: str, events: Sequence[NewEvent], version: int, dedupe: bool, fence: Fence
    ) -> Pending:
        """Queue a checked append (its place in the log's order is taken here)."""
        pending = Pending(
            stream, events, version, dedupe, fence, asyncio.get_running_loop().create_future()
        )
        self._index.sending(stream, events)
        self._queue.append(pending)
        return pending

    async def settle(self, appends: Sequence[Pending]) -> None:
        """Return once every one of `appends` is answered, sending while nobody else is.
        Cancelled, the ones not yet sent are taken out of the queue: nothing of them is
        written."""
        try:
            for pending in appends:
                while not pending.done.done():
                    if self._sending:
                        if self._handover is None:
                            self._handover = asyncio.get_running_loop().create_future()
                        await asyncio.wait(
                            (pending.done, self._handover), return_when=asyncio.FIRST_COMPLETED
                        )
                        continue
                    self._sending = True
                    try:
                        while not pending.done.done():
                            await self._send_next()
                    finally:
                        self._sending = False
                        if self._handover is not None:
                            handover, self._handover = self._handover, None
                            handover.set_result(None)
        except asyncio.CancelledError:
            for pending in appends:
                if pending in self._queue:
                    self._queue.remove(pending)
                    self._index.settled(pending.events)
                    pending.done.cancel()
                elif pending.done.done() and not pending.done.cancelled():
                    pending.done.exception()  # retrieved: nobody awaits it any more
            raise

    async def _send_next(self) -> None:
        """Send the oldest appends waiting, as many as one batch holds, and settle them."""
        lot = [self._queue.popleft()]
        size = len(lot[0].events)
        while (
            self._queue
            and self._queue[0].fence == lot[0].fence
            and size + len(self._queue[0].events) <= MAX_BATCH
        ):
            size += len(self._queue[0].events)
            lot.append(self._queue.popleft())
        try:
            ack = await self._acked(lot)
        except BaseException as exc:
            error = (
                exc
                if isinstance(exc, EventStoreError)
                else StoreIOError(
                    f"event store on NATS stream {self._options.stream}: the sender of "
                    f"{len(lot)} appends stopped before their answer ({type(exc).__name__})"
                )
            )
            for pending in lot:
                self._index.settled(pending.events)
                if not pending.done.done():
                    pending.done.set_exception(error)
            if error is exc:
                return  # an answer for every append of the lot: the sender goes on
            raise
        seq = ack.seq - size
        for pending in lot:
            self._index.settled(pending.events)
            seq += len(pending.events)
            if not pending.done.done():
                pending.done.set_result(PubAck(stream=ack.stream, seq=seq, duplicate=ack.duplicate))

    async def _acked(self, lot: list[Pending]) -> PubAck:
        """Publish the lot until the server stores it or an answer settles it."""
        alone = len(lot) == 1 and len(lot[0].events) == 1
        leaderless = Leaderless(self._options)
        ack: PubAck | None = None
        attempt = 0
        while attempt < _ATTEMPTS:
            attempt += 1
            try:
                if alone:
                    sent = await self._send_one(lot[0])
                else:
                    sent = await self._send_batch(lot)
                ack = await self._api.acked(sent)
            except NoStreamResponder:
                if not await leaderless.wait():
                    raise
                attempt -= 1
                continue
            if ack.error is None:
                # A lone publish may be answered "duplicate": its append decides what that is.
                self.appends_sent += len(lot)
                self.batches_sent += not alone
                return ack
            code = ack.error.err_code
            if code == WRONG_LAST_SEQUENCE:
                raise TermEnded(
                    f"event store on NATS stream {self._options.stream}: "
                    f"{_appends(lot)} refused: a newer term than the one recorded at "
                    f"{lot[0].fence[1]} is in the log ({ack.error.description})"
                )
            if code == BATCH_DUPLICATE_MSG_ID:
                for pending in lot:
                    pending.dedupe = False
            elif code in (BATCH_INCOMPLETE, EXPECTATION_IN_FLIGHT):
                await asyncio.sleep(_BACKOFF_S * attempt)
            else:
                raise api_failure(self._options, ack.error)
        raise StoreIOError(
            f"event store on NATS stream {self._options.stream}: {_appends(lot)} refused "
            f"{_ATTEMPTS} times (last: {ack.error if ack else 'no answer'})"
        )

    async def _send_one(self, pending: Pending) -> Sent:
        event = pending.events[0]
        hdrs = m.headers(event, pending.version, dedupe=pending.dedupe)
        _expect(hdrs, pending.fence)
        return await self._api.send(self._options.subject(pending.stream), m.body(event), hdrs)

    async def _send_batch(self, lot: list[Pending]) -> Sent:
        """One atomic batch across streams: the fence on its first message, each message with
        its own stream's version; only the commit is acknowledged."""
        self._batches += 1
        batch_id = f"{self._api.token_source}-f{self._batches}"
        last = sum(len(pending.events) for pending in lot)
        i = 0
        for pending in lot:
            subject = self._options.subject(pending.stream)
            for j, event in enumerate(pending.events):
                i += 1
                hdrs = m.headers(event, pending.version + j, dedupe=pending.dedupe)
                hdrs[m.BATCH_ID] = batch_id
                hdrs[m.BATCH_SEQ] = str(i)
                if i == 1:
                    _expect(hdrs, pending.fence)
                if i == last:
                    hdrs[m.BATCH_COMMIT] = "1"
                    return await self._api.send(subject, m.body(event), hdrs)
                await self._api.send_only(subject, m.body(event), hdrs)
        raise AssertionError("a lot holds at least one event")


def _expect(hdrs: dict[str, str], fence: Fence) -> None:
    subject, seq = fence
    hdrs[m.EXPECTED_LAST_SUBJECT_SEQ] = str(seq)
    hdrs[m.EXPECTED_SUBJECT] = subject


def _appends(lot: Sequence[Pending]) -> str:
    if len(lot) == 1:
        return f"append to {lot[0].stream!r}"
    return f"{len(lot)} appends ({lot[0].stream!r} first)"
