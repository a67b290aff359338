"""Inference survives the loss of the controller: real processes, kill -9.

A controller process, agent processes with echo workloads, and the gateway; clients keep
sending, half of them streaming, while the controller is SIGKILLed and stays down for several
leases, then is started again. Agents still connected to NATS keep serving on their last lease
(their heartbeats are answered "no responders"); the restarted controller waits out its grace.
No request may fail: a replica could always serve. Before, every request failed with 502 from
1.5 s after the kill (the agents' leases lapsed and they fenced every replica).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.gateway_kit import running_gateway, until
from tests.integration.stack import Stack, echo_spec, started_stack
from tests.integration.test_failover_processes import serving
from tests.integration.test_gateway_stack import start_clients

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DOWN_S = 8.0  # more than three leases (2.4 s each) and the offline window


@pytest.fixture
async def stack(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[Stack]:
    async with started_stack(tmp_path / "stack", 3, nats_server_binary) as s:
        yield s


@pytest.mark.timeout(120)
async def test_requests_keep_succeeding_while_the_controller_is_killed_and_back(
    stack: Stack,
) -> None:
    await stack.create_cluster(echo_spec(3))
    cluster = await serving(stack, 3)
    placed = {(r["replica_id"], r["epoch"]) for r in cluster["replicas"]}
    async with running_gateway(stack.bus) as gw:
        await until(lambda: len(gw.router.routes("echo")) >= 3, within=10)
        stop = asyncio.Event()
        log: list[Any] = []
        async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tasks:
            start_clients(tasks, session, gw.url, stop, log)
            await asyncio.sleep(1.0)
            await stack.kill_controller()
            killed_at = time.monotonic()
            await asyncio.sleep(DOWN_S)
            back_at = time.monotonic()
            await stack.start_controller()
            # Past the restarted controller's grace: it has heard every node by then.
            await asyncio.sleep(6.0)
            stop.set()
    during = [e for e in log if killed_at + 2.5 <= e[0] < back_at]
    after = [e for e in log if e[0] >= back_at]
    assert during and after, (len(during), len(after))
    failed = [e for e in log if e[2] != 200 or not e[3].rstrip().endswith(("data: [DONE]", "}"))]
    assert failed == [], failed[:3]
    # Nothing was moved: the same replicas at the same epochs serve before and after.
    cluster = await serving(stack, 3)
    assert {(r["replica_id"], r["epoch"]) for r in cluster["replicas"]} == placed
    assert stack.events("node.health_changed.v1", state="offline") == []
    graces = stack.events("controller.grace.v1")
    assert [g.payload.reason for g in graces] == ["started", "started"]  # type: ignore[attr-defined]


@pytest.mark.timeout(90)
async def test_a_gateway_started_while_no_controller_runs_routes_on_the_last_table(
    stack: Stack,
) -> None:
    await stack.create_cluster(echo_spec(2))
    cluster = await serving(stack, 2)
    await stack.kill_controller()
    # No controller answers routing.get: the table comes from JetStream (wire/routing_log.py).
    async with running_gateway(stack.bus) as gw, aiohttp.ClientSession() as session:
        assert {r.replica_id for r in gw.router.routes("echo")} == {
            r["replica_id"] for r in cluster["replicas"]
        }
        body = {"model": "echo", "messages": [{"role": "user", "content": "no controller"}]}
        for _ in range(6):  # past a lease: the agents keep serving while nobody answers
            async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                assert resp.status == 200, await resp.text()
            await asyncio.sleep(0.5)
