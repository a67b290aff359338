"""A heartbeat flood over a real nats-server, against a real controller process: the flooded
subject's excess is dropped and every other node stays healthy throughout."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from events.contract import subjects
from events.contract.messages import Heartbeat
from tests.integration.stack import Stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_a_flood_from_one_node_does_not_starve_the_others(
    tmp_path: Path, nats_server_binary: Path
) -> None:
    async with Stack(tmp_path / "stack", agents=2, nats_binary=nats_server_binary) as stack:
        beat = msgspec.json.encode(Heartbeat(node_id="node-0", seq=10**9, sent_at_ns=1))
        subject = subjects.heartbeat("node-0")
        sent = 0
        seen_unhealthy: list[str] = []
        flooding = True

        async def flood() -> None:
            # 20,000 heartbeats a second, 20,000 times the legitimate rate, for 4 intervals.
            # (Much faster than the controller can drop them, about 95,000 a second here, and
            # nats-server cuts the controller off as a slow consumer: docs/security.md.)
            nonlocal sent
            loop = asyncio.get_running_loop()
            start = loop.time()
            while (elapsed := loop.time() - start) < 4 * stack.heartbeat_interval:
                due = int(elapsed * 20_000) - sent
                for _ in range(due):
                    await stack.bus.publish(subject, beat)
                sent += max(due, 0)
                await asyncio.sleep(0.005)

        async def watch() -> None:
            while flooding:
                node = await stack.node("node-1")
                if node["health"] != "healthy":
                    seen_unhealthy.append(node["health"])
                await asyncio.sleep(0.2)

        async with asyncio.TaskGroup() as tasks:
            watcher = tasks.create_task(watch())
            await flood()
            flooding = False
            await watcher
        assert sent >= 60_000
        assert seen_unhealthy == []
        # Still answering, still hearing node-1, after the flood (one more interval).
        await stack.wait_until(
            stack._all_nodes_healthy, timeout=10, why="every node healthy after the flood"
        )
        log = (stack.logs / "controller-1.log").read_text()
        assert '"kind": "rate_limited"' in log
