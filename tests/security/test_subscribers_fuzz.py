"""Garbage on the subjects the gateway and the agent read (the routing table, the HTTP tunnel),
on the in-memory bus: each bad message is dropped and counted or answered with a one-line
error, and a valid message afterwards is still served."""

from __future__ import annotations

import asyncio
import contextlib

import msgspec
from hypothesis import given, settings, strategies as st

from events.contract import subjects, tunnel as frames
from events.contract.messages import RoutingUpdate
from events.contract.tunnel import TunnelRequest
from nodeagent.tunnel import TunnelServer
from sim.bus import MemoryBus
from tests.integration.gateway_kit import Upstream, route, until
from tests.security.rig import memory_gateway
from tests.security.test_decoders_fuzz import frames as frame_bytes, payloads

_ROUTING = msgspec.json.Decoder(RoutingUpdate)


def _decodes(data: bytes) -> bool:
    try:
        _ROUTING.decode(data)
    except msgspec.DecodeError:
        return False
    return True


@settings(max_examples=20)
@given(st.lists(payloads, min_size=1, max_size=8))
def test_garbage_on_the_routing_subject_is_dropped_and_the_next_table_installs(
    batch: list[bytes],
) -> None:
    garbage = [data for data in batch if not _decodes(data)]

    async def main() -> None:
        async with memory_gateway() as rig:
            feed, bus = rig.gateway.feed, rig.gateway.bus
            for data in garbage:
                await bus.publish(subjects.ROUTING, data)
            table = RoutingUpdate(
                position=10**6,  # newer than anything: it must win
                routes={"qwen": (route("qwen-0", "http://127.0.0.1:9"),)},
                clusters=("qwen",),
            )
            await bus.publish(subjects.ROUTING, msgspec.json.encode(table))
            await until(lambda: rig.gateway.router.models() == ["qwen"], within=5)
            assert feed.dropped == len(garbage)

    asyncio.run(main())


@settings(max_examples=20)
@given(st.lists(st.tuples(frame_bytes, st.booleans()), min_size=1, max_size=8))
def test_garbage_on_the_tunnel_subject_is_refused_and_a_real_request_is_served(
    batch: list[tuple[bytes, bool]],
) -> None:
    async def main() -> None:
        bus = MemoryBus()
        upstream = await Upstream("llama-0").start()
        server = TunnelServer(
            bus, "n0", lambda replica, epoch: upstream.address if replica == "llama-0" else None
        )
        running = asyncio.create_task(server.run())
        try:
            await asyncio.wait_for(server.subscribed.wait(), 5)
            inbox = bus.new_inbox()
            answers = await bus.subscribe(inbox)
            for data, with_reply in batch:
                await bus.publish(subjects.tunnel("n0"), data, reply=inbox if with_reply else "")
            good = TunnelRequest(
                request_id="r1", replica_id="llama-0", epoch=1, method="GET", path="/health"
            )
            replies = await bus.subscribe(bus.new_inbox())
            await bus.publish(
                subjects.tunnel("n0"), frames.encode_request(good), reply=replies.subject
            )
            # An ACK comes first when the head takes over 50 ms (a loaded machine): skip it.
            head = frames.decode((await replies.next_msg(5.0)).data)
            if head.kind == frames.ACK:
                head = frames.decode((await replies.next_msg(5.0)).data)
            await replies.unsubscribe()
            assert head.kind == frames.HEAD, head
            assert isinstance(head.meta, frames.TunnelHead) and head.meta.status == 200
            # What the garbage got back: error frames with a one-line reason, nothing else.
            await answers.unsubscribe()
            async for msg in answers:
                frame = frames.decode(msg.data)
                if frame.kind == frames.ERROR:
                    assert isinstance(frame.meta, frames.TunnelError)
                    assert "\n" not in frame.meta.detail
        finally:
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            await upstream.stop()

    asyncio.run(main())
