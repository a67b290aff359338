"""The direct transport's HTTP/1.1 client against raw servers on loopback: framing, keep-alive,
concurrency on pooled connections, and the failures the retry decision reads."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest

from events.contract.messages import RouteEntry
from gateway.transport.base import (
    FirstByteTimeout,
    ResetBeforeHead,
    StreamBroken,
    UpstreamRequest,
)
from gateway.transport.direct import DirectTransport

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def request(path: str = "/x", timeout: float = 5.0) -> UpstreamRequest:
    return UpstreamRequest(
        method="POST",
        path=path,
        headers=[("X-Request-Id", "r1")],
        body=b"{}",
        request_id="r1",
        first_byte_timeout=timeout,
    )


@contextlib.asynccontextmanager
async def raw_server(handler: Handler) -> AsyncIterator[tuple[RouteEntry, list[int]]]:
    """A server that reads each request head and body, then lets `handler` answer; yields the
    route and a list with one entry per connection accepted."""
    accepted: list[int] = []

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(1)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                await handler(reader, writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield (
            RouteEntry(replica_id="r", node_id="n", address=f"http://127.0.0.1:{port}", epoch=1),
            accepted,
        )
    finally:
        server.close()


async def ok(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    await asyncio.sleep(0.001)
    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\nX-A: 1\r\n\r\nhello")


async def test_concurrent_requests_share_pooled_connections_and_all_complete() -> None:
    """Many requests at once over connections that go back to the pool the moment a body is
    in: each gets its own answer (a connection's state must not leak between exchanges)."""
    transport = DirectTransport()
    async with raw_server(ok) as (route, accepted):
        try:

            async def client() -> list[bytes]:
                bodies = []
                for _ in range(30):  # back to back: each takes the connection just released
                    response = await transport.open(route, request())
                    bodies.append(await response.read())
                return bodies

            async with asyncio.timeout(10):
                results = await asyncio.gather(*(client() for _ in range(10)))
            assert results == [[b"hello"] * 30] * 10
        finally:
            await transport.close()
    assert len(accepted) <= 10  # connections were reused


async def test_chunked_and_close_delimited_bodies() -> None:
    answers = iter(
        [
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"3\r\nabc\r\n4;x=y\r\ndefg\r\n0\r\nTrailer: 1\r\n\r\n",
            b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\nuntil the end",
        ]
    )

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        data = next(answers)
        writer.write(data)
        if b"chunked" not in data:
            await writer.drain()
            writer.close()

    transport = DirectTransport()
    async with raw_server(answer) as (route, _):
        try:
            first = await transport.open(route, request())
            assert await first.read() == b"abcdefg"
            assert ("Trailer", "1") not in first.headers
            second = await transport.open(route, request())
            assert await second.read() == b"until the end"
        finally:
            await transport.close()


async def test_no_head_in_time_is_a_first_byte_timeout_and_the_connection_is_dropped() -> None:
    calls = 0

    async def slow_first(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            await asyncio.sleep(3600)
        await ok(reader, writer)

    transport = DirectTransport()
    async with raw_server(slow_first) as (route, accepted):
        try:
            with pytest.raises(FirstByteTimeout):
                await transport.open(route, request(timeout=0.2))
            # The hung connection is never reused: the next request opens another.
            response = await transport.open(route, request())
            assert await response.read() == b"hello"
        finally:
            await transport.close()
    assert len(accepted) == 2


async def test_a_reset_before_the_head_and_a_cut_body() -> None:
    async def reset(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.transport.abort()

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\npartial")
        await writer.drain()
        writer.transport.abort()

    transport = DirectTransport()
    try:
        async with raw_server(reset) as (route, _):
            with pytest.raises(ResetBeforeHead):
                await transport.open(route, request())
        async with raw_server(cut) as (route, _):
            response = await transport.open(route, request())
            with pytest.raises(StreamBroken):
                await response.read()
    finally:
        await transport.close()


async def test_a_replica_silent_mid_body_breaks_the_stream_after_the_idle_timeout() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")
        await asyncio.sleep(3600)  # power lost: no RST, no FIN, nothing

    transport = DirectTransport(idle_timeout=0.3)
    async with raw_server(silent) as (route, _):
        try:
            response = await transport.open(route, request())
            got: list[bytes] = []
            with pytest.raises(StreamBroken, match="no data"):
                async with asyncio.timeout(5):
                    async for chunk in response.chunks():
                        got.append(chunk)
            assert got == [b"hello"]
        finally:
            await transport.close()
