"""Scale from zero through a real gateway and a real nats-server: a request for a cluster that
starts from zero replicas is held, the gateway says so on `gpumesh.v1.gateway.load` at once
(the autoscaler's cold-start signal), and the request is answered when a replica is routed.
A RoutingSource stands in for the controller."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest

from events.contract import subjects
from events.contract.messages import GatewayLoad
from tests.integration.gateway_kit import RoutingSource, Upstream, route, running_gateway
from wire.nats_bus import NatsBus, NatsSubscription

pytestmark = pytest.mark.integration

CHAT = {"model": "llama", "messages": [{"role": "user", "content": "wake up"}]}
_LOAD = msgspec.json.Decoder(GatewayLoad)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def held_report(sub: NatsSubscription, held: int, *, within: float = 10.0) -> GatewayLoad:
    """The first report that says the gateway holds `held` requests of llama (a cluster it
    leaves out holds none); the reports before it are skipped."""
    async with asyncio.timeout(within):
        while True:
            report = _LOAD.decode((await sub.next_msg(within)).data)
            llama = report.clusters.get("llama")
            if (llama.held if llama is not None else 0) == held:
                return report


async def test_a_request_held_at_zero_is_reported_and_answered_once_a_replica_is_routed(
    bus: NatsBus, http: aiohttp.ClientSession
) -> None:
    upstream = await Upstream("llama-0").start()
    loads = await bus.subscribe(subjects.LOAD)
    cold = {"llama": 30.0}
    try:
        async with RoutingSource(bus) as source:
            # Before the gateway starts: the table it asks for (routing.get) names the cold
            # start, and it listens only once a table is in.
            await source.publish({}, "llama", cold_start=cold)
            async with running_gateway(bus) as gw:
                waiting = asyncio.ensure_future(
                    http.post(f"{gw.url}/v1/chat/completions", json=CHAT)
                )
                report = await held_report(loads, 1)
                assert report.gateway_id == "gw-test"
                assert report.clusters["llama"].in_flight == 0
                assert not waiting.done()

                routes = {"llama": [route("llama-0", upstream.address)]}
                await source.publish(routes, "llama", cold_start=cold)
                async with await asyncio.wait_for(waiting, 10) as resp:
                    assert resp.status == 200
                    assert resp.headers["X-Upstream"] == "llama-0"
                    assert (await resp.json())["choices"][0]["message"]["content"] == "wake up"

                # Answered in full: a later report has nothing of llama, held or in flight.
                async with asyncio.timeout(10):
                    while "llama" in _LOAD.decode((await loads.next_msg(10)).data).clusters:
                        pass
                async with http.get(f"{gw.url}/metrics") as metrics:
                    text = await metrics.text()
                assert 'gpumesh_gateway_cold_start_seconds_count{cluster="llama"} 1.0' in text
                assert 'gpumesh_gateway_held_requests{cluster="llama"} 0.0' in text
    finally:
        await loads.unsubscribe()
        await upstream.stop()


async def test_past_max_held_a_request_is_refused_at_once_and_past_the_time_held_too(
    bus: NatsBus, http: aiohttp.ClientSession
) -> None:
    loads = await bus.subscribe(subjects.LOAD)
    try:
        async with RoutingSource(bus) as source:
            await source.publish({}, "llama", cold_start={"llama": 2.0})
            async with running_gateway(bus, max_held=1) as gw:
                url = f"{gw.url}/v1/chat/completions"
                first = asyncio.ensure_future(http.post(url, json=CHAT))
                await held_report(loads, 1)
                async with http.post(url, json=CHAT) as resp:
                    assert resp.status == 503
                    assert 1 <= int(resp.headers["Retry-After"]) <= 5
                    error = (await resp.json())["error"]
                assert error["code"] == "hold_full"
                assert error["message"] == (
                    "cluster 'llama' is starting from zero replicas and already holds 1 "
                    "requests (gateway --max-held)"
                )
                assert not first.done()  # still held: the refusal did not wait for it

                async with await asyncio.wait_for(first, 10) as resp:
                    assert resp.status == 503
                    assert 1 <= int(resp.headers["Retry-After"]) <= 5
                    error = (await resp.json())["error"]
                assert error["code"] == "cold_start_timeout"
                assert error["message"] == (
                    "no replica of cluster 'llama' became ready within 2 s "
                    "(autoscale.cold_start_timeout_s)"
                )
    finally:
        await loads.unsubscribe()
