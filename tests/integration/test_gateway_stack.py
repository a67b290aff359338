"""The gateway in front of a real stack: a controller process, agent processes, echo workloads.

Clients keep sending through the gateway while a node loses power (SIGKILL of its agent and its
workload). Every non-streaming request must still succeed; a stream that was on the killed
replica may break, and must then end with the explicit SSE error event, never silently.
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

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
async def stack(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[Stack]:
    async with started_stack(tmp_path / "stack", 4, nats_server_binary) as s:
        yield s


def start_clients(
    tasks: asyncio.TaskGroup,
    session: aiohttp.ClientSession,
    url: str,
    stop: asyncio.Event,
    log: list[Any],
    count: int = 8,
) -> None:
    """`count` closed-loop clients, every other one streaming, until `stop`."""
    for i in range(count):
        tasks.create_task(_client(session, url, i % 2 == 1, stop, log))


async def _client(
    session: aiohttp.ClientSession, url: str, stream: bool, stop: asyncio.Event, log: list[Any]
) -> None:
    body = {
        "model": "echo",
        "stream": stream,
        "messages": [{"role": "user", "content": " ".join(f"w{i}" for i in range(12))}],
    }
    while not stop.is_set():
        started = time.monotonic()
        try:
            async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
                text = (await resp.read()).decode()
                log.append((started, stream, resp.status, text))
        except aiohttp.ClientError as exc:
            log.append((started, stream, -1, repr(exc)))


async def test_clients_see_no_errors_when_a_node_loses_power(stack: Stack) -> None:
    # A paced model, so that requests are in flight on the victim when it dies.
    spec = echo_spec(3)
    spec["command"] += " --ttft-ms 20 --tokens-per-s 400"
    await stack.create_cluster(spec)
    cluster = await serving(stack, 3)
    async with running_gateway(stack.bus) as gw:
        await _wait_routes(gw, 3)
        stop = asyncio.Event()
        log: list[Any] = []
        async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tasks:
            start_clients(tasks, session, gw.url, stop, log)
            await asyncio.sleep(1.0)
            victim = cluster["replicas"][0]
            await stack.kill_agent(victim["node_id"], with_workloads=True)
            killed_at = time.monotonic()
            await stack.wait_until(
                lambda: _replaced(stack, victim["replica_id"], victim["epoch"]),
                timeout=20,
                why="the killed replica replaced and routed",
            )
            await asyncio.sleep(0.5)
            stop.set()
    plain = [entry for entry in log if not entry[1]]
    streams = [entry for entry in log if entry[1]]
    after_kill = [e for e in plain if e[0] >= killed_at]
    assert plain and streams and after_kill
    assert [e for e in plain if e[2] != 200] == []  # no error where a replica could serve
    for started, _, status, text in streams:
        assert status == 200, text
        complete = text.rstrip().endswith("data: [DONE]")
        explicit = "event: error" in text
        assert complete or explicit, f"a stream ended silently: {text[-200:]!r}"
        if explicit:
            assert started < killed_at + 1.0  # only streams that were on the dying replica
    suspected = stack.events("replica.suspected.v1")
    assert all(e.payload.replica_id == victim["replica_id"] for e in suspected)  # type: ignore[attr-defined]


async def _wait_routes(gw: Any, count: int) -> None:
    await until(lambda: len(gw.router.routes("echo")) >= count, within=10)


async def _replaced(stack: Stack, replica_id: str, epoch: int) -> bool:
    routing = await stack.routing()
    return any(
        r["replica_id"] == replica_id and r["epoch"] > epoch
        for r in routing.get("routes", {}).get("echo", [])
    )
