"""Slow clients cannot hold the gateway: a request head or body that trickles in is cut off,
and everyone else is served meanwhile (real sockets on loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest

from gateway.server import Gateway
from tests.integration.gateway_kit import RoutingSource, Upstream, route, running_gateway
from wire.nats_bus import NatsBus

pytestmark = pytest.mark.integration

CHAT = b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}]}'


@pytest.fixture
async def gateway(bus: NatsBus) -> AsyncIterator[Gateway]:
    upstream = await Upstream("llama-0").start()
    try:
        async with RoutingSource(bus) as source:
            await source.publish({"llama": [route(upstream.name, upstream.address)]})
            async with running_gateway(bus, header_timeout_s=0.5, request_body_timeout_s=0.5) as gw:
                yield gw
    finally:
        await upstream.stop()


async def _open(gw: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    url = urlsplit(gw.url)
    assert url.hostname == "127.0.0.1" and url.port
    return await asyncio.open_connection(url.hostname, url.port)


async def _served(gw: Gateway) -> int:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{gw.url}/v1/chat/completions", data=CHAT) as resp,
    ):
        await resp.read()
        return resp.status


async def test_a_request_head_that_never_ends_is_cut_off(gateway: Gateway) -> None:
    reader, writer = await _open(gateway)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        await writer.drain()
        # Meanwhile a normal client is served.
        assert await _served(gateway) == 200
        async with asyncio.timeout(5):  # the limit is 0.5 s
            assert await reader.read() == b""  # closed by the gateway
    finally:
        writer.close()


async def test_a_connection_that_sends_nothing_is_closed(gateway: Gateway) -> None:
    reader, writer = await _open(gateway)
    try:
        async with asyncio.timeout(5):
            assert await reader.read() == b""
    finally:
        writer.close()


async def test_a_body_that_trickles_gets_408_and_a_closed_connection(gateway: Gateway) -> None:
    reader, writer = await _open(gateway)
    try:
        writer.write(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n" + CHAT[:10]
        )
        await writer.drain()
        assert await _served(gateway) == 200
        async with asyncio.timeout(5):  # 0.5 s for the body, 2 s of lingering
            answer = await reader.read()  # the whole answer, then EOF
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408"), answer[:200]
        assert b'"request_timeout"' in body
    finally:
        writer.close()
