"""A gateway listens only once it has a routing table (GatewayConfig.routes_wait_s, `gpumesh
gateway --routes-wait`): until then it would answer 503 to everything, and a load balancer
that checks TCP would already send it traffic. It waits at most that long."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.auth import KeyRing
from gateway.server import Gateway, GatewayConfig
from runtime.real_env import LoopClock
from tests.integration.gateway_kit import RoutingSource
from wire.nats_bus import NatsBus

pytestmark = pytest.mark.integration


def gateway(bus: NatsBus, wait: float) -> Gateway:
    return Gateway(
        bus,
        GatewayConfig(gateway_id="gw-wait", port=0, routes_wait_s=wait),
        KeyRing.open(),
        clock=LoopClock(),
        rng=random.Random(1),
    )


async def test_it_listens_once_the_first_table_is_in(bus: NatsBus) -> None:
    gw = gateway(bus, 30.0)
    task = asyncio.create_task(gw.run())
    try:
        await asyncio.sleep(0.5)
        assert not gw.started.is_set()  # no controller, no table: not listening
        async with RoutingSource(bus) as source:
            await source.publish({}, "echo")
            async with asyncio.timeout(10):
                await gw.started.wait()
        assert gw.feed.ready.is_set()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_it_listens_anyway_when_no_table_comes_in_time(bus: NatsBus) -> None:
    gw = gateway(bus, 0.3)
    task = asyncio.create_task(gw.run())
    try:
        async with asyncio.timeout(10):
            await gw.started.wait()
        assert not gw.feed.ready.is_set()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
