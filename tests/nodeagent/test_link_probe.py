"""Link measurement (nodeagent/link_probe.py): the real TCP responder and prober on loopback,
the timing on virtual time with a dialer whose delays are known, and the agent's links
subject refusing bad requests in one line."""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import pytest

from events.contract import subjects
from events.contract.messages import LinkPeer, LinksReply, LinksRequest
from nodeagent.agent import Agent
from nodeagent.config import AgentConfig
from nodeagent.gpu import FakeGpuProbe
from nodeagent.link_probe import (
    LinkChannel,
    LinkProbing,
    LinkUnreachable,
    TcpDialer,
    TcpResponder,
    measure,
)
from nodeagent.workload.fake import FakeDriver
from sim import run_simulation
from sim.bus import MemoryBus
from sim.commands import MemoryCommandQueue
from sim.env import sim_env

# Real sockets, real time.


async def test_tcp_measures_a_loopback_link() -> None:
    responder = TcpResponder("127.0.0.1", 0, "127.0.0.1")
    task = asyncio.create_task(responder.run())
    try:
        await responder.listening.wait()
        assert responder.endpoint == f"127.0.0.1:{responder.port}"
        peer = LinkPeer(node_id="b", endpoint=responder.endpoint)
        m = await measure(TcpDialer(), peer, pings=5, push_bytes=1 << 20, timeout_s=5.0)
        assert m.peer == "b" and m.error == ""
        assert 0 < m.rtt_ms < 100  # loopback
        assert m.gbps > 0.05
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


async def test_an_unreachable_or_bad_endpoint_is_an_error_in_one_line() -> None:
    responder = TcpResponder("127.0.0.1", 0, "127.0.0.1")
    task = asyncio.create_task(responder.run())
    await responder.listening.wait()
    closed = responder.endpoint
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    m = await measure(
        TcpDialer(), LinkPeer(node_id="b", endpoint=closed), pings=1, push_bytes=0, timeout_s=2
    )
    assert m.error.startswith(f"cannot connect to {closed}") and "\n" not in m.error
    assert (m.rtt_ms, m.gbps) == (0.0, 0.0)
    bad = await measure(
        TcpDialer(), LinkPeer(node_id="b", endpoint="nohost"), pings=1, push_bytes=0, timeout_s=2
    )
    assert bad.error == "bad link endpoint 'nohost': expected host:port"


async def test_the_responder_hangs_up_on_garbage_and_oversized_pushes() -> None:
    responder = TcpResponder("127.0.0.1", 0, "127.0.0.1")
    task = asyncio.create_task(responder.run())
    try:
        await responder.listening.wait()
        for junk in (b"GET / HTTP/1.1\r\n\r\n", b"T" + (1 << 40).to_bytes(8, "big")):
            reader, writer = await asyncio.open_connection("127.0.0.1", responder.port)
            writer.write(junk)
            await writer.drain()
            assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, nothing answered
            writer.close()
        # ... and goes on serving the next peer.
        peer = LinkPeer(node_id="b", endpoint=responder.endpoint)
        m = await measure(TcpDialer(), peer, pings=2, push_bytes=1024, timeout_s=5.0)
        assert m.error == ""
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


# Virtual time: the timing arithmetic, exactly.


class DelayChannel:
    def __init__(self, rtt_s: float, gbps: float) -> None:
        self.rtt_s, self.gbps = rtt_s, gbps

    async def ping(self) -> None:
        await asyncio.sleep(self.rtt_s)

    async def push(self, nbytes: int) -> None:
        await asyncio.sleep(nbytes * 8 / (self.gbps * 1e9) + self.rtt_s)

    async def close(self) -> None:
        return None


class DelayDialer:
    method = "test"

    def __init__(self, rtt_s: float = 0.002, gbps: float = 2.0) -> None:
        self.rtt_s, self.gbps = rtt_s, gbps

    async def dial(self, endpoint: str) -> LinkChannel:
        if endpoint == "down:1":
            await asyncio.sleep(10)
        if endpoint == "refused:1":
            raise LinkUnreachable("cannot connect to refused:1: connection refused")
        return DelayChannel(self.rtt_s, self.gbps)


def test_measure_takes_the_median_round_trip_and_the_push_less_one_trip() -> None:
    async def scenario() -> Any:
        peer = LinkPeer(node_id="b", endpoint="b:1")
        return await measure(DelayDialer(), peer, pings=3, push_bytes=1 << 20, timeout_s=1)

    m = run_simulation(scenario())
    assert m.rtt_ms == 2.0 and m.gbps == 2.0


class FixedResponder:
    endpoint = "a:7400"

    def __init__(self) -> None:
        self.listening = asyncio.Event()

    async def run(self) -> None:
        self.listening.set()
        await asyncio.Future()


def agent(links: LinkProbing | None, bus: MemoryBus) -> Agent:
    return Agent(
        sim_env(1, bus=bus),
        MemoryCommandQueue(),
        FakeGpuProbe.parse("RTX4090:24GiB:1", node_id="a"),
        FakeDriver(),
        AgentConfig(node_id="a"),
        links=links,
    )


def test_the_agent_answers_a_links_request_on_its_subject() -> None:
    async def scenario() -> LinksReply:
        bus = MemoryBus()
        a = agent(LinkProbing(DelayDialer(), FixedResponder()), bus)  # type: ignore[arg-type]
        task = asyncio.create_task(a.run())
        await asyncio.sleep(0.1)
        request = LinksRequest(
            peers=(
                LinkPeer(node_id="b", endpoint="b:1"),
                LinkPeer(node_id="c", endpoint="down:1"),
                LinkPeer(node_id="d", endpoint="refused:1"),
            ),
            pings=3,
            push_bytes=1 << 20,
            timeout_s=1.0,
        )
        answer = await bus.request(subjects.links("a"), msgspec.json.encode(request), timeout=10.0)
        task.cancel()
        return msgspec.json.decode(answer.data, type=LinksReply)

    reply = run_simulation(scenario())
    assert reply.ok and reply.node_id == "a" and reply.endpoint == "a:7400"
    assert reply.method == "test: median of 3 pings, 1048576 bytes pushed"
    b, c, d = reply.links
    assert (b.peer, b.rtt_ms, b.gbps, b.error) == ("b", 2.0, 2.0, "")
    assert (c.peer, c.error) == ("c", "no answer within 1 s")
    assert d.error == "cannot connect to refused:1: connection refused"


@pytest.mark.parametrize(
    ("body", "error"),
    [
        (b"not json", "undecodable links request: "),
        (b'{"type": "links_request.v1", "pings": "five"}', "undecodable links request: "),
        (b'{"type": "fault.v1"}', "undecodable links request: "),
        (b'{"type": "links_request.v1", "pings": 0}', "links request: pings must be 1-50, got 0"),
        (
            b'{"type": "links_request.v1", "push_bytes": 1099511627776}',
            "links request: push_bytes must be 0-67108864, got 1099511627776",
        ),
        (
            b'{"type": "links_request.v1", "timeout_s": -1}',
            "links request: timeout_s must be in (0, 30], got -1.0",
        ),
    ],
)
def test_a_bad_links_request_is_refused_in_one_line(body: bytes, error: str) -> None:
    async def scenario() -> LinksReply:
        a = agent(LinkProbing(DelayDialer(), FixedResponder()), MemoryBus())  # type: ignore[arg-type]
        return await a.measure_links(body)

    reply = run_simulation(scenario())
    assert not reply.ok and reply.error.startswith(error) and "\n" not in reply.error
    assert reply.links == ()


def test_an_agent_without_probing_says_so() -> None:
    async def scenario() -> LinksReply:
        return await agent(None, MemoryBus()).measure_links(b"{}")

    assert run_simulation(scenario()).error == "this agent measures no links"
