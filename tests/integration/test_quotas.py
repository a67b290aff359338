"""Tenant quotas through real gateways on a real nats-server: a token budget counted from the
usage the upstream reports, and one tenant's rate limit held across two gateways (issue 22,
part 4)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.auth import KeyRing
from gateway.server import Gateway, GatewayConfig
from tests.integration.gateway_kit import RoutingSource, Upstream, route, running_gateway, until
from wire.nats_bus import NatsBus

pytestmark = pytest.mark.integration

ACME = {"Authorization": "Bearer gm-acme"}
CHAT = {"model": "llama", "messages": [{"role": "user", "content": "one two three four"}]}


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = await Upstream("u0").start()
    try:
        yield up
    finally:
        await up.stop()


def keys(tmp_path: Path, tenant: str) -> KeyRing:
    path = tmp_path / "keys.toml"
    path.write_text(f'[tenants.acme]\nkeys = ["gm-acme"]\n{tenant}\n')
    return KeyRing.load(path)


async def test_a_token_budget_refuses_once_spent_and_counts_streams_too(
    bus: NatsBus, upstream: Upstream, tmp_path: Path
) -> None:
    # The upstream reports 2 tokens a plain answer; a stream of 4 words is 5 events, no usage.
    ring = keys(tmp_path, "rate_per_s = 0\ntokens_per_min = 60\ntoken_burst = 9")
    async with (
        RoutingSource(bus) as source,
        running_gateway(bus, keys=ring) as gw,
        aiohttp.ClientSession() as http,
    ):
        await source.publish({"llama": [route("u0", upstream.address)]})
        await until(lambda: len(gw.router.routes("llama")) == 1)
        url = f"{gw.url}/v1/chat/completions"
        async with http.post(url, json={**CHAT, "stream": True}, headers=ACME) as resp:
            assert resp.status == 200
            await resp.read()
        served = 0
        while True:
            async with http.post(url, json=CHAT, headers=ACME) as resp:
                if resp.status == 429:
                    body = await resp.json()
                    retry_after = int(resp.headers["Retry-After"])
                    break
                assert resp.status == 200
                await resp.read()
                served += 1
        # 9 tokens: the stream's 5, then 2 a request: two more (9 - 5 - 4 = 0), and the
        # balance never went below zero by more than one request's tokens.
        assert served == 2
        assert body["error"]["code"] == "tokens_exhausted"
        assert "token budget of tenant 'acme' exceeded" in body["error"]["message"]
        assert retry_after >= 1  # at 1 token a second


async def test_two_gateways_hold_one_tenants_rate_between_them(
    nats_server: Any,
    connect: Callable[[str], Any],
    upstream: Upstream,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    rate, burst, seconds = 10.0, 4.0, 4.0
    ring_a = keys(tmp_path, f"rate_per_s = {rate}\nburst = {burst}")
    ring_b = KeyRing.load(ring_a.path)
    bus_a, bus_b = await connect("gw-a"), await connect("gw-b")
    async with (
        RoutingSource(bus_a) as source,
        running_gateway(bus_a, GatewayConfig(gateway_id="gw-a", port=0), ring_a) as gw_a,
        running_gateway(bus_b, GatewayConfig(gateway_id="gw-b", port=0), ring_b) as gw_b,
        aiohttp.ClientSession() as http,
    ):
        await source.publish({"llama": [route("u0", upstream.address)]})

        def settled(gw: Gateway) -> bool:
            # Each hears the other, and holds half of the tenant's limits (both idle).
            quota = gw.keys.quotas.get("acme")
            return gw.quotas.peers != [] and quota is not None and quota.share == 0.5

        await until(lambda: settled(gw_a) and settled(gw_b), within=10.0)
        outcomes: dict[int, int] = {}
        retry_afters: list[str] = []
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds

        async def client(gw: Gateway) -> None:
            while loop.time() < end:
                async with http.post(
                    f"{gw.url}/v1/chat/completions", json=CHAT, headers=ACME
                ) as resp:
                    await resp.read()
                    outcomes[resp.status] = outcomes.get(resp.status, 0) + 1
                    if resp.status == 429:
                        retry_afters.append(resp.headers.get("Retry-After", ""))
                        await asyncio.sleep(0.01)

        started = loop.time()
        async with asyncio.TaskGroup() as tasks:
            for gw in (gw_a, gw_b, gw_a, gw_b):
                tasks.create_task(client(gw))
        elapsed = loop.time() - started
    served = outcomes.get(200, 0)
    with capsys.disabled():
        print(
            f"\ntwo gateways, one tenant at {rate:g}/s, burst {burst:g}: {served} served in "
            f"{elapsed:.2f} s (at most {rate * elapsed + burst:.1f}), {outcomes.get(429, 0)} "
            "refused with 429"
        )
    # At most the limit plus one burst, whichever gateway the requests went to.
    assert served <= rate * elapsed + burst, (served, elapsed, outcomes)
    # And not much less: the two shares add up to the whole limit.
    assert served >= 0.7 * rate * seconds, (served, outcomes)
    assert outcomes.get(429, 0) > 0 and all(int(r) >= 1 for r in retry_afters)
    assert set(outcomes) <= {200, 429}
