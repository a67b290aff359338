"""NatsBus against the real server: the same semantics as sim/bus.py's MemoryBus."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable

import pytest

from runtime.env import BusError, Msg, NoResponders, RequestTimeout, Subscription
from sim.bus import MemoryBus, MemorySubscription
from wire.nats_bus import NatsBus, NatsSubscription

from .helpers import collect

pytestmark = pytest.mark.integration

Connect = Callable[[str], Awaitable[NatsBus]]


async def test_wildcards(bus: NatsBus) -> None:
    one = await bus.subscribe("fleet.*.hb")
    tail = await bus.subscribe("fleet.>")
    exact = await bus.subscribe("fleet.n1.hb")
    for subject in ("fleet.n1.hb", "fleet.n2.hb", "fleet.n1.report", "fleet.n1.hb.extra", "fleet"):
        await bus.publish(subject, subject.encode())
    await bus.flush()
    assert [m.subject for m in await collect(one, one.pending)] == ["fleet.n1.hb", "fleet.n2.hb"]
    assert [m.subject for m in await collect(tail, tail.pending)] == [
        "fleet.n1.hb", "fleet.n2.hb", "fleet.n1.report", "fleet.n1.hb.extra",
    ]  # fmt: skip
    assert [m.subject for m in await collect(exact, exact.pending)] == ["fleet.n1.hb"]


async def test_queue_group_delivers_each_message_to_exactly_one_member(
    bus: NatsBus, connect: Connect
) -> None:
    # Members on separate connections, as separate controller processes would be.
    workers = [await connect(f"worker-{i}") for i in range(3)]
    members = [await w.subscribe("jobs.*", queue="w") for w in workers]
    watcher = await bus.subscribe("jobs.*")
    for worker in workers:
        await worker.flush()  # the server has their subscriptions before anything is published
    for i in range(60):
        await bus.publish(f"jobs.{i}", b"")
    everything = await collect(watcher, 60)  # so the server has routed all 60
    got: Counter[str] = Counter()
    for worker, member in zip(workers, members, strict=True):
        await worker.flush()  # and this worker has received whatever was routed to it
        got.update(m.subject for m in await collect(member, member.pending))
    assert got == Counter(m.subject for m in everything)
    assert set(got.values()) == {1}
    assert all(member.pending == 0 for member in members)


async def test_request_reply_no_responders_and_timeout(bus: NatsBus, connect: Connect) -> None:
    server = await connect("echo-server")
    echo = await server.subscribe("svc.echo")
    silent = await server.subscribe("svc.silent")

    async def serve() -> None:
        async for msg in echo:
            await server.publish(msg.reply, msg.data.upper(), headers={"Echo": "yes"})

    async with asyncio.TaskGroup() as tg:
        tg.create_task(serve())
        await server.flush()
        reply = await bus.request("svc.echo", b"hi", timeout=5)
        assert (reply.data, reply.headers) == (b"HI", {"Echo": "yes"})
        with pytest.raises(NoResponders) as no_one:
            await bus.request("svc.nobody", b"?", timeout=5)
        assert no_one.value.subject == "svc.nobody"
        with pytest.raises(RequestTimeout) as late:
            await bus.request("svc.silent", b"?", timeout=0.2)
        assert isinstance(late.value, TimeoutError)
        assert (late.value.subject, late.value.timeout) == ("svc.silent", 0.2)
        await echo.unsubscribe()  # ends serve()'s iteration, so the group can finish
    ignored = await silent.next_msg(timeout=5)  # it got the request and never answered
    assert ignored.subject == "svc.silent" and ignored.reply


async def test_headers_and_reply_subject_travel(bus: NatsBus) -> None:
    sub = await bus.subscribe("h.x")
    await bus.publish("h.x", b"1", reply="r.1", headers={"Nats-Msg-Id": "abc", "K": "v"})
    msg = await sub.next_msg(timeout=5)
    assert msg == Msg(
        subject="h.x", data=b"1", reply="r.1", headers={"Nats-Msg-Id": "abc", "K": "v"}
    )


async def test_unsubscribe_and_close_end_iteration(bus: NatsBus) -> None:
    sub = await bus.subscribe("it.x")
    await bus.publish("it.x", b"1")
    await bus.flush()

    async def drain(s: NatsSubscription) -> list[bytes]:
        return [m.data async for m in s]

    async with asyncio.timeout(5), asyncio.TaskGroup() as tg:
        reader = tg.create_task(drain(sub))
        await sub.unsubscribe()
        assert await reader == [b"1"]  # what had arrived is still delivered, then the end
        await sub.unsubscribe()  # idempotent
        with pytest.raises(BusError):
            await sub.next_msg(timeout=1)

        other = await bus.subscribe("it.y")
        reader = tg.create_task(drain(other))
        await bus.close()
        assert await reader == []
    await bus.close()  # idempotent
    with pytest.raises(BusError):
        await bus.publish("it.x", b"late")


# -- the same script through MemoryBus and NatsBus ---------------------------------------

SUBSCRIPTIONS: list[tuple[str, str]] = [
    ("gpumesh.v1.node.*.heartbeat", ""),
    ("gpumesh.v1.node.*.heartbeat", "controller"),
    ("gpumesh.v1.node.*.heartbeat", "controller"),
    ("gpumesh.v1.node.*.register", "controller"),
    ("gpumesh.v1.node.>", ""),
    ("gpumesh.v1.node.n1.*", ""),
    ("gpumesh.v1.events.>", "audit"),
    ("gpumesh.v1.events.>", "audit"),
    ("gpumesh.v1.events.>", "audit"),
    ("gpumesh.v1.events.node.*", ""),
    ("gpumesh.v1.routing", ""),
    ("gpumesh.*", ""),
    (">", ""),
]
PUBLISHES = [
    "gpumesh.v1.node.n1.heartbeat",
    "gpumesh.v1.node.n2.heartbeat",
    "gpumesh.v1.node.n1.register",
    "gpumesh.v1.node.n3.report",
    "gpumesh.v1.node.n1.heartbeat.extra",
    "gpumesh.v1.events.node.n1",
    "gpumesh.v1.events.cluster.llama",
    "gpumesh.v1.events.replica.r-1",
    "gpumesh.v1.routing",
    "gpumesh.v1",
    "gpumesh",
    "other.subject",
] * 3


async def run_script(bus: MemoryBus | NatsBus) -> list[Counter[str]]:
    subs = [await bus.subscribe(subject, queue=queue) for subject, queue in SUBSCRIPTIONS]
    for i, subject in enumerate(PUBLISHES):
        await bus.publish(subject, str(i).encode())
    if isinstance(bus, NatsBus):
        await bus.flush()  # the server has routed every publish back to this connection
    received = []
    for sub in subs:
        assert isinstance(sub, MemorySubscription | NatsSubscription)
        msgs = [await sub.next_msg(5) for _ in range(_pending(sub))]
        received.append(Counter(m.subject for m in msgs))
    return received


def by_group(received: list[Counter[str]]) -> dict[tuple[str, str], Counter[str]]:
    """Plain subscriptions by index; queue-group members summed per group."""
    out: dict[tuple[str, str], Counter[str]] = {}
    for i, ((subject, queue), got) in enumerate(zip(SUBSCRIPTIONS, received, strict=True)):
        key = (subject, queue) if queue else (subject, f"#{i}")
        out.setdefault(key, Counter()).update(got)
    return out


async def test_memory_bus_and_nats_bus_deliver_the_same(bus: NatsBus) -> None:
    memory = await run_script(MemoryBus())
    real = await run_script(bus)
    assert by_group(real) == by_group(memory)
    # Queue groups: every matching publish went to exactly one member of each group.
    for (subject, queue), got in by_group(real).items():
        if not queue.startswith("#"):
            assert set(got.values()) <= {3}, (subject, queue, got)
    assert sum(by_group(real)[(">", "#12")].values()) == len(PUBLISHES)


async def test_one_queue_name_on_two_patterns_is_one_group(bus: NatsBus) -> None:
    async def deliveries(b: MemoryBus | NatsBus) -> int:
        subs = [await b.subscribe("q.*", queue="g"), await b.subscribe("q.>", queue="g")]
        for i in range(10):
            await b.publish(f"q.{i}", b"")
        if isinstance(b, NatsBus):
            await b.flush()
        return sum(_pending(s) for s in subs)

    assert await deliveries(bus) == 10  # the real server: once per message
    assert await deliveries(MemoryBus()) == 10  # the simulator agrees


def _pending(sub: Subscription) -> int:
    if isinstance(sub, NatsSubscription):
        return sub.pending
    assert isinstance(sub, MemorySubscription)
    return sub._inbox.qsize()  # deliveries are synchronous in memory: all are queued already


async def _handled(b: MemoryBus | NatsBus) -> tuple[list[str], list[str]]:
    """A handler subscription: what reached the handler, in order, and what its iterator
    yielded. The handler raises on one message; the ones after it must still arrive."""
    got: list[str] = []

    def handler(msg: Msg) -> None:
        if msg.data == b"bad":
            raise ValueError("a handler that fails on one message")
        got.append(msg.data.decode())

    sub = await b.subscribe("h.*", handler=handler)
    for data in (b"1", b"bad", b"2", b"3"):
        await b.publish("h.x", data)
    if isinstance(b, NatsBus):
        await b.flush()
        await asyncio.sleep(0)  # nats-py hands a message to its callback task
        for _ in range(100):
            if len(got) == 3:
                break
            await asyncio.sleep(0.01)
    await sub.unsubscribe()
    await b.publish("h.x", b"after")
    if isinstance(b, NatsBus):
        await b.flush()
        await asyncio.sleep(0.1)  # time for a delivery after unsubscribe to show up, if any
    iterated = [m.data.decode() async for m in sub]
    return list(got), iterated


async def test_a_handler_takes_messages_in_order_and_survives_one_that_fails(bus: NatsBus) -> None:
    assert await _handled(bus) == (["1", "2", "3"], [])
    assert await _handled(MemoryBus()) == (["1", "2", "3"], [])
