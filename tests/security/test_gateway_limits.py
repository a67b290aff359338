"""The gateway's limits against hostile clients, in process on loopback: what is not HTTP gets a
one-line JSON 400, an oversized body a 413 before it is read, a body or head that trickles is
cut off, and a normal client is served throughout."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.security.rig import CHAT, error_message, memory_gateway, status_of

pytestmark = pytest.mark.timeout(30)

LIMITS: dict[str, Any] = {
    "header_timeout_s": 0.5,
    "request_body_timeout_s": 0.5,
    "max_body_bytes": 4096,
}


def _request(line: str, *headers: str, body: bytes = b"") -> bytes:
    head = "\r\n".join([line, "Host: 127.0.0.1", *headers]) + "\r\n\r\n"
    return head.encode("latin-1") + body


@pytest.mark.parametrize(
    ("request_bytes", "says"),
    [
        (_request("G\x00T / HTTP/1.1"), "Invalid method"),
        (b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + bytes(40), "HTTPS traffic"),
        (_request("GET /v1/models HTTP/9.9"), "HTTP version"),
        (_request("POST /v1/chat/completions HTTP/1.1", "Content-Length: -1"), "Content-Length"),
        (_request("POST /v1/completions HTTP/1.1", "Content-Length: 1" + "9" * 20), "overflow"),
        (
            _request("POST /v1/embeddings HTTP/1.1", "Content-Length: 1", "Content-Length: 2"),
            "Duplicate",
        ),
        (
            _request(
                "POST /c/llama/x HTTP/1.1", "Transfer-Encoding: chunked", body=b"zz\r\nab\r\n"
            ),
            "chunk size",
        ),
        (_request("GET /" + "a" * 9000 + " HTTP/1.1"), "8190 bytes"),
        (_request("GET /v1/models HTTP/1.1", "X-A\x00: b"), "header"),
    ],
)
async def test_what_is_not_http_gets_a_one_line_json_400(request_bytes: bytes, says: str) -> None:
    async with memory_gateway(**LIMITS) as rig:
        answer = await rig.exchange(request_bytes)
        assert status_of(answer) == 400, answer[:300]
        assert says in error_message(answer)
        assert await rig.chat() == 200  # and the gateway goes on


async def test_unknown_routes_and_methods_get_json_errors() -> None:
    async with memory_gateway(**LIMITS) as rig:
        missing = await rig.exchange(
            b"GET /nope HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        assert status_of(missing) == 404 and "/nope" in error_message(missing)
        wrong = await rig.exchange(
            b"PUT /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
        )
        assert status_of(wrong) == 405 and "PUT" in error_message(wrong)
        assert b"\r\nAllow: GET" in wrong.partition(b"\r\n\r\n")[0]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/c/llama/v1/x", "/api/v1/clusters"])
async def test_a_declared_oversized_body_gets_413_before_it_is_sent(path: str) -> None:
    # Over the limit by its Content-Length alone: the answer must not wait for the body (the
    # client sends none), so it comes well inside the body timeout.
    async with memory_gateway(**{**LIMITS, "request_body_timeout_s": 20.0}) as rig:
        head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 5000\r\n\r\n".encode()
        reader, writer = await rig.open()
        try:
            writer.write(head)
            async with asyncio.timeout(5):
                answer = await reader.readuntil(b"}}")
            assert status_of(answer) == 413, answer[:300]
            assert "4096-byte limit" in error_message(answer)
        finally:
            writer.close()


async def test_a_chunked_body_that_grows_past_the_limit_gets_413() -> None:
    async with memory_gateway(**LIMITS) as rig:
        chunk = b"x" * 3000
        body = b"%x\r\n%s\r\n" % (len(chunk), chunk) * 2 + b"0\r\n\r\n"
        answer = await rig.exchange(
            b"POST /c/llama/v1/x HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n"
            b"Connection: close\r\n\r\n" + body
        )
        assert status_of(answer) == 413 and "limit" in error_message(answer)


async def test_a_body_that_trickles_gets_408_on_every_route() -> None:
    paths = ["/v1/chat/completions", "/c/llama/v1/x", "/api/v1/clusters"]
    async with memory_gateway(**LIMITS) as rig:
        connections = [await rig.open() for _ in paths]
        try:
            for path, (_, writer) in zip(paths, connections, strict=True):
                head = f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000\r\n\r\n"
                writer.write(head.encode() + CHAT[:10])  # and nothing more
                await writer.drain()
            assert await rig.chat() == 200  # meanwhile, a normal client is served
            async with asyncio.timeout(10):  # the limit is 0.5 s, then 2 s of lingering
                answers = await asyncio.gather(*(reader.read() for reader, _ in connections))
        finally:
            for _, writer in connections:
                writer.close()
        for path, answer in zip(paths, answers, strict=True):
            assert status_of(answer) == 408, (path, answer[:300])
            assert "did not arrive within 0.5 s" in error_message(answer), path


async def test_a_head_sent_a_byte_at_a_time_is_cut_off_at_the_header_timeout() -> None:
    # The timer runs from the connection's start, not from the last byte: trickling does not
    # keep a connection alive.
    async with memory_gateway(**LIMITS) as rig:
        reader, writer = await rig.open()
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            async with asyncio.timeout(10):
                for byte in b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 1000:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    try:
                        # Await the close itself; 0.05 s is only the pace of the trickle.
                        closed = await asyncio.wait_for(reader.read(1), 0.05)
                    except TimeoutError:
                        continue
                    assert closed == b""
                    break
                else:
                    pytest.fail("the gateway read a 1 KiB header for 50 s")
            assert loop.time() - started < 3.0
            assert await rig.chat() == 200
        finally:
            writer.close()
