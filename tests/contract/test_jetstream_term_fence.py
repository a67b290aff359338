"""A leader's appends are fenced on its term record, by the server (store.fence): once a newer
term is recorded, nothing of the old term reaches the log, whatever its own view of the
streams. Run on the nats-server the contract tests share, a stream of their own each."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from actors.fenced_store import Deposed, fenced
from events import (
    ANY,
    NO_STREAM,
    TERMS_STREAM,
    ConcurrencyConflict,
    ControllerGrace,
    LeaderTermBegan,
    NodeDrained,
    NodeHeartbeat,
    NodeRegistered,
    TermEnded,
)
from events.jetstream_store import JetStreamOptions
from tests.contract.jetstream import opened
from tests.factories import EventMaker


class Lease:
    """A guard that always believes it leads: the process's own fence is out of the way, so
    what is refused here is refused by the server."""

    def __init__(self) -> None:
        self.why: list[str] = []

    def holds_lease(self) -> bool:
        return True

    def deposed(self, reason: str) -> None:
        self.why.append(reason)


def note(node: str, seq: int) -> NodeDrained:
    return NodeDrained(node_id=node, reason=f"note {seq}")


async def test_a_term_fenced_out_by_a_newer_one_writes_nothing(options: JetStreamOptions) -> None:
    make = EventMaker()
    async with opened(options) as old, opened(options) as new:
        old_lease, new_lease = Lease(), Lease()
        old_store = fenced(old, old_lease, term=3)
        new_store = fenced(new, new_lease, term=4)
        await old_store.begin_term(make(LeaderTermBegan(controller_id="c1", term=3)))
        assert await old_store.append("node/a", [make(NodeRegistered(node_id="a"))], 0) == [2]
        await old_store.append("heartbeat/a", [make(NodeHeartbeat(node_id="a", seq=0))], ANY)
        # The new leader has not seen node/a: its fence read brings its index there.
        await new_store.begin_term(make(LeaderTermBegan(controller_id="c2", term=4)))
        head = await new.head()
        # The old leader's view of node/a is current, yet the server refuses it: single
        # appends, batches and append_many alike.
        with pytest.raises(Deposed, match="newer term"):
            await old_store.append("node/a", [make(note("a", 1))], 1)
        with pytest.raises(Deposed):
            await old_store.append("node/b", [make(note("b", 1)), make(note("b", 2))], ANY)
        beat = make(NodeHeartbeat(node_id="a", seq=1))
        [outcome] = await old_store.append_many([("heartbeat/a", [beat], ANY)])
        assert isinstance(outcome, Deposed)
        assert await new.head() == head
        assert old_lease.why and all("term 3" in why for why in old_lease.why)
        # The new one goes on from where the old one left node/a.
        assert await new_store.append("node/a", [make(note("a", 2))], 1) == [head + 1]
        assert [e.version for e in await new.read_stream("node/a")] == [1, 2]
        # With ANY the server checks no stream: the version written is the index's, which
        # the fence read made exact.
        await new_store.append("heartbeat/a", [make(NodeHeartbeat(node_id="a", seq=2))], ANY)
        assert [e.version for e in await new.read_stream("heartbeat/a")] == [1, 2]
        terms = [e.payload for e in await new.read_stream(TERMS_STREAM)]
        assert terms == [
            LeaderTermBegan(controller_id="c1", term=3),
            LeaderTermBegan(controller_id="c2", term=4),
        ]


async def test_a_fenced_writer_still_checks_each_stream_version(options: JetStreamOptions) -> None:
    make = EventMaker()
    async with opened(options) as store:
        leader = fenced(store, Lease(), term=1)
        await leader.begin_term(make(LeaderTermBegan(controller_id="c1", term=1)))
        await leader.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
        with pytest.raises(ConcurrencyConflict):
            await leader.append("node/a", [make(note("a", 1))], NO_STREAM)
        retried = make(note("a", 2))
        assert await leader.append("node/a", [retried], 1) == [3]
        assert await leader.append("node/a", [retried], 1) == [3]  # a retry writes nothing
        assert [e.version for e in await store.read_stream("node/a")] == [1, 2]


async def test_an_older_term_cannot_record_itself_after_a_newer_one(
    options: JetStreamOptions,
) -> None:
    make = EventMaker()
    async with opened(options) as first, opened(options) as second:
        await fenced(second, Lease(), term=7).begin_term(
            make(LeaderTermBegan(controller_id="c2", term=7))
        )
        late = fenced(first, Lease(), term=6)
        with pytest.raises(Deposed, match="c2 leads term 7"):
            await late.begin_term(make(LeaderTermBegan(controller_id="c1", term=6)))
        assert len(await first.read_stream(TERMS_STREAM)) == 1


async def test_a_term_ended_and_begun_again_fences_on_the_new_record(
    options: JetStreamOptions,
) -> None:
    """A controller that led, stood by while another led, and leads again: its second term
    learns what the other wrote between, and fences on its new record."""
    make = EventMaker()
    async with opened(options) as a, opened(options) as b:
        a_store = fenced(a, Lease(), term=1)
        await a_store.begin_term(make(LeaderTermBegan(controller_id="a", term=1)))
        await a_store.append("node/x", [make(NodeRegistered(node_id="x"))], NO_STREAM)
        a_store.end_term()
        b_store = fenced(b, Lease(), term=2)
        await b_store.begin_term(make(LeaderTermBegan(controller_id="b", term=2)))
        await b_store.append("node/x", [make(note("x", 1))], 1)
        a_again = fenced(a, Lease(), term=3)
        await a_again.begin_term(make(LeaderTermBegan(controller_id="a", term=3)))
        assert await a_again.append("node/x", [make(note("x", 2))], 2) == [6]
        with pytest.raises(TermEnded):  # b, still fenced on term 2
            await b.append("node/y", [make(NodeRegistered(node_id="y"))], NO_STREAM)
        b_store.end_term()  # standing by, it is a plain store again
        assert await b.append("node/y", [make(NodeRegistered(node_id="y"))], NO_STREAM) == [7]


async def test_a_fenced_writer_whose_acknowledgement_was_lost_reads_the_leader_first(
    options: JetStreamOptions,
) -> None:
    """An append whose acknowledgement never came leaves its stream stale; with no stream check
    on the server, the next append must learn what the stream's leader holds, even when the
    copy that answers reads lags it."""
    make = EventMaker()
    async with opened(options) as store, opened(options) as other:
        leader = fenced(store, Lease(), term=1)
        await leader.begin_term(make(LeaderTermBegan(controller_id="c1", term=1)))
        await leader.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
        # What an append of its own whose answer was lost would have left on the server:
        lost = make(note("a", 1))
        await other.append("node/a", [lost], 1)
        store._index.state("node/a").stale = True
        reads = 0
        real_read = store._api.read

        async def lagging(start: int, limit: int, subject: str | None = None) -> list[object]:
            nonlocal reads
            reads += 1
            if reads == 1:
                return []
            return await real_read(start, limit, subject)  # type: ignore[return-value]

        store._api.read = lagging  # type: ignore[method-assign,assignment]
        assert await leader.append("node/a", [lost], 1) == [3]  # found: a retry
        assert await leader.append("node/a", [make(note("a", 2))], ANY) == [4]
        assert reads == 2
        assert [e.version for e in await other.read_stream("node/a")] == [1, 2, 3]


async def test_an_append_retried_after_its_term_ended_keeps_its_fence(
    options: JetStreamOptions,
) -> None:
    """An append of a term, retried while its stream elects a leader, must not go out again
    unfenced once the term has ended meanwhile (the HA crash loop saw a grace event of an old
    term land after a later term's record that way)."""
    from events.jetstream_store.jsapi import NoStreamResponder

    make = EventMaker()
    async with opened(options) as old, opened(options) as new:
        old_store = fenced(old, Lease(), term=1)
        await old_store.begin_term(make(LeaderTermBegan(controller_id="c1", term=1)))
        refused_once = asyncio.Event()
        real_send = old._api.send

        async def leaderless_once(subject: str, data: bytes, hdrs: dict[str, str]) -> Any:
            if not refused_once.is_set() and subject.endswith("controller.c1"):
                refused_once.set()
                raise NoStreamResponder("no stream takes it (electing)")
            return await real_send(subject, data, hdrs)

        old._api.send = leaderless_once  # type: ignore[method-assign]
        grace = make(
            ControllerGrace(controller_id="c1", reason="reconnected", grace_s=5.4, lease_s=2.4)
        )
        appending = asyncio.ensure_future(old_store.append("controller/c1", [grace], ANY))
        await refused_once.wait()
        # Meanwhile the term ends and a successor records its own.
        old_store.end_term()
        await fenced(new, Lease(), term=2).begin_term(
            make(LeaderTermBegan(controller_id="c2", term=2))
        )
        with pytest.raises(Deposed):
            await appending
        assert await new.read_stream("controller/c1") == []


async def test_a_fenced_append_many_is_one_batch_of_consecutive_positions(
    options: JetStreamOptions,
) -> None:
    """A leader's turn of heartbeats is one atomic batch fenced on its first message (a
    clustered stream takes one conditional publish per subject at a time): each append gets
    its own stream's next version, the positions follow the order given, and a newer term
    refuses the whole batch."""
    make = EventMaker()
    async with opened(options) as old, opened(options) as new:
        leader = fenced(old, Lease(), term=1)
        await leader.begin_term(make(LeaderTermBegan(controller_id="c1", term=1)))
        await leader.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
        head = await old.head()
        beats = [
            ("heartbeat/a", [make(NodeHeartbeat(node_id="a", seq=0))], ANY),
            ("node/a", [make(note("a", 1)), make(note("a", 2))], 1),
            ("heartbeat/b", [make(NodeHeartbeat(node_id="b", seq=0))], NO_STREAM),
        ]
        assert await leader.append_many(beats) == [
            [head + 1],
            [head + 2, head + 3],
            [head + 4],
        ]
        assert [e.version for e in await old.read_stream("node/a")] == [1, 2, 3]
        again = [(s, [make(NodeHeartbeat(node_id=s[-1], seq=1))], ANY) for s, _, _ in beats[::2]]
        assert await leader.append_many(again) == [[head + 5], [head + 6]]
        assert [e.version for e in await old.read_stream("heartbeat/b")] == [1, 2]
        # A stream named twice cannot share a batch: each append goes alone, in order.
        twice = [
            ("node/a", [make(note("a", 3))], 3),
            ("node/a", [make(note("a", 4))], 4),
        ]
        assert await leader.append_many(twice) == [[head + 7], [head + 8]]
        await fenced(new, Lease(), term=2).begin_term(
            make(LeaderTermBegan(controller_id="c2", term=2))
        )
        head = await new.head()
        outcomes = await leader.append_many(
            [(s, [make(NodeHeartbeat(node_id=s[-1], seq=2))], ANY) for s, _, _ in beats[::2]]
        )
        assert all(isinstance(o, Deposed) for o in outcomes)
        assert await new.head() == head


async def test_fenced_appends_made_while_one_is_in_flight_go_as_one_batch(
    options: JetStreamOptions,
) -> None:
    """While a fenced publish awaits its answer, the appends made meanwhile wait and then go
    together (a group commit, events/jetstream_store/commits.py); one cancelled while it
    waits is taken out and writes nothing."""
    make = EventMaker()
    async with opened(options) as store:
        leader = fenced(store, Lease(), term=1)
        await leader.begin_term(make(LeaderTermBegan(controller_id="c1", term=1)))
        head = await store.head()
        answered = asyncio.Event()
        real_acked = store._api.acked

        async def held(sent: Any) -> Any:
            await answered.wait()
            return await real_acked(sent)

        store._api.acked = held  # type: ignore[method-assign]
        first = asyncio.ensure_future(
            leader.append("node/a", [make(NodeRegistered(node_id="a"))], NO_STREAM)
        )
        await asyncio.sleep(0.05)  # sent; its answer held back
        waiting = [
            asyncio.ensure_future(
                leader.append(f"node/{n}", [make(NodeRegistered(node_id=n))], NO_STREAM)
            )
            for n in "bcd"
        ]
        await asyncio.sleep(0.05)
        waiting[1].cancel()  # node/c: queued, not sent
        answered.set()
        assert await first == [head + 1]
        assert await waiting[0] == [head + 2]
        assert await waiting[2] == [head + 3]
        with pytest.raises(asyncio.CancelledError):
            await waiting[1]
        assert store._writer._commits.batches_sent == 1  # b and d, together
        assert await store.read_stream("node/c") == []
        assert await store.head() == head + 3
