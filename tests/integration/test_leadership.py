"""One controller leads at a time: the lease on a JetStream key (actors/leader_kv.py) against a
real nats-server, driven by the production Leadership (actors/leadership.py) with short
timings. A leader that cannot renew steps down at its own expiry, before the key can expire on
the server, so no two ever lead at once; a clean stop hands over at once."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator

import pytest

from actors.leader_kv import KvLease
from actors.leadership import LeaderRecord, Leadership, LeaseLost, LeaseTaken, LeaseTiming
from runtime.real_env import LoopClock
from wire.nats_bus import NatsBus

pytestmark = pytest.mark.integration

FAST = LeaseTiming(ttl_s=1.0, renew_s=0.2, poll_s=0.05, acts_s=0.6)


class Timeline:
    """When each candidate led: (name, from, to) in loop time."""

    def __init__(self) -> None:
        self.terms: list[tuple[str, int, float, float]] = []

    def lead(self, name: str) -> object:
        async def work(term: int) -> None:
            began = asyncio.get_running_loop().time()
            try:
                await asyncio.Event().wait()
            finally:
                self.terms.append((name, term, began, asyncio.get_running_loop().time()))

        return work

    def overlaps(self) -> list[tuple[str, str]]:
        ordered = sorted(self.terms, key=lambda t: t[2])
        return [(a[0], b[0]) for a, b in itertools.pairwise(ordered) if b[2] < a[3]]


class Paused:
    """A lease backend whose writes hang from `pause()` on: a leader SIGSTOPped, or cut off."""

    def __init__(self, inner: KvLease) -> None:
        self.inner = inner
        self.paused = asyncio.Event()

    def pause(self) -> None:
        self.paused.set()

    async def _gate(self) -> None:
        if self.paused.is_set():
            await asyncio.Event().wait()

    async def create(self, value: bytes, ttl_s: float) -> int:
        await self._gate()
        return await self.inner.create(value, ttl_s)

    async def renew(self, value: bytes, revision: int, ttl_s: float) -> int:
        await self._gate()
        return await self.inner.renew(value, revision, ttl_s)

    async def read(self) -> tuple[bytes, int] | None:
        return await self.inner.read()

    async def release(self, revision: int) -> None:
        await self._gate()
        await self.inner.release(revision)


@contextlib.asynccontextmanager
async def running(leadership: Leadership, work: object) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(leadership.run(work))  # type: ignore[arg-type]
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(check: object, within: float) -> float:
    loop = asyncio.get_running_loop()
    began = loop.time()
    while not check():  # type: ignore[operator]
        if loop.time() - began > within:
            raise AssertionError(f"not within {within} s")
        await asyncio.sleep(0.01)
    return loop.time() - began


async def test_the_lease_is_created_once_renewed_at_its_revision_and_released(
    bus: NatsBus,
) -> None:
    lease = KvLease(bus)
    first = await lease.create(b'{"controller_id": "a", "since_ns": 1}', 5.0)
    with pytest.raises(LeaseTaken):
        await lease.create(b'{"controller_id": "b", "since_ns": 2}', 5.0)
    second = await lease.renew(b'{"controller_id": "a", "since_ns": 1}', first, 5.0)
    assert second > first
    with pytest.raises(LeaseLost):
        await lease.renew(b"{}", first, 5.0)  # a stale revision: someone wrote since
    found = await lease.leader()
    assert found == (LeaderRecord(controller_id="a", since_ns=1), second)
    await lease.release(first)  # not the last write: nothing happens
    assert await lease.read() is not None
    await lease.release(second)
    assert await lease.read() is None
    assert await lease.create(b'{"controller_id": "b", "since_ns": 2}', 5.0) > second


async def test_the_key_expires_a_time_to_live_after_its_last_write(bus: NatsBus) -> None:
    lease = KvLease(bus)
    await lease.create(b'{"controller_id": "a", "since_ns": 1}', 1.0)
    began = time.monotonic()
    for _ in range(100):  # the server expires it on its own clock: look until it is gone
        if await lease.read() is None:
            break
        await asyncio.sleep(0.05)
    assert 0.8 <= time.monotonic() - began <= 3.0


async def test_a_clean_stop_hands_over_at_once(bus: NatsBus) -> None:
    timeline = Timeline()
    a = Leadership(KvLease(bus), LoopClock(), "a", timing=FAST)
    b = Leadership(KvLease(bus), LoopClock(), "b", timing=FAST)
    async with running(a, timeline.lead("a")) as a_task:
        await until(lambda: a.role == "leader", within=5)
        async with running(b, timeline.lead("b")):
            await asyncio.sleep(0.5)
            assert b.role == "standby"
            a_task.cancel()
            took = await until(lambda: b.role == "leader", within=5)
            assert took < FAST.ttl_s / 2  # it did not wait for the key to expire
            assert b.term > a.term
    assert timeline.overlaps() == []


async def test_a_leader_that_cannot_renew_steps_down_before_another_takes_over(
    bus: NatsBus,
) -> None:
    timeline = Timeline()
    stuck = Paused(KvLease(bus))
    a = Leadership(stuck, LoopClock(), "a", timing=FAST)
    b = Leadership(KvLease(bus), LoopClock(), "b", timing=FAST)
    async with running(a, timeline.lead("a")):
        await until(lambda: a.role == "leader", within=5)
        async with running(b, timeline.lead("b")):
            await asyncio.sleep(0.3)
            assert b.role == "standby"
            stuck.pause()
            await until(lambda: b.role == "leader", within=5)
            assert a.role == "standby"
            assert a.stepped_down == ["no renewal succeeded within 0.6 s"]
    assert timeline.overlaps() == []
    (a_term,) = [t for t in timeline.terms if t[0] == "a"]
    (b_term,) = [t for t in timeline.terms if t[0] == "b"]
    assert b_term[1] > a_term[1]  # a later term
    assert b_term[2] >= a_term[3]  # b began after a had stopped
