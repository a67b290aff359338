"""How each transport classes a failure that leaves it unsure whether the request arrived:
the retry rule for requests that are not safe to repeat depends on it."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from events.contract import tunnel as frames
from events.contract.messages import RouteEntry
from gateway.retry import RetryPolicy
from gateway.transport.base import ConnectFailed, UpstreamError, UpstreamRequest
from gateway.transport.direct import DirectTransport
from gateway.transport.overlay import OverlayTransport
from nodeagent.fencing_front import DirectFront, front_path
from nodeagent.tunnel import TunnelServer
from sim.bus import MemoryBus

POST = UpstreamRequest(
    method="POST",
    path="/orders",
    headers=[],
    body=b'{"qty": 1}',
    request_id="t-1",
    first_byte_timeout=5.0,
)


class AckLosingBus:
    """The agent's connection, losing every ACK frame it sends (and nothing else)."""

    def __init__(self, bus: MemoryBus) -> None:
        self._bus = bus

    def __getattr__(self, name: str) -> Any:
        return getattr(self._bus, name)

    async def publish(self, subject: str, data: bytes, **kwargs: Any) -> None:
        if data and data[0] == frames.ACK:
            return
        await self._bus.publish(subject, data, **kwargs)


@contextlib.asynccontextmanager
async def slow_orders() -> AsyncIterator[tuple[str, list[bytes]]]:
    """A workload whose POST /orders creates an order and answers after 0.5 s."""
    seen: list[bytes] = []

    async def create(request: web.Request) -> web.Response:
        seen.append(await request.read())
        await asyncio.sleep(0.5)
        return web.json_response({"created": len(seen)})

    app = web.Application()
    app.router.add_post("/orders", create)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    finally:
        await runner.cleanup()


async def test_an_overlay_request_whose_acknowledgement_was_lost_may_have_arrived() -> None:
    async with slow_orders() as (url, seen):
        bus = MemoryBus()
        agent = TunnelServer(
            AckLosingBus(bus),  # type: ignore[arg-type]
            "n1",
            lambda replica, epoch: url if (replica, epoch) == ("r1", 1) else None,
        )
        serving = asyncio.create_task(agent.run())
        transport = OverlayTransport(bus, connect_timeout=0.2)
        try:
            await agent.subscribed.wait()
            with pytest.raises(ConnectFailed) as caught:
                await transport.open(
                    RouteEntry(replica_id="r1", node_id="n1", address="", epoch=1), POST
                )
        finally:
            await transport.close()
            serving.cancel()
            await asyncio.wait({serving})
        assert seen == [POST.body]  # it did arrive: the agent forwards before it acknowledges
        assert not caught.value.never_delivered
        assert not RetryPolicy().retryable(caught.value, repeatable=False)


async def test_a_direct_connect_timeout_is_a_connect_failure_not_a_slow_head() -> None:
    # A listener whose accept queue is full drops further SYNs, as a powered-off node does:
    # connect() hangs until the transport's connect timeout.
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    for _ in range(4):
        filler = socket.socket()
        filler.setblocking(False)
        with contextlib.suppress(BlockingIOError):
            filler.connect(("127.0.0.1", port))
        fillers.append(filler)
    transport = DirectTransport(connect_timeout=0.3)
    route = RouteEntry(replica_id="r1", node_id="n1", address=f"http://127.0.0.1:{port}", epoch=1)
    try:
        with pytest.raises(UpstreamError) as caught:
            await transport.open(route, POST)
    finally:
        await transport.close()
        for sock in (*fillers, listener):
            sock.close()
    assert isinstance(caught.value, ConnectFailed), caught.value
    assert caught.value.never_delivered
    assert RetryPolicy().retryable(caught.value, repeatable=False)


@contextlib.asynccontextmanager
async def fronted(workload: str, leased: bool) -> AsyncIterator[RouteEntry]:
    """Replica r1@1 running `workload` behind a node's direct front, leased or not."""
    front = DirectFront(
        "127.0.0.1",
        0,
        lambda replica, epoch: workload if (replica, epoch) == ("r1", 1) else None,
        lambda replica, epoch: "" if leased else "lease lapsed",
    )
    async with asyncio.TaskGroup() as tasks:
        serving = tasks.create_task(front.run())
        await front.listening.wait()
        try:
            yield RouteEntry(
                replica_id="r1",
                node_id="n1",
                address=f"http://127.0.0.1:{front.port}{front_path('r1', 1)}",
                epoch=1,
            )
        finally:
            serving.cancel()


async def test_a_direct_request_a_fenced_node_refused_surely_never_arrived() -> None:
    """The front answers 503 `fenced` before the workload sees anything, and says so: even
    a POST may go to another replica, as over the overlay."""
    async with slow_orders() as (url, seen), fronted(url, leased=False) as route:
        transport = DirectTransport()
        try:
            with pytest.raises(ConnectFailed) as caught:
                await transport.open(route, POST)
        finally:
            await transport.close()
    assert seen == []
    assert "fenced" in str(caught.value)
    assert RetryPolicy().retryable(caught.value, repeatable=False)


async def test_a_workload_cannot_claim_its_own_5xx_never_arrived() -> None:
    async def fail(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=503, headers={frames.NOT_DELIVERED_HEADER: "fenced"})

    app = web.Application()
    app.router.add_post("/orders", fail)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        async with fronted(url, leased=True) as route:
            transport = DirectTransport()
            try:
                response = await transport.open(route, POST)
                await response.aclose()
            finally:
                await transport.close()
    finally:
        await runner.cleanup()
    assert response.status == 503  # a 5xx of the workload's: the proxy's status_5xx, no proof
    assert frames.NOT_DELIVERED_HEADER.lower() not in {k.lower() for k, _ in response.headers}
