"""JetStreamCommandQueue: durable, deduplicated, redelivered, and alive across a restart."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest
import structlog

from events import ClusterSpec
from events.contract import subjects
from events.contract.messages import Command, StartReplica, StopReplica
from wire.nats_bus import NatsBus
from wire.nats_commands import JetStreamCommandQueue, JetStreamDelivery, consumer_name
from wire.nats_server import EmbeddedNats

from .helpers import reconnected

pytestmark = pytest.mark.integration


def start(n: int) -> StartReplica:
    return StartReplica(
        command_id=f"cmd-{n}",
        replica_id=f"llama-{n}",
        epoch=1,
        spec=ClusterSpec(name="llama", command="serve --port {port}"),
        gpu_indices=(0,),
    )


async def next_delivery(
    consumer: AsyncIterator[JetStreamDelivery], timeout: float = 10.0
) -> JetStreamDelivery:
    async with asyncio.timeout(timeout):
        return await anext(consumer)


@pytest.fixture
async def queue(bus: NatsBus) -> JetStreamCommandQueue:
    return await JetStreamCommandQueue.create(bus, ack_wait=1.0, poll_interval=0.5)


async def test_a_command_sent_before_the_consumer_starts_is_delivered(
    queue: JetStreamCommandQueue, bus: NatsBus
) -> None:
    await queue.send("gpu-1", start(1))
    await queue.send("gpu-2", start(2))  # another node's: never seen by gpu-1
    stop = StopReplica(command_id="cmd-3", replica_id="llama-1", epoch=1, reason="scale down")
    await queue.send("gpu-1", stop)

    async with contextlib.aclosing(queue.consume("gpu-1")) as consumer:
        first = await next_delivery(consumer)
        assert first.command == start(1)
        assert first.delivery_count == 1
        await first.ack()
        await first.ack()  # a second ack is a no-op
        second = await next_delivery(consumer)
        assert second.command == stop
        await second.ack()

    info = await bus.jetstream().consumer_info(subjects.COMMANDS_STREAM, consumer_name("gpu-1"))
    assert info.num_pending == 0 and info.num_ack_pending == 0
    # A work queue deletes what was acknowledged: only gpu-2's command is left.
    stream = await bus.jetstream().stream_info(subjects.COMMANDS_STREAM)
    assert stream.state.messages == 1
    assert stream.config.duplicate_window == 600
    assert stream.config.storage == "file"
    assert stream.config.retention == "workqueue"


async def test_a_resent_command_id_is_stored_once(
    queue: JetStreamCommandQueue, bus: NatsBus
) -> None:
    await queue.send("gpu-1", start(1))
    await queue.send("gpu-1", start(1))  # e.g. the controller retried after a lost ack
    await queue.send("gpu-1", start(2))
    stream = await bus.jetstream().stream_info(subjects.COMMANDS_STREAM)
    assert stream.state.messages == 2

    async with contextlib.aclosing(queue.consume("gpu-1")) as consumer:
        got = [await next_delivery(consumer) for _ in range(2)]
        assert [d.command.command_id for d in got] == ["cmd-1", "cmd-2"]
        for delivery in got:
            await delivery.ack()

    # Acknowledged (and so deleted from the work queue), yet still remembered as seen: a late
    # retry inside the duplicate window does not run the command a second time.
    await queue.send("gpu-1", start(1))
    stream = await bus.jetstream().stream_info(subjects.COMMANDS_STREAM)
    assert stream.state.messages == 0


async def test_an_unacked_command_is_redelivered_to_the_next_consumer(
    queue: JetStreamCommandQueue,
) -> None:
    await queue.send("gpu-1", start(1))
    async with contextlib.aclosing(queue.consume("gpu-1")) as crashed:
        unacked = await next_delivery(crashed)
        assert unacked.command == start(1)
        # ... and the agent dies before acknowledging.

    async with contextlib.aclosing(queue.consume("gpu-1")) as restarted:
        again = await next_delivery(restarted, timeout=10)  # after ack_wait (1 s)
        assert again.command == start(1)
        assert again.delivery_count == 2
        await again.ack()


async def test_an_undecodable_command_is_terminated_and_skipped(
    queue: JetStreamCommandQueue, bus: NatsBus
) -> None:
    js = bus.jetstream()
    await js.publish(subjects.command("gpu-1"), b'{"type": "cmd.explode.v9"}')
    await js.publish(subjects.command("gpu-1"), b"not json at all")
    await queue.send("gpu-1", start(1))
    with structlog.testing.capture_logs() as logs:
        async with contextlib.aclosing(queue.consume("gpu-1")) as consumer:
            good = await next_delivery(consumer)
            assert good.command == start(1)
            await good.ack()
    assert [e["event"] for e in logs].count("command_undecodable") == 2
    stream = await js.stream_info(subjects.COMMANDS_STREAM)
    assert stream.state.messages == 0  # terminated ones are gone too: no redelivery


async def test_the_queue_keeps_working_across_a_server_restart(
    nats_server: EmbeddedNats, queue: JetStreamCommandQueue, bus: NatsBus
) -> None:
    received: asyncio.Queue[Command] = asyncio.Queue()

    async def agent() -> None:
        async with contextlib.aclosing(queue.consume("gpu-1")) as consumer:
            async for delivery in consumer:
                await delivery.ack()  # before the test may stop the server
                await received.put(delivery.command)

    await queue.send("gpu-1", start(1))
    async with asyncio.TaskGroup() as tg:
        task = tg.create_task(agent())
        assert await asyncio.wait_for(received.get(), 10) == start(1)

        back = await reconnected(bus)
        await nats_server.stop()
        await nats_server.start()
        await asyncio.wait_for(back.wait(), 10)

        await queue.send("gpu-1", start(2))
        assert await asyncio.wait_for(received.get(), 15) == start(2)
        task.cancel()
    info = await bus.jetstream().consumer_info(subjects.COMMANDS_STREAM, consumer_name("gpu-1"))
    assert info.num_pending == 0


async def test_a_command_waits_on_disk_through_a_restart(
    nats_server: EmbeddedNats, queue: JetStreamCommandQueue, bus: NatsBus
) -> None:
    await queue.send("gpu-1", start(1))
    back = await reconnected(bus)
    await nats_server.stop()
    await nats_server.start()
    await asyncio.wait_for(back.wait(), 10)
    async with contextlib.aclosing(queue.consume("gpu-1")) as consumer:
        delivery = await next_delivery(consumer)
        assert delivery.command == start(1)
        await delivery.ack()


async def test_node_ids_are_checked(queue: JetStreamCommandQueue) -> None:
    with pytest.raises(ValueError, match="invalid node id"):
        await queue.send("gpu.1", start(1))
    with pytest.raises(ValueError, match="invalid node id"):
        queue.consume("gpu-*")
