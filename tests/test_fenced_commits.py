"""The group commits of a fenced writer (events/jetstream_store/commits.py), against a stand-in
for a clustered JetStream stream that behaves as nats-server does where it matters here: one
conditional publish per checked subject in flight (another is refused, 10164), an atomic batch
stored whole at consecutive sequences, and a newer term record refusing everything fenced on
an older one (10071). Hypothesis draws the appends, their sizes, when some are cancelled,
how long each answer takes and when a successor records its term."""

from __future__ import annotations

import asyncio
import contextlib
import random
from dataclasses import dataclass, field
from typing import Any

from hypothesis import given, strategies as st

from events import NodeDrained
from events.envelope import NewEvent
from events.errors import StoreIOError, TermEnded
from events.jetstream_store import JetStreamOptions, messages as m
from events.jetstream_store.commits import FencedCommits, Pending
from events.jetstream_store.index import LogIndex
from events.jetstream_store.jsapi import ApiError, PubAck, Sent

OPTIONS = JetStreamOptions(stream="T", subject_prefix="t.log")
TERMS = OPTIONS.subject("leadership/terms")


@dataclass
class ClusteredStream:
    """What the committer sees of a clustered stream, answering after a drawn delay."""

    rng: random.Random
    term_seq: int = 1  # the sequence of the term record appends are fenced on
    stored: list[tuple[str, str]] = field(default_factory=list)  # (subject, event id)
    in_flight: bool = False  # a conditional publish on the terms subject is replicating
    refused_in_flight: int = 0
    batches: dict[str, list[tuple[str, dict[str, str]]]] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    options: JetStreamOptions = OPTIONS
    token_source: str = "fake"
    _tokens: int = 0

    async def send_only(self, subject: str, data: bytes, hdrs: dict[str, str]) -> None:
        self.batches.setdefault(hdrs[m.BATCH_ID], []).append((subject, hdrs))

    async def send(self, subject: str, data: bytes, hdrs: dict[str, str]) -> Sent:
        self._tokens += 1
        ack: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        messages = [(subject, hdrs)]
        if m.BATCH_ID in hdrs:
            messages = self.batches.pop(hdrs[m.BATCH_ID], []) + messages
        first = messages[0][1]
        assert first[m.EXPECTED_SUBJECT] == TERMS  # every fenced append checks the term
        if self.in_flight:
            self.refused_in_flight += 1
            ack.set_result(PubAck(error=ApiError(400, 10164, "wrong last sequence")))
        else:
            self.in_flight = True
            task = asyncio.ensure_future(
                self._apply(messages, int(first[m.EXPECTED_LAST_SUBJECT_SEQ]), ack)
            )
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
        return Sent(str(self._tokens), ack)

    async def _apply(
        self, messages: list[tuple[str, dict[str, str]]], expected: int, ack: asyncio.Future[Any]
    ) -> None:
        await asyncio.sleep(self.rng.random() * 0.002)
        self.in_flight = False
        if expected != self.term_seq:
            answer = PubAck(error=ApiError(400, 10071, f"wrong last sequence: {self.term_seq}"))
        else:
            self.stored += [(subject, m.event_id_of(hdrs)) for subject, hdrs in messages]
            answer = PubAck(stream="T", seq=len(self.stored))
        if not ack.done():  # its waiter may have been cancelled: the server stores it anyway
            ack.set_result(answer)

    async def acked(self, sent: Sent) -> PubAck:
        answer: PubAck = await sent.ack
        return answer


def event(n: int) -> NewEvent:
    return NewEvent(event_id=f"e{n}", payload=NodeDrained(node_id="a", reason="x"), recorded_at=n)


appends = st.lists(
    st.tuples(
        st.integers(0, 5),  # the stream (several appends may share one)
        st.integers(1, 3),  # its events
        st.booleans(),  # cancelled while it waits
    ),
    min_size=1,
    max_size=25,
)


@given(appends, st.integers(0, 2**32 - 1), st.one_of(st.none(), st.integers(0, 30)))
def test_group_commits_store_each_append_once_in_order_and_never_two_in_flight(
    work: list[tuple[int, int, bool]], seed: int, term_ends_after: int | None
) -> None:
    asyncio.run(_scenario(work, seed, term_ends_after))


async def _scenario(
    work: list[tuple[int, int, bool]], seed: int, term_ends_after: int | None
) -> None:
    rng = random.Random(seed)
    server = ClusteredStream(rng)
    index = LogIndex(OPTIONS)
    commits = FencedCommits(server, index)  # type: ignore[arg-type]
    fence = (TERMS, 1)
    numbers = iter(range(1, 1_000))
    pendings: dict[int, Pending] = {}
    tasks: list[asyncio.Task[None]] = []

    async def append(i: int, stream: str, events: list[NewEvent]) -> None:
        # As the writer does: submitted and settled in one step of the loop.
        pendings[i] = commits.submit(stream, events, 1, True, fence)
        await commits.settle([pendings[i]])

    for i, (stream, size, _) in enumerate(work):
        events = [event(next(numbers)) for _ in range(size)]
        tasks.append(asyncio.ensure_future(append(i, f"node/s{stream}", events)))
        if rng.random() < 0.5:
            await asyncio.sleep(rng.random() * 0.001)  # some arrive while one is in flight
        if term_ends_after is not None and len(server.stored) >= term_ends_after:
            server.term_seq = 99  # a successor recorded its term
    for task, (_, _, cancel) in zip(tasks, work, strict=True):
        if cancel:
            task.cancel()
    async with asyncio.timeout(10):  # a hang is a failure
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if server.tasks:  # answers whose waiters were cancelled: the server stores them
            await asyncio.wait(server.tasks)

    assert not index._sending  # every id settled
    stored_ids = [event_id for _, event_id in server.stored]
    assert len(stored_ids) == len(set(stored_ids))  # each once
    expected_order: list[str] = []
    senders_cancelled = 0
    for i, (stream, _, _) in enumerate(work):
        if i not in pendings:
            continue  # cancelled before it began: nothing was submitted
        pending = pendings[i]
        ids = [e.event_id for e in pending.events]
        subject = OPTIONS.subject(f"node/s{stream}")
        if pending.done.cancelled():
            assert not set(ids) & set(stored_ids)  # taken out before it was sent
            continue
        outcome = pending.done.exception()
        if outcome is None:
            seq = pending.done.result().seq
            positions = list(range(seq - len(ids) + 1, seq + 1))
            assert [server.stored[p - 1] for p in positions] == [(subject, i) for i in ids]
            expected_order += ids
        elif isinstance(outcome, TermEnded):
            assert not set(ids) & set(stored_ids)
        else:
            # Its sender was cancelled mid-flight: stored whole or not at all, said unknown.
            assert isinstance(outcome, StoreIOError)
            senders_cancelled += 1
            kept = [i for i in ids if i in stored_ids]
            assert kept in ([], ids)
            expected_order += kept
    assert [i for i in stored_ids if i in set(expected_order)] == expected_order  # FIFO
    assert set(stored_ids) == set(expected_order)
    # Never two conditional publishes in flight, but where a sender was cancelled before its
    # answer came: the next one may then meet its publish still replicating (10164, sent
    # again after a moment).
    assert server.refused_in_flight == 0 or senders_cancelled
