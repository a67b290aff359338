"""A leader's writes go through its lease (actors/fenced_store.py): once the leadership says
the lease may have lapsed, nothing more is appended or sent, the leadership is told to step
down, and reads still work. The leadership's own expiry is checked on an injected clock, so a
pause past the lease (the clock jumping) is what makes it refuse."""

from __future__ import annotations

import asyncio

import pytest

from actors.controller_process import FencedCommands
from actors.fenced_store import Deposed, FencedBus, FencedRebuildStore, fenced
from actors.leadership import Leadership, LeaseTiming
from events import MemoryEventStore
from events.envelope import NewEvent
from events.errors import EventStoreError
from events.node import NodeRegistered
from runtime.env import BusError


class Guard:
    def __init__(self) -> None:
        self.holds = True
        self.reasons: list[str] = []

    def holds_lease(self) -> bool:
        return self.holds

    def deposed(self, reason: str) -> None:
        self.reasons.append(reason)


def event(n: int) -> NewEvent:
    return NewEvent(
        event_id=f"event-{n}", payload=NodeRegistered(node_id="a", hostname="h"), recorded_at=n
    )


async def test_writes_stop_the_moment_the_lease_may_have_lapsed() -> None:
    guard = Guard()
    store = fenced(MemoryEventStore(), guard, term=7)
    assert await store.append("node/a", [event(1)], 0) == [1]
    guard.holds = False
    with pytest.raises(Deposed) as refused:
        await store.append("node/a", [event(2)], 1)
    assert isinstance(refused.value, EventStoreError)  # handled wherever an append can fail
    with pytest.raises(Deposed):
        await store.append_many([("node/a", [event(3)], 1)])
    with pytest.raises(Deposed):
        await store.compact_heartbeats(10)
    assert store.refused == 3 and len(guard.reasons) == 3 and "term 7" in guard.reasons[0]
    # Reads pass: a deposed leader may still look, and nothing was written.
    assert [e.event_id for e in await store.read_all()] == ["event-1"]
    assert await store.head() == 1


def test_the_rebuild_shortcut_survives_the_fence() -> None:
    assert isinstance(fenced(MemoryEventStore(), Guard()), FencedRebuildStore) == hasattr(
        MemoryEventStore, "read_for_rebuild"
    )


class Queue:
    def __init__(self) -> None:
        self.sent: list[str] = []

    async def send(self, node_id: str, command: object) -> None:
        self.sent.append(node_id)

    def consume(self, node_id: str) -> object:
        raise NotImplementedError


async def test_a_deposed_leader_sends_no_command() -> None:
    guard, queue = Guard(), Queue()
    commands = FencedCommands(queue, guard)  # type: ignore[arg-type]
    await commands.send("node-1", object())
    guard.holds = False
    with pytest.raises(Deposed):
        await commands.send("node-2", object())
    assert queue.sent == ["node-1"] and guard.reasons


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def wall_ns(self) -> int:
        return int(self.now * 1e9)


class Backend:
    """A lease that always renews: only the leader's own clock can end its term here."""

    async def create(self, value: bytes, ttl_s: float) -> int:
        return 1

    async def renew(self, value: bytes, revision: int, ttl_s: float) -> int:
        return revision + 1

    async def read(self) -> tuple[bytes, int] | None:
        return None

    async def release(self, revision: int) -> None:
        return None


async def test_a_leader_woken_past_its_expiry_holds_no_lease_and_steps_down() -> None:
    clock = Clock()
    leadership = Leadership(Backend(), clock, "a", timing=LeaseTiming(ttl_s=3, renew_s=1))
    working = asyncio.Event()
    seen: list[bool] = []

    async def lead(term: int) -> None:
        working.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(leadership.run(lead))
    await working.wait()
    seen.append(leadership.holds_lease())
    clock.now += 10.0  # SIGSTOP for ten seconds: the monotonic clock moved, nothing ran
    seen.append(leadership.holds_lease())
    store = fenced(MemoryEventStore(), leadership, term=leadership.term)
    with pytest.raises(Deposed):
        await store.append("node/a", [event(1)], 0)
    for _ in range(100):
        if leadership.stepped_down:
            break
        await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert seen == [True, False]
    assert leadership.stepped_down and "lease may have expired" in leadership.stepped_down[0]


class Bus:
    def __init__(self) -> None:
        self.published: list[str] = []

    async def publish(self, subject: str, data: bytes, **_: object) -> None:
        self.published.append(subject)


async def test_a_deposed_leader_publishes_nothing() -> None:
    """Not a lease in a heartbeat ack, not a routing table: the publish fails as a publish does
    (BusError), which every publisher of the controller handles."""
    guard, bus = Guard(), Bus()
    fenced_bus = FencedBus(bus, guard)  # type: ignore[arg-type]
    await fenced_bus.publish("_INBOX.ack", b"lease")
    guard.holds = False
    with pytest.raises(BusError):
        await fenced_bus.publish("_INBOX.ack", b"stale lease")
    assert bus.published == ["_INBOX.ack"] and guard.reasons
