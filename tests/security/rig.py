"""An in-process gateway on the in-memory bus with one upstream, and raw-socket helpers: what
the HTTP fuzz and limit tests share (loopback only)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import msgspec

from gateway.auth import KeyRing
from gateway.server import Gateway
from sim.bus import MemoryBus
from tests.integration.gateway_kit import RoutingSource, Upstream, route, running_gateway

CHAT = b'{"model": "llama", "messages": [{"role": "user", "content": "hi"}]}'


@dataclass(frozen=True)
class Rig:
    gateway: Gateway
    host: str
    port: int

    async def open(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection(self.host, self.port)

    async def exchange(self, data: bytes, *, within: float = 10.0) -> bytes:
        """Send `data`, read until the gateway closes. No half-close: the gateway takes a
        client's EOF for a client gone."""
        reader, writer = await self.open()
        try:
            writer.write(data)
            await writer.drain()
            async with asyncio.timeout(within):
                return await reader.read()
        finally:
            writer.close()

    async def chat(self) -> int:
        """A well-formed request on its own connection: the gateway's status for it."""
        answer = await self.exchange(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(CHAT), CHAT)
        )
        return status_of(answer)


@contextlib.asynccontextmanager
async def memory_gateway(keys: KeyRing | None = None, **config: Any) -> AsyncIterator[Rig]:
    bus = MemoryBus()
    upstream = await Upstream("llama-0").start()
    try:
        async with RoutingSource(bus) as source:
            await source.publish({"llama": [route(upstream.name, upstream.address)]})
            async with running_gateway(bus, keys=keys, **config) as gateway:
                url = urlsplit(gateway.url)
                assert url.hostname == "127.0.0.1" and url.port
                yield Rig(gateway, url.hostname, url.port)
    finally:
        await upstream.stop()


def status_of(answer: bytes) -> int:
    """The status of the first final answer (after any 100 Continue), 0 for none."""
    while answer.startswith(b"HTTP/1.1 100"):
        answer = answer.partition(b"\r\n\r\n")[2]
    parts = answer.split(b" ", 2)
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def error_message(answer: bytes) -> str:
    """The one-line message of a JSON error answer; fails the test for any other shape."""
    while answer.startswith(b"HTTP/1.1 100"):  # an interim answer to Expect: 100-continue
        answer = answer.partition(b"\r\n\r\n")[2]
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), answer[:400]
    error = msgspec.json.decode(body)["error"]
    message = error["message"]
    assert isinstance(message, str) and message, answer[:400]
    assert "\n" not in message and len(message) <= 400, message
    return message
