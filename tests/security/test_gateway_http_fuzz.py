"""The gateway's HTTP surface, fed malformed requests over a raw socket: every one gets an answer
that is not an internal error (or the connection is closed), within a bounded time, and the
gateway serves a well-formed request afterwards."""

from __future__ import annotations

import asyncio
import random
from urllib.parse import urlsplit

from hypothesis import given, settings, strategies as st

from actors.real_env import LoopClock
from gateway.auth import KeyRing
from gateway.server import Gateway, GatewayConfig
from sim.bus import MemoryBus
from tests.integration.gateway_kit import RoutingSource, Upstream, route
from tests.security.test_decoders_fuzz import payloads

METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "G\x00T", "POST /x"]
PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/c/llama/v1/chat/completions",
    "/c/nope/x",
    "/c/../../etc/passwd",
    "/api/v1/clusters",
    "/api/v1/events/stream?after=-1",
    "/metrics",
    "/healthz",
    "/readyz",
    "/%00%ff",
    "*",
]
HEADERS = [
    ("Content-Type", "application/json"),
    ("Content-Length", "-1"),
    ("Content-Length", "99999999999999999999"),
    ("Content-Length", "abc"),
    ("Transfer-Encoding", "chunked"),
    ("Transfer-Encoding", "gzip, chunked"),
    ("Authorization", "Bearer " + "k" * 500),
    ("Authorization", "Basic \x00\x01"),
    ("X-Request-Id", "\u2603" * 10),
    ("Host", ""),
    ("Expect", "100-continue"),
]
requests = st.builds(
    lambda method, path, headers, body, chunked: (method, path, headers, body, chunked),
    st.sampled_from(METHODS) | st.text(min_size=1, max_size=8),
    st.sampled_from(PATHS) | st.text(min_size=1, max_size=30).map(lambda p: "/" + p),
    st.lists(st.sampled_from(HEADERS), max_size=4),
    payloads,
    st.booleans(),
)


def _raw(method: str, path: str, headers: list[tuple[str, str]], body: bytes, chunk: bool) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in headers]
    names = {name.lower() for name, _ in headers}
    if chunk and "transfer-encoding" not in names:
        lines.append("Transfer-Encoding: chunked")
        body = f"{len(body) + 3:x}\r\n".encode() + body + b"\r\nzz\r\n"  # a lying chunk size
    elif "content-length" not in names and "transfer-encoding" not in names:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return "\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body


async def _exchange(host: str, port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(data)
        await writer.drain()
        # No half-close: the gateway takes a client's EOF for a client gone and cancels. A
        # request that waits for more body is answered by the body timeout (2 s here).
        async with asyncio.timeout(10):
            return await reader.read()
    finally:
        writer.close()


@settings(max_examples=30)
@given(st.lists(requests, min_size=1, max_size=6))
def test_malformed_requests_get_answers_not_internal_errors(
    batch: list[tuple[str, str, list[tuple[str, str]], bytes, bool]],
) -> None:
    async def main() -> None:
        bus = MemoryBus()
        upstream = await Upstream("llama-0").start()
        config = GatewayConfig(
            gateway_id="gw-fuzz", port=0, header_timeout_s=2.0, request_body_timeout_s=2.0
        )
        gateway = Gateway(bus, config, KeyRing.open(), clock=LoopClock(), rng=random.Random(1))
        try:
            async with RoutingSource(bus) as source, asyncio.TaskGroup() as tasks:
                await source.publish({"llama": [route(upstream.name, upstream.address)]})
                running = tasks.create_task(gateway.run())
                await asyncio.wait_for(gateway.feed.ready.wait(), 10)
                url = urlsplit(gateway.url)
                assert url.hostname and url.port
                for method, path, headers, body, chunk in batch:
                    answer = await _exchange(
                        url.hostname, url.port, _raw(method, path, headers, body, chunk)
                    )
                    status_line = answer.split(b"\r\n", 1)[0]
                    assert b" 500 " not in status_line + b" ", answer[:300]
                good = _raw("GET", "/v1/models", [], b"", False)
                assert (await _exchange(url.hostname, url.port, good)).startswith(b"HTTP/1.1 200")
                running.cancel()
        finally:
            await upstream.stop()

    asyncio.run(main())
