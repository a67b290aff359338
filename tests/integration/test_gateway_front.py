"""The gateway's front door over real sockets: what it serves itself, what it hands to aiohttp
mid-connection, keep-alive and pipelining, and back-pressure from a slow client to a replica
over the direct transport."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from urllib.parse import urlsplit

import aiohttp
import pytest
from aiohttp import web

from gateway.server import Gateway
from tests.integration.gateway_kit import RoutingSource, Upstream, route, running_gateway
from wire.nats_bus import NatsBus

pytestmark = pytest.mark.integration

CHAT = b'{"model": "llama", "messages": [{"role": "user", "content": "hi there"}]}'


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    started = await Upstream("llama-0").start()
    try:
        yield started
    finally:
        await started.stop()


@pytest.fixture
async def gateway(bus: NatsBus, upstream: Upstream) -> AsyncIterator[Gateway]:
    async with RoutingSource(bus) as source:
        await source.publish({"llama": [route(upstream.name, upstream.address)]})
        async with running_gateway(bus) as gw:
            yield gw


async def _open(gw: Gateway) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    url = urlsplit(gw.url)
    assert url.hostname and url.port
    return await asyncio.open_connection(url.hostname, url.port)


async def _answer(reader: asyncio.StreamReader) -> tuple[bytes, dict[str, str], bytes]:
    """One HTTP/1.1 answer off a raw connection: status line, headers, body (either framing)."""
    head = await reader.readuntil(b"\r\n\r\n")
    status, *lines = head.decode("latin-1").rstrip("\r\n").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    if "content-length" in headers:
        return status.encode(), headers, await reader.readexactly(int(headers["content-length"]))
    body = b""
    while True:
        size = int((await reader.readuntil(b"\r\n")).strip(), 16)
        chunk = await reader.readexactly(size + 2)
        if size == 0:
            return status.encode(), headers, body
        body += chunk[:-2]


def _post(path: bytes, body: bytes, *extra: bytes) -> bytes:
    head = [b"POST " + path + b" HTTP/1.1", b"Host: gw", b"Content-Type: application/json"]
    head += [b"Content-Length: %d" % len(body), *extra]
    return b"\r\n".join(head) + b"\r\n\r\n" + body


async def test_pipelined_requests_are_answered_in_order_on_one_connection(
    gateway: Gateway, upstream: Upstream
) -> None:
    reader, writer = await _open(gateway)
    try:
        first = CHAT.replace(b"hi there", b"first")
        second = CHAT.replace(b"hi there", b"second one")
        writer.write(_post(b"/v1/chat/completions", first) + _post(b"/v1/completions", second))
        await writer.drain()
        async with asyncio.timeout(5):
            answers = [await _answer(reader), await _answer(reader)]
    finally:
        writer.close()
    contents = [json.loads(body)["choices"][0]["message"]["content"] for _, _, body in answers]
    assert [status for status, _, _ in answers] == [b"HTTP/1.1 200 OK"] * 2
    assert contents == ["first", "second one"]
    assert all(headers["x-upstream"] == "llama-0" for _, headers, _ in answers)


async def test_connection_close_is_honoured(gateway: Gateway) -> None:
    reader, writer = await _open(gateway)
    try:
        writer.write(_post(b"/v1/chat/completions", CHAT, b"Connection: close"))
        async with asyncio.timeout(5):
            status, headers, _ = await _answer(reader)
            assert await reader.read() == b""  # then closed
    finally:
        writer.close()
    assert status == b"HTTP/1.1 200 OK"
    assert headers["connection"] == "close"


async def test_what_the_front_does_not_take_is_served_by_aiohttp_mid_connection(
    gateway: Gateway, upstream: Upstream
) -> None:
    """A fast request, then a chunked body (aiohttp's), then /metrics: one connection."""
    reader, writer = await _open(gateway)
    try:
        writer.write(_post(b"/v1/chat/completions", CHAT))
        async with asyncio.timeout(5):
            fast = await _answer(reader)
        chunked = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\n"
            b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
            + b"%x\r\n%s\r\n0\r\n\r\n"
            % (len(CHAT), CHAT)
        )
        writer.write(chunked + b"GET /metrics HTTP/1.1\r\nHost: gw\r\n\r\n")
        async with asyncio.timeout(5):
            handed = await _answer(reader)
            metrics = await _answer(reader)
    finally:
        writer.close()
    assert fast[0] == handed[0] == metrics[0] == b"HTTP/1.1 200 OK"
    assert json.loads(handed[2])["choices"][0]["message"]["content"] == "hi there"
    assert len(upstream.seen) == 2
    assert b"gpumesh_gateway_requests_total" in metrics[2]


async def test_a_malformed_request_gets_one_line_of_json(gateway: Gateway) -> None:
    reader, writer = await _open(gateway)
    try:
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: gw\r\nContent-Length: x\r\n\r\n")
        async with asyncio.timeout(5):
            status, _, body = await _answer(reader)
    finally:
        writer.close()
    assert status.split()[1] == b"400"  # aiohttp answers it (as HTTP/1.0: it read no version)
    assert json.loads(body)["error"]["code"] == "bad_request"


async def test_a_slow_client_holds_back_a_direct_replica(bus: NatsBus) -> None:
    """A replica streams 32 MiB as fast as it can to a client that stops reading: the gateway
    stops reading from the replica (TCP then holds the replica back) instead of buffering it
    all; once the client reads again, every byte arrives."""
    total = 32 * 1024 * 1024
    piece = b"data: " + b"x" * (64 * 1024 - 8) + b"\n\n"
    written = 0

    async def flood(request: web.Request) -> web.StreamResponse:
        nonlocal written
        await request.read()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        while written < total:
            await response.write(piece)
            written += len(piece)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", flood)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    address = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with RoutingSource(bus) as source:
            await source.publish({"llama": [route("flood-0", address)]})
            async with (
                running_gateway(bus) as gw,
                aiohttp.ClientSession(read_bufsize=2**16) as http,
                http.post(f"{gw.url}/v1/chat/completions", data=CHAT) as resp,
            ):
                assert resp.status == 200
                first = await resp.content.read(1024)
                await asyncio.sleep(0.5)  # the client reads nothing meanwhile
                held = written
                rest = len(first)
                async with asyncio.timeout(30):
                    while chunk := await resp.content.read(2**20):
                        rest += len(chunk)
    finally:
        await runner.cleanup()
    assert held < total // 2, f"the replica wrote {held} of {total} bytes to a stalled client"
    assert rest == written == total + (len(piece) - total % len(piece)) % len(piece)


async def test_a_large_body_in_many_pieces_arrives_whole(gateway: Gateway) -> None:
    """6 MiB (the test upstream takes 8), in 64 KiB pieces as a client's socket sends them."""
    content = "ab " * (2 * 1024 * 1024)
    body = json.dumps({"model": "llama", "messages": [{"role": "user", "content": content}]})
    data = _post(b"/v1/chat/completions", body.encode())
    reader, writer = await _open(gateway)
    try:
        for start in range(0, len(data), 64 * 1024):
            writer.write(data[start : start + 64 * 1024])
            await writer.drain()
        async with asyncio.timeout(20):
            status, _, answer = await _answer(reader)
    finally:
        writer.close()
    assert status == b"HTTP/1.1 200 OK"
    assert json.loads(answer)["choices"][0]["message"]["content"] == content.strip()


async def test_a_client_that_half_closes_after_its_request_gets_the_answer(
    gateway: Gateway,
) -> None:
    reader, writer = await _open(gateway)
    try:
        writer.write(_post(b"/v1/chat/completions", CHAT))
        writer.write_eof()
        async with asyncio.timeout(5):
            status, _, body = await _answer(reader)
            assert await reader.read() == b""  # and then the gateway closes its side too
    finally:
        writer.close()
    assert status == b"HTTP/1.1 200 OK"
    assert json.loads(body)["choices"][0]["message"]["content"] == "hi there"
