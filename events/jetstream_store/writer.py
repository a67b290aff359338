"""The append path: one conditional publish (one event) or one atomic batch (several) per append.

Appends to one stream wait for each other: each is conditional on the sequence the one before
it got (`Nats-Expected-Last-Subject-Sequence`), which is only known from its acknowledgement.
Appends to different streams go out together and wait for their acknowledgements side by side.

What the server may answer, and what the writer does:

- 10071 wrong last sequence: another writer (or an append whose acknowledgement was lost) got
  there first. The writer reads the stream's messages past what it knew, which brings its
  index up to date, then decides as the memory store would: the append was already stored
  (a retry), the expected version is wrong (ConcurrencyConflict), or, with ANY, it tries again.
- a duplicate (one event) or 10201 (a batch holding an id the server saw within its window):
  the index did not know the id, so it belonged to an event since compacted away, or to one
  written by another store object. A duplicate of a message still there under another stream
  is DuplicateEventId; otherwise the events are published again without `Nats-Msg-Id`, as the
  memory store appends an event whose id compaction forgot.
- 10176 batch incomplete: the server abandoned the batch (too many in flight, or a message
  lost on the way); nothing of it was stored, so it is sent again.
- 10164 wrong last sequence, without one: on a clustered stream, another conditional publish
  on the subject checked is still being replicated (the server keeps one in flight per
  subject). Nothing was stored; it is sent again a moment later.

A fenced writer (a leader's, store.fence) sends another condition instead of its stream's:
that the log's term record is still the one of its own term
(`Nats-Expected-Last-Subject-Sequence-Subject` names the terms subject). The server then checks
the term on every append, and the writer checks each stream's version itself, against an index
that is exact for the term: everything before the term record was read when it began, and
nothing after it can be written but by this writer. A 10071 then means only that a newer term
is recorded: TermEnded, nothing written.

A fenced writer's publishes all check the one terms subject, which a clustered stream takes
one at a time: they go through FencedCommits (commits.py), which sends whatever waits as one
batch per replication round. A fenced `append_many` puts its appends there together, so a turn
of heartbeats is one batch (or several of MAX_BATCH events).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Final

from events.envelope import NewEvent
from events.errors import (
    ConcurrencyConflict,
    DuplicateEventId,
    EventStoreError,
    StoreIOError,
    TermEnded,
)
from events.store import ANY

from . import messages as m
from .commits import FencedCommits, Pending
from .index import LogIndex, StreamState
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
    sequence_of,
    subject_of,
)
from .tail import Tail

_ATTEMPTS: Final = 8
_BACKOFF_S: Final = 0.02
_UNBOUNDED: Final = 1 << 62
_STALE_READS: Final = 50


class Turn:
    """An append's place in the order of sending. A future is made only when the next append
    has to wait for this one, which is rare: an append sends in the same step of the loop
    that takes its turn unless it waits for its stream or for a batch slot."""

    __slots__ = ("_waiter", "sent")

    def __init__(self) -> None:
        self.sent = False
        self._waiter: asyncio.Future[None] | None = None

    def release(self) -> None:
        if not self.sent:
            self.sent = True
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(None)

    async def wait(self) -> None:
        if self.sent:
            return
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter


class Turns:
    """Appends send their publishes in the order they were made, so the log orders them as
    the memory store does (the position of an append made after another is higher). Each
    waits for the one before it to have *sent*, not to be acknowledged: one append waiting
    for its stream (behind an append in flight there) holds up those made after it, which
    otherwise cost nothing."""

    def __init__(self) -> None:
        self._last = Turn()
        self._last.release()

    def take(self) -> tuple[Turn, Turn]:
        before, mine = self._last, Turn()
        self._last = mine
        return before, mine

    @contextlib.asynccontextmanager
    async def alone(self) -> AsyncIterator[None]:
        """A turn held to the end: nothing made later sends meanwhile (compaction, close)."""
        before, mine = self.take()
        try:
            await before.wait()
            yield
        finally:
            mine.release()


# (the terms subject, the sequence of the term record) an append is conditional on, or None
Fence = tuple[str, int] | None


def _expect(hdrs: dict[str, str], state: StreamState, fence: Fence) -> None:
    if fence is None:
        hdrs[m.EXPECTED_LAST_SUBJECT_SEQ] = str(state.last_seq)
    else:
        subject, seq = fence
        hdrs[m.EXPECTED_LAST_SUBJECT_SEQ] = str(seq)
        hdrs[m.EXPECTED_SUBJECT] = subject


class Writer:
    def __init__(self, api: Api, index: LogIndex, tail: Tail) -> None:
        self._api = api
        self._index = index
        self._tail = tail
        self._options = api.options
        self._batch_slots = asyncio.Semaphore(api.options.max_inflight_batches)
        self._commits = FencedCommits(api, index)  # a fenced writer's sends (commits.py)
        self._batches = 0
        self.turns = Turns()
        self.acked_max = 0  # the highest sequence this store has seen acknowledged
        # (the terms subject, the sequence of this writer's term record) while fenced; each
        # append keeps the one it was made under
        self.fence: Fence = None

    async def append(self, stream: str, events: Sequence[NewEvent], expected: int) -> list[int]:
        """Append checked events (check_batch passed, not empty)."""
        before, turn = self.turns.take()
        return await self._in_turn(stream, events, expected, before, turn, self.fence)

    async def append_many(
        self, work: Sequence[tuple[str, Sequence[NewEvent], int]]
    ) -> list[list[int] | EventStoreError]:
        """Checked appends, none empty. Each one that can go at once (one event, its stream
        idle and where it expects, nothing before it still waiting) is sent right here, and
        only then are the acknowledgements awaited, in order: one round trip for a turn of
        heartbeats, without a task per append. Any other takes a task, in its turn; once one
        does, those after it do too, so they still send in order."""
        fence = self.fence  # what they are made under, whatever it becomes meanwhile
        if fence is not None:
            return await self._append_many_fenced(work, fence)
        results: list[list[int] | EventStoreError] = [[] for _ in work]
        # (index, what completes it, the lock it holds if it is a coroutine not yet started)
        pending: list[tuple[int, Awaitable[list[int]], asyncio.Lock | None]] = []
        for i, (stream, events, expected) in enumerate(work):
            before, turn = self.turns.take()
            state = self._index.state(stream)
            if not (
                fence is None  # fenced: each goes to the group commits in its turn
                and before.sent
                and len(events) == 1
                and not state.stale
                and not state.lock.locked()
                and expected in (ANY, state.version)
            ):
                task = self._in_turn(stream, events, expected, before, turn, fence)
                pending.append((i, asyncio.ensure_future(task), None))
                continue
            await state.lock.acquire()  # free: returns without waiting
            try:
                stored = self._index.already_stored(stream, events)
                dedupe = not self._index.recently_forgotten(events)
                sent = (
                    None if stored else await self._send_one(stream, state, events, dedupe, fence)
                )
            except EventStoreError as exc:
                results[i] = self._failed(state, exc, turn)
                continue
            if sent is None:
                results[i] = stored or []
                state.lock.release()
                turn.release()
                continue
            turn.release()
            rest = self._locked(stream, state, events, expected, turn, fence, sent)
            pending.append((i, rest, state.lock))
        waited = 0
        try:
            for i, outcome, _ in pending:
                waited += 1
                try:
                    results[i] = await outcome
                except EventStoreError as exc:
                    results[i] = exc
        finally:
            for _, outcome, lock in pending[waited:]:  # only when cancelled, or a bug
                if isinstance(outcome, asyncio.Future):
                    outcome.cancel()
                elif lock is not None and inspect.iscoroutine(outcome):
                    outcome.close()  # never started: its own `finally` will not run
                    lock.release()
        return results

    def _failed(self, state: StreamState, exc: EventStoreError, turn: Turn) -> EventStoreError:
        if isinstance(exc, StoreIOError):
            state.stale = True
        state.lock.release()
        turn.release()
        return exc

    async def _in_turn(
        self,
        stream: str,
        events: Sequence[NewEvent],
        expected: int,
        before: Turn,
        turn: Turn,
        fence: Fence,
    ) -> list[int]:
        try:
            if not before.sent:
                await before.wait()
            state = self._index.state(stream)
            await state.lock.acquire()
        except BaseException:
            turn.release()
            raise
        return await self._locked(stream, state, events, expected, turn, fence)

    async def _locked(
        self,
        stream: str,
        state: StreamState,
        events: Sequence[NewEvent],
        expected: int,
        turn: Turn,
        fence: Fence,
        sent: Sent | None = None,
    ) -> list[int]:
        """The rest of an append, with its stream's lock, which it releases (and its turn)."""
        try:
            if sent is None:
                # Only here, behind the appends made before it: a retry of one of them finds
                # its ids.
                stored = self._index.already_stored(stream, events)
                if stored is not None:
                    return stored
            return await self._append_locked(stream, state, events, expected, turn, fence, sent)
        except StoreIOError:
            state.stale = True  # it may have been stored all the same
            raise
        finally:
            state.lock.release()
            turn.release()

    async def _append_locked(
        self,
        stream: str,
        state: StreamState,
        events: Sequence[NewEvent],
        expected: int,
        turn: Turn,
        fence: Fence,
        sent: Sent | None,
    ) -> list[int]:
        """Publish until the server stores the events or an answer settles the append.
        `sent`: a first publish already on its way (append_many's). `fence`: the one the
        append was made under, kept through every retry: a term that ended meanwhile (its
        store unfenced, or fenced on a successor's record) must not have its append sent
        again without it (the HA crash loop saw one land so after a later term's record)."""
        if state.stale and sent is None:
            state.stale = False
            stored = await self._catch_up(stream, state, events, fence)
            if stored is not None:
                return stored
        # An id compaction removed may still be in the server's duplicate window.
        dedupe = not self._index.recently_forgotten(events)
        caught_up = False
        ack: PubAck | None = None
        leaderless = Leaderless(self._options)
        attempt = 0
        while attempt < _ATTEMPTS:
            attempt += 1
            if sent is not None:
                ack, sent = await self._acked(events, sent), None
            elif expected != ANY and expected != state.version:
                if caught_up:
                    raise ConcurrencyConflict(stream, expected, state.version)
                caught_up = True
                stored = await self._catch_up(stream, state, events, fence)
                if stored is not None:
                    return stored
                continue
            else:
                try:
                    ack = await self._publish(stream, state, events, dedupe, turn, fence)
                except NoStreamResponder:
                    if not await leaderless.wait():
                        raise
                    attempt -= 1
                    continue
            if ack.error is None and not ack.duplicate:
                return self._stored(stream, state, events, ack.seq)
            if ack.duplicate:
                stored = await self._duplicate(stream, events[0], ack.seq)
                if stored is not None:
                    # Ours after all (a resend's answer came first): reads must reach it.
                    self.acked_max = max(self.acked_max, ack.seq)
                    return stored
                dedupe = False
                continue
            assert ack.error is not None
            code = ack.error.err_code
            if code == WRONG_LAST_SEQUENCE and fence is not None:
                raise TermEnded(
                    f"event store on NATS stream {self._options.stream}: append to {stream!r} "
                    f"refused: a newer term than the one recorded at {fence[1]} is in the "
                    f"log ({ack.error.description})"
                )
            if code == WRONG_LAST_SEQUENCE:
                caught_up = True
                known = state.last_seq
                stored = await self._catch_up(stream, state, events, fence)
                if stored is not None:
                    return stored
                if state.last_seq == known:
                    # The replica that answered the read is behind the leader that refused.
                    await asyncio.sleep(_BACKOFF_S * attempt)
            elif code == BATCH_DUPLICATE_MSG_ID:
                dedupe = False
            elif code in (BATCH_INCOMPLETE, EXPECTATION_IN_FLIGHT):
                await asyncio.sleep(_BACKOFF_S * attempt)
            else:
                raise api_failure(self._options, ack.error)
        raise StoreIOError(
            f"event store on NATS stream {self._options.stream}: append to {stream!r} "
            f"refused {_ATTEMPTS} times (last: {ack.error if ack else 'a conflict'})"
        )

    async def _publish(
        self,
        stream: str,
        state: StreamState,
        events: Sequence[NewEvent],
        dedupe: bool,
        turn: Turn,
        fence: Fence,
    ) -> PubAck:
        """Send, give up the turn, then wait for the acknowledgement."""
        if fence is not None:
            pending = self._commits.submit(stream, events, state.version + 1, dedupe, fence)
            turn.release()
            await self._commits.settle([pending])
            return pending.done.result()
        if len(events) == 1:
            sent = await self._send_one(stream, state, events, dedupe, fence)
            turn.release()
            return await self._acked(events, sent)
        async with self._batch_slots:
            self._index.sending(stream, events)
            try:
                subject = self._options.subject(stream)
                sent = await self._send_batch(subject, state, events, dedupe, fence)
            except BaseException:
                self._index.settled(events)
                raise
            turn.release()
            return await self._acked(events, sent)

    async def _send_one(
        self,
        stream: str,
        state: StreamState,
        events: Sequence[NewEvent],
        dedupe: bool,
        fence: Fence,
    ) -> Sent:
        event = events[0]
        hdrs = m.headers(event, state.version + 1, dedupe=dedupe)
        _expect(hdrs, state, fence)
        self._index.sending(stream, events)
        try:
            return await self._api.send(self._options.subject(stream), m.body(event), hdrs)
        except BaseException:
            self._index.settled(events)
            raise

    async def _acked(self, events: Sequence[NewEvent], sent: Sent) -> PubAck:
        try:
            return await self._api.acked(sent)
        finally:
            self._index.settled(events)

    async def _send_batch(
        self,
        subject: str,
        state: StreamState,
        events: Sequence[NewEvent],
        dedupe: bool,
        fence: Fence,
    ) -> Sent:
        """An atomic batch. Only its first message carries the expected sequence: the server
        refuses the check on a later message of the same subject (10164), and needs none,
        since nothing can come between the messages of a batch."""
        self._batches += 1
        batch_id = f"{self._api.token_source}-{self._batches}"
        last = len(events)
        for i, event in enumerate(events, start=1):
            hdrs = m.headers(event, state.version + i, dedupe=dedupe)
            hdrs[m.BATCH_ID] = batch_id
            hdrs[m.BATCH_SEQ] = str(i)
            if i == 1:
                _expect(hdrs, state, fence)
            if i == last:
                hdrs[m.BATCH_COMMIT] = "1"
                return await self._api.send(subject, m.body(event), hdrs)
            # Only the commit is acknowledged; these are queued on the connection before it.
            await self._api.send_only(subject, m.body(event), hdrs)
        raise AssertionError("a batch has at least two events")

    # ------------------------------------------------------------------ a fenced append_many

    async def _append_many_fenced(
        self, work: Sequence[tuple[str, Sequence[NewEvent], int]], fence: tuple[str, int]
    ) -> list[list[int] | EventStoreError]:
        """A fenced append_many: in one turn, every append that can go without asking the
        server anything (its stream known and where it expects, not a retry) goes to the group
        commits together, in the order given (atomic batches of up to MAX_BATCH events); then
        the others, one by one, as `append` sends them. A batch is stored whole or not at all
        (each of its appends then gets the error)."""
        results: list[list[int] | EventStoreError] = [[] for _ in work]
        before, turn = self.turns.take()
        held: dict[str, StreamState] = {}
        rest: list[int] = []
        try:
            if not before.sent:
                await before.wait()
            group: list[int] = []
            for i, (stream, events, expected) in enumerate(work):
                if stream in held:
                    rest.append(i)  # a stream twice: its second append goes on its own
                    continue
                state = self._index.state(stream)
                await state.lock.acquire()  # behind the appends made before, in flight there
                held[stream] = state
                try:
                    simple = (
                        not state.stale
                        and expected in (ANY, state.version)
                        and not self._index.recently_forgotten(events)
                        and self._index.already_stored(stream, events) is None
                    )
                except DuplicateEventId:
                    simple = False
                (group if simple else rest).append(i)
            if len(group) == 1:
                rest[:0] = group  # alone, it goes as `append` sends it
                rest.sort()
                group = []
            pendings = [
                self._commits.submit(
                    work[i][0], work[i][1], held[work[i][0]].version + 1, True, fence
                )
                for i in group
            ]
            turn.release()
            await self._commits.settle(pendings)
            for i, pending in zip(group, pendings, strict=True):
                results[i] = self._settled(work[i], held[work[i][0]], pending)
        finally:
            for state in held.values():
                state.lock.release()
            turn.release()
        for i in rest:
            stream, events, expected = work[i]
            state = self._index.state(stream)
            done = Turn()
            done.release()
            try:
                await state.lock.acquire()
                results[i] = await self._locked(stream, state, events, expected, done, fence)
            except EventStoreError as exc:
                results[i] = exc
        return results

    def _settled(
        self, append: tuple[str, Sequence[NewEvent], int], state: StreamState, pending: Pending
    ) -> list[int] | EventStoreError:
        stream, events, _ = append
        error = pending.done.exception()
        if error is not None:
            if isinstance(error, StoreIOError):
                state.stale = True  # it may have been stored all the same
            if isinstance(error, EventStoreError):
                return error
            raise error
        return self._stored(stream, state, events, pending.done.result().seq)

    def _stored(
        self, stream: str, state: StreamState, events: Sequence[NewEvent], last_seq: int
    ) -> list[int]:
        """An append acknowledged, its last message at `last_seq`: what the store keeps of it."""
        positions = list(range(last_seq - len(events) + 1, last_seq + 1))
        # The versions its messages carry (the stream's lock is held since the send).
        self._tail.remember(stream, events, positions, state.version + 1)
        self._index.record(stream, events, positions)
        self.acked_max = max(self.acked_max, last_seq)
        return positions

    async def _catch_up(
        self, stream: str, state: StreamState, events: Sequence[NewEvent], fence: Fence
    ) -> list[int] | None:
        """Learn the stream's messages past the last one this store knew; then the positions
        of `events` if they turned out to be among them (a retry of an append whose
        acknowledgement was lost), else None."""
        subject = self._options.subject(stream)
        if fence is None:
            # The server checks the stream on the next publish: a copy that lags costs a
            # refusal and another read, never a wrong version.
            msgs = await self._api.read(state.last_seq + 1, _UNBOUNDED, subject)
        else:
            # Nothing checks the stream but this index: read up to what the stream's leader
            # holds (an append whose acknowledgement was lost may be there), from whichever
            # copy answers, asked again until it has it.
            last = await self._api.last_on_subject(subject)
            msgs = []
            for _ in range(_STALE_READS):
                if last <= state.last_seq:
                    break
                msgs = await self._api.read(state.last_seq + 1, _UNBOUNDED, subject)
                if msgs and sequence_of(msgs[-1]) >= last:
                    break
                await asyncio.sleep(_BACKOFF_S)
            else:
                raise StoreIOError(
                    f"event store on NATS stream {self._options.stream}: no copy answered "
                    f"{stream!r} up to {last}, which its leader holds"
                )
        for msg in msgs:
            self._index.learn(subject, sequence_of(msg), msg.headers or {})
        return self._index.already_stored(stream, events)

    async def _duplicate(self, stream: str, event: NewEvent, seq: int) -> list[int] | None:
        """The server has seen this id at `seq`: where is that message now?"""
        msg = await self._api.get_one({"seq": seq})
        if msg is None:
            return None  # compacted away: the id is free again
        if subject_of(msg) != self._options.subject(stream):
            raise DuplicateEventId(event.event_id)
        return [seq]
