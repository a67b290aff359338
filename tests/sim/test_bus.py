from __future__ import annotations

import asyncio

import pytest

from events import ClusterSpec
from events.contract.messages import StartReplica, StopReplica
from runtime.env import Msg, NoResponders, RequestTimeout
from sim.bus import Inbox, MemoryBus, subject_matches
from sim.commands import MemoryCommandQueue


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        ("a.b.c", "a.b.c", True),
        ("a.*.c", "a.b.c", True),
        ("a.*", "a.b.c", False),
        ("a.>", "a.b.c", True),
        ("a.>", "a", False),
        ("a.b.c", "a.b", False),
        ("*.b.>", "x.b.c.d", True),
        ("gpumesh.v1.node.*.heartbeat", "gpumesh.v1.node.n1.heartbeat", True),
        ("gpumesh.v1.node.*.heartbeat", "gpumesh.v1.node.n1.report", False),
    ],
)
def test_subject_matching(pattern: str, subject: str, expected: bool) -> None:
    assert subject_matches(pattern, subject) is expected


async def test_fan_out_and_queue_groups() -> None:
    bus = MemoryBus()
    plain = await bus.subscribe("jobs.>")
    workers = [await bus.subscribe("jobs.*", queue="w") for _ in range(2)]
    for i in range(4):
        await bus.publish(f"jobs.{i}", b"x")
    assert [(await plain.next_msg(1)).subject for _ in range(4)] == [f"jobs.{i}" for i in range(4)]
    got = [[(await w.next_msg(1)).subject for _ in range(2)] for w in workers]
    assert got == [["jobs.0", "jobs.2"], ["jobs.1", "jobs.3"]]


async def test_request_reply_no_responders_and_timeout() -> None:
    bus = MemoryBus()
    with pytest.raises(NoResponders):
        await bus.request("svc.echo", b"hi", timeout=1)
    sub = await bus.subscribe("svc.echo")

    async def serve() -> None:
        async for msg in sub:
            await bus.publish(msg.reply, msg.data.upper())

    silent = await bus.subscribe("svc.silent")
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(serve())
        reply = await bus.request("svc.echo", b"hi", timeout=1)
        assert reply == Msg(subject=reply.subject, data=b"HI")
        with pytest.raises(RequestTimeout):
            await bus.request("svc.silent", b"?", timeout=0.01)
        await sub.unsubscribe()
        await silent.unsubscribe()
    assert task.done()


async def test_command_queue_is_durable_and_deduplicated() -> None:
    queue = MemoryCommandQueue()
    spec = ClusterSpec(name="llama")
    start = StartReplica(command_id="c1", replica_id="llama-0", epoch=1, spec=spec)
    await queue.send("n1", start)
    await queue.send("n1", start)  # retried send
    await queue.send("n1", StopReplica(command_id="c2", replica_id="llama-0", epoch=1))
    consumer = queue.consume("n1")
    first = await anext(consumer)
    assert first.command == start
    await first.ack()
    second = await anext(consumer)
    assert second.command.command_id == "c2"
    # The agent crashes before acking c2: a new consumer gets it again, not c1.
    again = await anext(queue.consume("n1"))
    assert again.command.command_id == "c2"
    await again.ack()
    assert queue.pending("n1") == []


def test_an_inbox_hands_items_in_order_and_a_cancelled_getter_passes_its_wake_up_on() -> None:
    """Inbox keeps asyncio.Queue's semantics: FIFO, waiting getters served in order, and a
    getter cancelled after an item woke it leaves the item to the next getter."""

    async def main() -> None:
        inbox: Inbox[int] = Inbox()
        inbox.put_nowait(1)
        inbox.put_nowait(2)
        assert inbox.qsize() == 2 and await inbox.get() == 1 and inbox.get_nowait() == 2
        assert inbox.empty()
        with pytest.raises(asyncio.QueueEmpty):
            inbox.get_nowait()
        first = asyncio.ensure_future(inbox.get())
        second = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0)  # both wait now
        inbox.put_nowait(3)  # wakes the first...
        first.cancel()  # ...which is cancelled before it runs
        assert await asyncio.wait_for(second, 1) == 3
        assert first.cancelled()
        third = asyncio.ensure_future(inbox.get())
        await asyncio.sleep(0)
        inbox.put_nowait(4)
        inbox.put_nowait(5)
        assert await third == 4 and inbox.get_nowait() == 5

    asyncio.run(main())
