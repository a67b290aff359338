"""Small shared helpers for the integration tests."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from wire.nats_bus import NatsBus, NatsSubscription


async def collect(sub: NatsSubscription, count: int, timeout: float = 10.0) -> list[Any]:
    """Exactly `count` messages from `sub`, or TimeoutError."""
    async with asyncio.timeout(timeout):
        return [await sub.next_msg(timeout) for _ in range(count)]


async def wait_until(
    condition: Callable[[], Awaitable[bool]], timeout: float = 10.0, interval: float = 0.02
) -> None:
    """For a counter that announces nothing (how often the outbox backed off): ask until it
    holds. Everything that can be awaited is awaited instead."""
    async with asyncio.timeout(timeout):
        while not await condition():  # noqa: ASYNC110 - nothing to await: a plain counter
            await asyncio.sleep(interval)


async def stream_messages(js: JetStreamContext, stream: str) -> list[Any]:
    """Every message of a stream, in sequence order, through a throwaway pull consumer."""
    info = await js.stream_info(stream)
    total = int(info.state.messages)
    if total == 0:
        return []
    config = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL)
    pull = await js.pull_subscribe(">", stream=stream, config=config)
    try:
        got: list[Any] = []
        while len(got) < total:
            got += await pull.fetch(min(total - len(got), 1000), timeout=5)
        return got
    finally:
        await pull.unsubscribe()


async def reconnected(bus: NatsBus) -> asyncio.Event:
    """An event set by the bus's next reconnect."""
    event = asyncio.Event()

    async def on_reconnect() -> None:
        event.set()

    bus.add_reconnect_callback(on_reconnect)
    return event
