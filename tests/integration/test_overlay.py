"""The overlay transport end to end: gateway/transport/overlay.py over a real nats-server to
nodeagent/tunnel.py, which forwards to an in-process workload (the echo server, or a small
aiohttp app that misbehaves on purpose)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from typing import Any

import pytest
from aiohttp import web

from events.contract import subjects, tunnel as frames
from events.contract.messages import RouteEntry
from gateway.transport.base import (
    ConnectFailed,
    FirstByteTimeout,
    ResetBeforeHead,
    StreamBroken,
    UpstreamRequest,
    UpstreamResponse,
)
from gateway.transport.overlay import DEFAULT_WINDOW_BYTES, OverlayTransport, RequestTooLarge
from nodeagent.tunnel import TunnelServer
from nodeagent.workload import echo
from runtime.env import Bus
from sim.bus import MemoryBus
from tests.nodeagent.harness import Harness, start, stop
from wire.nats_bus import NatsBus

pytestmark = pytest.mark.integration

Connect = Callable[[str], Awaitable[NatsBus]]
NODE = "n1"
ROUTE = RouteEntry(replica_id="r1", node_id=NODE, address="", epoch=1)


def chat(prompt: str, *, stream: bool = False, request_id: str = "req-1") -> UpstreamRequest:
    body = {"model": "echo", "messages": [{"role": "user", "content": prompt}], "stream": stream}
    return UpstreamRequest(
        method="POST",
        path="/v1/chat/completions",
        headers=[("Content-Type", "application/json"), ("X-Request-Id", request_id)],
        body=json.dumps(body).encode(),
        request_id=request_id,
        first_byte_timeout=5.0,
    )


def get(path: str, *, first_byte_timeout: float = 5.0) -> UpstreamRequest:
    return UpstreamRequest(
        method="GET",
        path=path,
        headers=[],
        body=b"",
        request_id="req-get",
        first_byte_timeout=first_byte_timeout,
    )


async def body_of(response: UpstreamResponse) -> bytes:
    return b"".join([chunk async for chunk in response.chunks()])


def header(response: UpstreamResponse, name: str) -> str | None:
    return next((v for k, v in response.headers if k.lower() == name.lower()), None)


@asynccontextmanager
async def agent(
    bus: Bus, replicas: Mapping[tuple[str, int], str], **kw: Any
) -> AsyncIterator[TunnelServer]:
    """The agent's tunnel server alone, resolving replicas from `replicas`."""
    server = TunnelServer(bus, NODE, lambda r, e: replicas.get((r, e)), **kw)
    task = asyncio.create_task(server.run())
    try:
        async with asyncio.timeout(5):
            await server.subscribed.wait()
        yield server
    finally:
        task.cancel()
        await asyncio.wait({task})
        assert task.cancelled() or task.exception() is None


@asynccontextmanager
async def overlay(bus: Bus, **kw: Any) -> AsyncIterator[OverlayTransport]:
    transport = OverlayTransport(bus, **kw)
    try:
        yield transport
    finally:
        await transport.close()


@asynccontextmanager
async def app_server(app: web.Application, **kw: Any) -> AsyncIterator[tuple[str, web.AppRunner]]:
    runner = web.AppRunner(app, access_log=None, **kw)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}", runner
    finally:
        await runner.cleanup()


@pytest.fixture
async def echo_url() -> AsyncIterator[str]:
    server = await echo.start(0, tokens_per_s=0)
    try:
        yield server.url
    finally:
        await server.close()


@pytest.fixture
async def agent_bus(connect: Connect) -> NatsBus:
    return await connect("agent")


async def test_a_chat_completion_goes_through(
    bus: NatsBus, agent_bus: NatsBus, echo_url: str
) -> None:
    async with agent(agent_bus, {("r1", 1): echo_url}) as server, overlay(bus) as transport:
        response = await transport.open(ROUTE, chat("hello over the overlay", request_id="abc-42"))
        assert response.status == 200
        assert header(response, "X-Request-Id") == "abc-42"
        assert (header(response, "Content-Type") or "").startswith("application/json")
        answer = json.loads(await body_of(response))
        assert answer["choices"][0]["message"]["content"] == "hello over the overlay"
        assert answer["id"] == "chatcmpl-abc-42"
        await response.aclose()
        assert transport.in_flight == 0 and server.cancels == 0
        # Many at once, over the same subscription and the agent's keep-alive connections.
        many = await asyncio.gather(
            *(transport.open(ROUTE, chat(f"word{i}", request_id=f"m{i}")) for i in range(50))
        )
        bodies = [json.loads(await body_of(r)) for r in many]
        assert [b["choices"][0]["message"]["content"] for b in bodies] == [
            f"word{i}" for i in range(50)
        ]
        assert transport.in_flight == 0 and server.in_flight == 0


async def test_a_stream_arrives_as_it_is_produced(bus: NatsBus, agent_bus: NatsBus) -> None:
    workload = await echo.start(0, tokens_per_s=20)  # 10 tokens: about 0.45 s
    try:
        async with agent(agent_bus, {("r1", 1): workload.url}), overlay(bus) as transport:
            loop = asyncio.get_running_loop()
            start = loop.time()
            response = await transport.open(
                ROUTE, chat(" ".join(f"w{i}" for i in range(10)), stream=True)
            )
            assert response.status == 200
            assert header(response, "Content-Type") == "text/event-stream"
            arrivals: list[tuple[float, bytes]] = []
            async for chunk in response.chunks():
                arrivals.append((loop.time() - start, chunk))
    finally:
        await workload.close()
    text = b"".join(c for _, c in arrivals).decode()
    events = [line for line in text.split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    words = [
        json.loads(e.removeprefix("data: "))["choices"][0]["delta"].get("content")
        for e in events[:10]
    ]
    assert words == ["w0", *(f" w{i}" for i in range(1, 10))]
    assert len(arrivals) >= 5, "the body came in one piece, not as it was produced"
    first, last = arrivals[0][0], arrivals[-1][0]
    assert last - first > 0.3, arrivals


@pytest.mark.parametrize("window", [0, DEFAULT_WINDOW_BYTES])  # 0: a gateway before credits
async def test_a_body_larger_than_a_frame_arrives_whole(
    bus: NatsBus, agent_bus: NatsBus, window: int
) -> None:
    big = bytes(range(256)) * 6000  # 1.5 MB, bigger than NATS's max_payload

    async def handler(request: web.Request) -> web.Response:
        return web.Response(body=big, content_type="application/octet-stream")

    app = web.Application()
    app.router.add_get("/big", handler)
    async with (
        app_server(app) as (url, _),
        agent(agent_bus, {("r1", 1): url}),
        overlay(bus, window_bytes=window) as transport,
    ):
        response = await transport.open(ROUTE, get("/big"))
        chunks = [chunk async for chunk in response.chunks()]
    assert b"".join(chunks) == big
    assert max(len(c) for c in chunks) <= frames.MAX_FRAME_PAYLOAD


def firehose(size: int) -> tuple[web.Application, list[int]]:
    """GET /big streams `size` bytes as fast as its client takes them; [0] counts written."""
    written = [0]

    async def handler(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "application/octet-stream"})
        await response.prepare(request)
        block = b"x" * 65536
        while written[0] < size:
            await response.write(block)
            written[0] += len(block)
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_get("/big", handler)
    return app, written


async def test_a_slow_client_holds_back_the_workload_not_the_gateway(
    bus: NatsBus, agent_bus: NatsBus
) -> None:
    size, frame, window = 32 * 1024 * 1024, 64 * 1024, 128 * 1024
    app, written = firehose(size)
    async with (
        app_server(app) as (url, _),
        agent(agent_bus, {("r1", 1): url}, frame_bytes=frame) as server,
        overlay(bus, window_bytes=window) as transport,
    ):
        response = await transport.open(ROUTE, get("/big"))
        chunks = response.chunks()
        received = len(await anext(chunks))  # then the client reads nothing for a while
        async with asyncio.timeout(5):
            await server.window_full.wait()
        stream = next(iter(server._streams.values()))
        (queue,) = transport._streams.values()
        held = sum(len(msg.data) for msg in queue._queue if msg is not None)  # type: ignore[attr-defined]
        assert held <= window + 2 * (frame + 1024)  # what the agent may send ahead, with prefixes
        assert stream.sent - stream.credited <= window + frame
        assert written[0] < size // 2  # the rest waits in the workload
        async with asyncio.timeout(30):
            async for chunk in chunks:  # the client catches up: CREDIT lets the rest through
                received += len(chunk)
    assert received == size == written[0]


async def test_a_gateway_that_stops_reading_is_given_up_as_stalled(
    bus: NatsBus, agent_bus: NatsBus
) -> None:
    """A gateway that asked for a window and then sends no CREDIT (gone, or stuck): the agent
    ends the request with ERROR `stalled` instead of holding the workload forever."""
    app, written = firehose(32 * 1024 * 1024)
    window = 128 * 1024
    inbox = "_INBOX.stall-test"
    replies = await bus.subscribe(f"{inbox}.*")
    request = frames.TunnelRequest(
        request_id="req-stall", replica_id="r1", epoch=1, method="GET", path="/big", window=window
    )
    async with (
        app_server(app) as (url, _),
        agent(agent_bus, {("r1", 1): url}, frame_bytes=64 * 1024, stall_timeout_s=0.2) as server,
    ):
        await bus.publish(subjects.tunnel(NODE), frames.encode_request(request), reply=f"{inbox}.1")
        body = 0
        async with asyncio.timeout(10):
            async for msg in replies:
                frame = frames.decode(msg.data)
                body += len(frame.payload)
                if frame.kind == frames.ERROR:
                    break
    await replies.unsubscribe()
    assert isinstance(frame.meta, frames.TunnelError) and frame.meta.reason == "stalled"
    assert server.errors.get("stalled") == 1
    assert window <= body <= window + 64 * 1024
    assert written[0] < 32 * 1024 * 1024


async def test_an_unknown_replica_is_a_connect_failure(
    bus: NatsBus, agent_bus: NatsBus, echo_url: str
) -> None:
    async with agent(agent_bus, {("r1", 1): echo_url}) as server, overlay(bus) as transport:
        stale = RouteEntry(replica_id="r1", node_id=NODE, address="", epoch=2)
        with pytest.raises(
            ConnectFailed, match="unknown_replica: this node does not run replica r1 at epoch 2"
        ):
            await transport.open(stale, chat("hi"))
        assert server.errors == {"unknown_replica": 1}
        assert transport.in_flight == 0


async def test_a_workload_that_refuses_is_a_connect_failure(
    bus: NatsBus, agent_bus: NatsBus
) -> None:
    async with agent(agent_bus, {("r1", 1): "http://127.0.0.1:1"}), overlay(bus) as transport:
        with pytest.raises(
            ConnectFailed, match=r"connect_error: cannot reach http://127\.0\.0\.1:1"
        ):
            await transport.open(ROUTE, chat("hi"))


async def test_no_agent_is_a_connect_failure_at_once(bus: NatsBus) -> None:
    async with overlay(bus, connect_timeout=2.0) as transport:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(ConnectFailed, match=f"does not listen on {subjects.tunnel(NODE)}"):
            await transport.open(ROUTE, chat("hi"))
        assert loop.time() - start < 0.5  # NATS says "no responders": no need to wait
        assert transport.in_flight == 0


async def test_a_silent_agent_is_a_connect_failure_after_connect_timeout(
    bus: NatsBus, agent_bus: NatsBus
) -> None:
    # Subscribed (so NATS finds a responder) but never answering: a hung agent.
    silent = await agent_bus.subscribe(subjects.tunnel(NODE))
    async with overlay(bus, connect_timeout=0.3) as transport:
        loop = asyncio.get_running_loop()
        start = loop.time()
        with pytest.raises(ConnectFailed, match=r"did not acknowledge the request within 0\.3 s"):
            await transport.open(ROUTE, chat("hi"))
        assert 0.25 < loop.time() - start < 1.0
    request = frames.decode((await silent.next_msg(timeout=1)).data)
    assert request.kind == frames.REQUEST
    cancel = frames.decode((await silent.next_msg(timeout=1)).data)
    assert cancel.kind == frames.CANCEL  # in case it was only slow


async def test_a_workload_that_never_answers_is_a_first_byte_timeout(
    bus: NatsBus, agent_bus: NatsBus
) -> None:
    gave_up = asyncio.Event()

    async def hang(request: web.Request) -> web.Response:
        try:
            await asyncio.sleep(30)
        finally:
            gave_up.set()
        return web.Response()

    app = web.Application()
    app.router.add_get("/hang", hang)
    async with (
        app_server(app, handler_cancellation=True) as (url, _),
        agent(agent_bus, {("r1", 1): url}) as server,
        overlay(bus, connect_timeout=0.3) as transport,
    ):
        loop = asyncio.get_running_loop()
        start = loop.time()
        # Longer than connect_timeout: the agent's ACK tells "slow" from "not there".
        with pytest.raises(FirstByteTimeout, match=r"no response head within 0\.6 s"):
            await transport.open(ROUTE, get("/hang", first_byte_timeout=0.6))
        assert 0.55 < loop.time() - start < 1.5
        async with asyncio.timeout(2):
            await gave_up.wait()  # the agent hung up on the workload
        assert server.in_flight == 0


async def test_a_workload_killed_mid_stream_breaks_the_stream(
    bus: NatsBus, agent_bus: NatsBus
) -> None:
    app = echo.build_app(tokens_per_s=10)
    async with (
        app_server(app, shutdown_timeout=0.05) as (url, runner),
        agent(agent_bus, {("r1", 1): url}),
        overlay(bus) as transport,
    ):
        response = await transport.open(ROUTE, chat(" ".join(["word"] * 50), stream=True))
        chunks = response.chunks()
        first = await anext(chunks)
        assert first.startswith(b"data: ")
        await runner.cleanup()  # the workload dies with the stream half sent
        with pytest.raises(StreamBroken, match="reset: in the response body"):
            async for _ in chunks:
                pass
        await response.aclose()
        assert transport.in_flight == 0


async def test_closing_mid_stream_cancels_the_upstream_request(
    bus: NatsBus, agent_bus: NatsBus
) -> None:
    disconnected = asyncio.Event()
    sent = 0

    async def endless(request: web.Request) -> web.StreamResponse:
        nonlocal sent
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        try:
            while True:
                await response.write(b"data: tick\n\n")
                sent += 1
                await asyncio.sleep(0.01)
        except (ConnectionResetError, asyncio.CancelledError):
            disconnected.set()
            raise

    app = web.Application()
    app.router.add_get("/endless", endless)
    async with (
        app_server(app) as (url, _),
        agent(agent_bus, {("r1", 1): url}) as server,
        overlay(bus) as transport,
    ):
        response = await transport.open(ROUTE, get("/endless"))
        chunks = response.chunks()
        assert (await anext(chunks)).startswith(b"data: tick")
        await response.aclose()
        assert transport.in_flight == 0
        async with asyncio.timeout(2):
            await disconnected.wait()  # the agent hung up on the workload
        assert server.cancels == 1
        for _ in range(100):
            if not server.in_flight:
                break
            await asyncio.sleep(0.01)
        assert server.in_flight == 0
        stopped_at = sent
        await asyncio.sleep(0.1)
        assert sent == stopped_at
        await response.aclose()  # twice is harmless


async def test_garbage_on_the_tunnel_subject_is_refused_and_counted(
    bus: NatsBus, agent_bus: NatsBus, echo_url: str
) -> None:
    async with agent(agent_bus, {("r1", 1): echo_url}) as server, overlay(bus) as transport:
        reply = await bus.request(subjects.tunnel(NODE), b"GET / HTTP/1.1\r\n\r\n", timeout=2)
        error = frames.decode(reply.data).meta
        assert isinstance(error, frames.TunnelError)
        assert (error.reason, error.detail) == (
            "bad_request",
            "not a tunnel frame: unknown kind 0x47",
        )
        await bus.publish(subjects.tunnel(NODE), frames.encode_data(0, b"stray"))
        response = await transport.open(ROUTE, chat("still serving"))
        assert (
            json.loads(await body_of(response))["choices"][0]["message"]["content"]
            == "still serving"
        )
        assert server.garbage == 2


async def test_a_request_too_large_for_nats_is_refused_before_sending(
    bus: NatsBus, agent_bus: NatsBus, echo_url: str
) -> None:
    async with agent(agent_bus, {("r1", 1): echo_url}) as server, overlay(bus) as transport:
        request = chat("x " * 600_000)
        with pytest.raises(
            RequestTooLarge, match=r"exceeds the overlay's limit of 1048576 bytes"
        ) as caught:
            await transport.open(ROUTE, request)
        assert isinstance(caught.value, ConnectFailed)
        assert server.requests == 0


async def test_the_overlay_runs_on_the_simulators_bus(echo_url: str) -> None:
    bus = MemoryBus()
    async with agent(bus, {("r1", 1): echo_url}), overlay(bus, connect_timeout=0.2) as transport:
        response = await transport.open(ROUTE, chat("in memory"))
        assert (
            json.loads(await body_of(response))["choices"][0]["message"]["content"] == "in memory"
        )
        # A MemoryBus answers "no responders" as NATS does: nobody listens for node n9.
        elsewhere = RouteEntry(replica_id="r9", node_id="n9", address="", epoch=1)
        with pytest.raises(ConnectFailed, match="does not listen"):
            await transport.open(elsewhere, chat("hi"))


@asynccontextmanager
async def scripted_agent(bus: Bus, *script: bytes) -> AsyncIterator[list[frames.Frame]]:
    """A fake agent that answers the first request with `script` and records what it gets."""
    sub = await bus.subscribe(subjects.tunnel(NODE))
    got: list[frames.Frame] = []

    async def serve() -> None:
        async for msg in sub:
            got.append(frames.decode(msg.data))
            if got[-1].kind == frames.REQUEST:
                for frame in script:
                    await bus.publish(msg.reply, frame)

    task = asyncio.create_task(serve())
    try:
        yield got
    finally:
        task.cancel()
        await asyncio.wait({task})
        await sub.unsubscribe()


ACK = frames.encode_ack()
HEAD = frames.encode_head(0, frames.TunnelHead(status=200))
DATA = frames.encode_data(1, b"x")


@pytest.mark.parametrize(
    ("script", "error", "message"),
    [
        ((frames.encode_data(1, b"x"),), ResetBeforeHead, "lost \\(got DATA #1 first\\)"),
        ((b"junk",), ResetBeforeHead, "garbage from the agent: not a tunnel frame"),
        ((frames.encode_error(0, "reset", "peer closed"),), ResetBeforeHead, "reset: peer closed"),
        ((frames.encode_error(0, "overloaded", "512 requests"),), ConnectFailed, "overloaded"),
        ((ACK, frames.encode_error(0, "first_byte_timeout", "slow")), FirstByteTimeout, "slow"),
        ((HEAD, frames.encode_data(2, b"x")), StreamBroken, "lost \\(expected #1, got DATA #2\\)"),
        ((HEAD, DATA, frames.encode_error(2, "reset", "gone")), StreamBroken, "reset: gone"),
        ((HEAD, DATA), StreamBroken, "no data for 0.2 s"),
    ],
)  # fmt: skip
async def test_lost_frames_and_agent_errors_map_onto_the_transport_errors(
    script: tuple[bytes, ...], error: type[Exception], message: str
) -> None:
    bus = MemoryBus()
    async with scripted_agent(bus, *script) as got, overlay(bus, idle_timeout=0.2) as transport:
        with pytest.raises(error, match=message):
            response = await transport.open(ROUTE, chat("hi"))
            await body_of(response)
        assert transport.in_flight == 0
        await asyncio.sleep(0)
        told = not any(frame.startswith(bytes([frames.ERROR])) for frame in script)
        cancels = [f for f in got if f.kind == frames.CANCEL]
        assert len(cancels) == told, "a CANCEL unless the agent said it gave up"


async def test_a_running_agent_serves_its_replicas_through_the_tunnel(echo_url: str) -> None:
    harness = Harness()  # a whole Agent on a MemoryBus, with a fake workload driver
    port = int(echo_url.rsplit(":", 1)[1])
    async with harness.running(), overlay(harness.bus, connect_timeout=0.5) as transport:
        await harness.send(start("r1", 1, port=port))  # the fake "runs" it on the echo's port
        await harness.reports.until(lambda r: r.state == "ready", timeout=5)
        response = await transport.open(ROUTE, chat("through the agent"))
        answer = json.loads(await body_of(response))
        assert answer["choices"][0]["message"]["content"] == "through the agent"
        with pytest.raises(ConnectFailed, match="unknown_replica"):
            await transport.open(
                RouteEntry(replica_id="r1", node_id=NODE, address="", epoch=2), chat("x")
            )
        await harness.send(stop("r1", 1))
        await harness.reports.until(lambda r: r.state == "stopped", timeout=5)
        with pytest.raises(ConnectFailed, match="unknown_replica"):
            await transport.open(ROUTE, chat("gone"))
