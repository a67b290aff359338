"""A cancel that nats-py (or asyncio.wait_for on Python 3.11) swallows is raised again: a loop
of requests ends when its task is cancelled."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from wire.nats_bus import NatsBus, cancellation_kept


class SwallowingClient:
    """A nats-py client whose request answers even when cancelled, as wait_for does on 3.11
    when the reply lands in the cancel's turn."""

    is_connected = True

    def __init__(self) -> None:
        self.requests = 0
        self.swallowed = 0
        self.third = asyncio.Event()

    async def request(self, subject: str, data: bytes, **kwargs: Any) -> SimpleNamespace:
        self.requests += 1
        if self.requests == 3:
            self.third.set()
        try:
            await asyncio.sleep(0.01)
        except asyncio.CancelledError:
            if self.swallowed:
                raise  # only the first: a test that fails still ends
            self.swallowed += 1  # the cancel is lost here
        return SimpleNamespace(subject=subject, data=b"{}", reply="", headers=None)


async def test_a_loop_of_requests_ends_when_cancelled() -> None:
    client = SwallowingClient()
    bus = NatsBus(cast(Any, client), "nats://127.0.0.1:4222", "test")

    async def poll() -> None:
        while True:
            await bus.request("gpumesh.v1.api.events.list", b"{}", timeout=1.0)

    task = asyncio.create_task(poll())
    await client.third.wait()
    task.cancel()
    done, _ = await asyncio.wait([task], timeout=1.0)
    if not done:
        task.cancel()
        await asyncio.wait([task])
    assert done, "the loop went on after its cancel"
    assert client.swallowed == 1 and task.cancelled()


async def test_without_a_cancel_nothing_is_raised() -> None:
    with cancellation_kept():
        await asyncio.sleep(0)


async def test_inside_a_timeout_the_lost_cancel_is_its_timeout_error() -> None:
    client = SwallowingClient()
    bus = NatsBus(cast(Any, client), "nats://127.0.0.1:4222", "test")
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0.005):
            await bus.request("s", b"", timeout=1.0)
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0  # nothing left pending
