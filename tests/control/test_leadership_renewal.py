"""A leader's renewals through a NATS blip (actors/leadership.py): an attempt that gets no
answer in time is sent again rather than waited on to the deadline, and when the lost attempt
turns out to have been stored (the next one finds the key moved on), the leader checks that the
key holds its own record and goes on; another controller's record ends the term."""

from __future__ import annotations

import asyncio

import msgspec

from actors.leadership import LeaderRecord, Leadership, LeaseLost, LeaseTiming
from runtime.real_env import LoopClock

TIMING = LeaseTiming(ttl_s=1.5, renew_s=0.2, poll_s=0.05, acts_s=0.9)


class SlowOnce:
    """A key whose second write is stored at once but answered only after 0.4 s."""

    def __init__(self, *, foreign: bool = False) -> None:
        self.revision = 0
        self.value = b""
        self.writes = 0
        self.foreign = foreign

    async def create(self, value: bytes, ttl_s: float) -> int:
        self.revision, self.value = 1, value
        return 1

    async def renew(self, value: bytes, revision: int, ttl_s: float) -> int:
        if revision != self.revision:
            raise LeaseLost(f"the lease is no longer at revision {revision}")
        self.writes += 1
        self.revision += 1
        self.value = value
        if self.foreign and self.writes == 2:
            other = LeaderRecord(controller_id="b", since_ns=1)
            self.value = msgspec.json.encode(other)
        if self.writes == 2:
            await asyncio.sleep(0.4)  # stored, but the answer is lost in a blip
        return self.revision

    async def read(self) -> tuple[bytes, int] | None:
        return self.value, self.revision

    async def release(self, revision: int) -> None:
        return None


async def lead_for(backend: SlowOnce, seconds: float) -> Leadership:
    leadership = Leadership(backend, LoopClock(), "a", timing=TIMING)

    async def work(term: int) -> None:
        await asyncio.Event().wait()

    task = asyncio.create_task(leadership.run(work))
    await asyncio.sleep(seconds)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    return leadership


async def test_a_renewal_lost_in_a_blip_but_stored_keeps_the_term() -> None:
    backend = SlowOnce()
    leadership = await lead_for(backend, 1.5)
    assert leadership.stepped_down == []
    assert leadership.terms_led == 1 and backend.writes >= 4


async def test_a_key_that_moved_to_another_record_ends_the_term() -> None:
    leadership = await lead_for(SlowOnce(foreign=True), 1.0)
    assert leadership.stepped_down[:1] == ["another controller holds the lease"]
