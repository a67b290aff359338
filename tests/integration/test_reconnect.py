"""A server restart (same port, same store) is survived without the caller doing anything."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest
import structlog

from runtime.env import RequestTimeout
from wire.nats_bus import NatsBus
from wire.nats_server import EmbeddedNats

from .helpers import reconnected

pytestmark = pytest.mark.integration

Connect = Callable[[str], Awaitable[NatsBus]]


async def test_subscription_and_callback_survive_a_server_restart(
    nats_server: EmbeddedNats, bus: NatsBus, connect: Connect
) -> None:
    publisher = await connect("publisher")
    sub = await bus.subscribe("restart.*")
    back = await reconnected(bus)
    publisher_back = await reconnected(publisher)
    calls: list[str] = []
    reregistered = asyncio.Event()

    async def failing_callback() -> None:
        calls.append("failing")
        raise RuntimeError("a broken callback must not stop the others")

    async def reregister() -> None:
        calls.append("reregister")
        reregistered.set()

    bus.add_reconnect_callback(failing_callback)
    bus.add_reconnect_callback(reregister)

    await publisher.publish("restart.before", b"1")
    assert (await sub.next_msg(timeout=5)).subject == "restart.before"

    with structlog.testing.capture_logs() as logs:
        await nats_server.stop()
        await nats_server.start()
        async with asyncio.timeout(10):
            await back.wait()
            await publisher_back.wait()
            await reregistered.wait()  # the callbacks run in the bus's own task, in order

    assert bus.is_connected and bus.reconnects == 1 and bus.disconnects == 1
    assert calls == ["failing", "reregister"]
    events = [entry["event"] for entry in logs]
    assert "nats_disconnected" in events
    assert "nats_reconnected" in events
    assert "nats_reconnect_callback_failed" in events

    # The subscription was replayed on the new connection: no resubscribe by the caller.
    await publisher.publish("restart.after", b"2")
    msg = await sub.next_msg(timeout=5)
    assert (msg.subject, msg.data) == ("restart.after", b"2")


async def test_requests_fail_cleanly_while_the_server_is_down(
    nats_server: EmbeddedNats, bus: NatsBus
) -> None:
    back = await reconnected(bus)
    await nats_server.stop()
    with pytest.raises(RequestTimeout):
        await bus.request("svc.any", b"", timeout=0.3)
    await nats_server.start()
    await asyncio.wait_for(back.wait(), 10)
    sub = await bus.subscribe("svc.any")
    await bus.flush()

    async def answer() -> None:
        msg = await sub.next_msg(timeout=5)
        await bus.publish(msg.reply, b"ok")

    async with asyncio.TaskGroup() as tg:
        tg.create_task(answer())
        assert (await bus.request("svc.any", b"", timeout=5)).data == b"ok"
