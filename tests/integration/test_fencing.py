"""Fencing with real processes: a node that comes back from a partition (its agent SIGSTOPped
past the offline window, then continued) refuses a stale gateway's request for the replica the
controller replaced meanwhile, over the overlay (the tunnel) and over the direct transport (the
node's HTTP front at the replica's advertised address), while the replacement serves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import aiohttp
import pytest

from events.contract import tunnel
from events.contract.tunnel import TunnelError, TunnelHead, TunnelRequest
from tests.integration.stack import Stack, echo_spec

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHAT = b'{"model": "echo", "messages": [{"role": "user", "content": "fenced?"}]}'


async def _ask(stack: Stack, node_id: str, replica_id: str, epoch: int) -> tunnel.Frame:
    """What a gateway's overlay transport does: one REQUEST frame to the node's tunnel; the
    first answer frame that is not an ACK."""
    inbox = stack.bus.new_inbox()
    frames = await stack.bus.subscribe(inbox)
    try:
        request = TunnelRequest(
            request_id=f"fence-{replica_id}-{epoch}",
            replica_id=replica_id,
            epoch=epoch,
            method="POST",
            path="/v1/chat/completions",
            headers=(("content-type", "application/json"),),
            timeout_s=5.0,
        )
        await stack.bus.publish(
            f"gpumesh.v1.node.{node_id}.tunnel", tunnel.encode_request(request, CHAT), reply=inbox
        )
        while True:
            frame = tunnel.decode((await frames.next_msg(10.0)).data)
            if frame.kind != tunnel.ACK:
                return frame
    finally:
        await frames.unsubscribe()


async def _direct(address: str) -> tuple[int, bytes]:
    """What the direct transport does: POST to the route's address plus the path."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            address + "/v1/chat/completions",
            data=CHAT,
            headers={"content-type": "application/json"},
        ) as resp,
    ):
        return resp.status, await resp.read()


async def test_a_node_back_from_a_partition_cannot_serve_its_superseded_replica(
    tmp_path: Path, nats_server_binary: Path
) -> None:
    async with Stack(
        tmp_path / "stack", agents=3, heartbeat_interval=0.5, nats_binary=nats_server_binary
    ) as stack:
        await stack.create_cluster(echo_spec(1))

        async def placed() -> dict[str, Any] | None:
            replicas = (await stack.cluster("echo"))["replicas"]
            ready = [r for r in replicas if r["status"] == "ready"]
            return ready[0] if ready else None

        first = await stack.wait_until(placed, timeout=30, why="echo-0 ready")
        node, replica, epoch = first["node_id"], first["replica_id"], first["epoch"]
        # Before the partition the node serves it over the tunnel: the refusal below is real.
        served = await _ask(stack, node, replica, epoch)
        assert isinstance(served.meta, TunnelHead) and served.meta.status == 200, served
        old_address = first["address"]
        assert old_address.endswith(f"/replica/{replica}/{epoch}"), old_address
        assert (await _direct(old_address))[0] == 200

        stack.stop_agent(node)  # a partition: the agent is silent, its workload runs on

        async def replaced() -> dict[str, Any] | None:
            now = await placed()
            return now if now and now["epoch"] > epoch and now["node_id"] != node else None

        second = await stack.wait_until(replaced, timeout=30, why="echo-0 replaced elsewhere")
        stack.cont_agent(node)  # the partition heals; a stale gateway still routes to it
        refused = await _ask(stack, node, replica, epoch)
        assert isinstance(refused.meta, TunnelError), refused
        assert refused.meta.reason in ("fenced", "unknown_replica"), refused.meta
        # A stale gateway on the direct transport, at the address its old table holds.
        status, body = await _direct(old_address)
        assert status == 503 and b'"fenced"' in body, (status, body)
        assert (await _direct(second["address"]))[0] == 200
        # The replacement serves.
        now = await _ask(stack, second["node_id"], replica, second["epoch"])
        assert isinstance(now.meta, TunnelHead) and now.meta.status == 200, now
        # And the old workload is stopped once the node hears from the controller.
        log = (stack.logs / f"agent-{node}.log").read_text()
        assert "lease_granted" in log
