"""A node preempted with notice costs no request, end to end with real processes.

An agent started with `--leave-grace 30` gets SIGTERM (a spot preemption) while clients keep
sending, half streaming: it tells the controller it is leaving, the controller drains its
node, places the replicas elsewhere, routes to them once ready and only then stops the ones
there; the agent serves until they are stopped and exits, well within its notice. When it
comes back it registers, and the drain for leaving is taken back.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.gateway_kit import running_gateway, until
from tests.integration.stack import Stack, echo_spec
from tests.integration.test_failover_processes import serving
from tests.integration.test_gateway_stack import start_clients

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.mark.timeout(150)
async def test_a_node_preempted_with_notice_costs_no_request(
    tmp_path: Path, nats_server_binary: Path
) -> None:
    stack = Stack(
        tmp_path / "stack",
        agents=3,
        nats_binary=nats_server_binary,
        agent_args=["--leave-grace", "30"],
    )
    async with stack:
        await stack.create_cluster(echo_spec(2))
        cluster = await serving(stack, 2)
        victim = cluster["replicas"][0]["node_id"]
        agent = stack.agents[victim]
        async with running_gateway(stack.bus) as gw:
            await until(lambda: len(gw.router.routes("echo")) >= 2, within=10)
            stop = asyncio.Event()
            log: list[Any] = []
            async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tasks:
                start_clients(tasks, session, gw.url, stop, log)
                await asyncio.sleep(1.0)
                sent_at = time.monotonic()
                agent.popen.terminate()  # SIGTERM: the provider's notice
                exited = asyncio.ensure_future(asyncio.to_thread(agent.popen.wait, 40))
                routed = []  # how many replicas the gateway routes to, sampled meanwhile
                while not exited.done():
                    routed.append(len(gw.router.routes("echo")))
                    await asyncio.sleep(0.02)
                code = await exited
                left_after = time.monotonic() - sent_at
                await asyncio.sleep(1.0)
                stop.set()
        assert code == 0, stack.log_tail(agent.log_path)
        assert left_after < 20.0, left_after  # replaced well within its 30 s notice
        failed = [
            e for e in log if e[2] != 200 or not e[3].rstrip().endswith(("data: [DONE]", "}"))
        ]
        assert log and failed == [], failed[:3]
        # Capacity held: the replacement served before the leaving replica stopped (stopping
        # at once instead, the gateway routed to one replica until the replacement was ready).
        assert min(routed) >= 2, routed
        cluster = await stack.cluster("echo")
        ready = [r for r in cluster["replicas"] if r["status"] == "ready"]
        assert len(ready) == 2 and victim not in {r["node_id"] for r in ready}, cluster
        assert all(r["status"] == "stopped" for r in cluster["replicas"] if r["node_id"] == victim)
        [drained] = stack.events("node.drained.v1")
        assert drained.payload.leaving and "leaving within 30 s" in drained.payload.reason  # type: ignore[attr-defined]
        assert stack.events("node.health_changed.v1", state="offline") == []  # not before it left
        stack.start_agent(victim)
        await stack.wait_until(
            lambda: bool(stack.events("node.undrained.v1")), timeout=20, why="back, undrained"
        )
