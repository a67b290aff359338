"""The node's fencing front: forwards only what the lease covers, refuses the rest in a way the
gateway retries, and relays streams chunk by chunk (real sockets on loopback)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from events.contract.tunnel import NOT_DELIVERED_HEADER
from nodeagent.fencing_front import DirectFront, front_path


async def _stream(request: web.Request) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    for i in range(3):
        await response.write(f"data: {i}\n\n".encode())
    await response.write_eof()
    return response


async def _echo(request: web.Request) -> web.Response:
    return web.json_response(
        {"body": (await request.read()).decode(), "query": request.query_string},
        headers={"X-Upstream": "yes"},
    )


@pytest.fixture
async def front() -> AsyncIterator[tuple[DirectFront, str, set[tuple[str, int]]]]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", _echo)
    app.router.add_get("/stream", _stream)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    base = f"http://127.0.0.1:{runner.addresses[0][1]}"
    leased: set[tuple[str, int]] = {("r", 2)}
    running = {("r", 1): base, ("r", 2): base}
    fronted = DirectFront(
        "127.0.0.1",
        0,
        lambda rid, epoch: running.get((rid, epoch)),
        lambda rid, epoch: "" if (rid, epoch) in leased else "not leased",
    )
    async with asyncio.TaskGroup() as tasks:
        task = tasks.create_task(fronted.run())
        await fronted.listening.wait()
        try:
            yield fronted, f"http://127.0.0.1:{fronted.port}", leased
        finally:
            task.cancel()
            await runner.cleanup()


async def test_a_leased_replica_is_forwarded_with_its_body_query_and_headers(
    front: tuple[DirectFront, str, set[tuple[str, int]]],
) -> None:
    _, url, _ = front
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}{front_path('r', 2)}/v1/chat/completions?x=1", data=b"hi") as resp,
    ):
        assert resp.status == 200 and resp.headers["X-Upstream"] == "yes"
        assert await resp.json() == {"body": "hi", "query": "x=1"}


async def test_streams_are_relayed(front: tuple[DirectFront, str, set[tuple[str, int]]]) -> None:
    _, url, _ = front
    async with aiohttp.ClientSession() as http, http.get(f"{url}{front_path('r', 2)}/stream") as r:
        assert await r.read() == b"data: 0\n\ndata: 1\n\ndata: 2\n\n"


@pytest.mark.parametrize(
    ("path", "status", "code"),
    [
        (front_path("r", 1), 503, "fenced"),  # runs here, but the lease does not cover it
        (front_path("gone", 2), 503, "fenced"),
        ("/replica/r/two", 404, "not_found"),
        ("/v1/chat/completions", 404, "not_found"),
    ],
)
async def test_everything_else_is_refused(
    front: tuple[DirectFront, str, set[tuple[str, int]]], path: str, status: int, code: str
) -> None:
    fronted, url, _ = front
    async with aiohttp.ClientSession() as http, http.post(url + path, data=b"x") as resp:
        assert resp.status == status
        assert (await resp.json())["error"]["code"] == code
        # A 5xx the workload never saw says so, for the gateway's retry of a POST.
        assert resp.headers.get(NOT_DELIVERED_HEADER) == (code if status >= 500 else None)
    assert fronted.fenced == (1 if code == "fenced" else 0)


async def test_a_leased_replica_that_does_not_run_here_is_unknown(
    front: tuple[DirectFront, str, set[tuple[str, int]]],
) -> None:
    _, url, leased = front
    leased.add(("other", 1))
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{url}{front_path('other', 1)}/v1/chat/completions") as resp,
    ):
        assert resp.status == 503
        assert (await resp.json())["error"]["code"] == "unknown_replica"
