"""Scale to zero end to end, with real processes: a controller process, agent processes, echo
workloads, nats-server, and the gateway. A cluster at zero replicas takes a request: the
gateway holds it and reports the hold, the leader's autoscaler records a cold start and a
replica starts, the request is answered; idle, the cluster goes back to zero and its workload
stops."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from tests.integration.gateway_kit import running_gateway
from tests.integration.stack import Stack, echo_spec, started_stack

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
async def stack(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[Stack]:
    async with started_stack(tmp_path / "stack", 2, nats_server_binary) as s:
        yield s


async def test_a_request_at_zero_replicas_is_held_answered_and_the_cluster_returns_to_zero(
    stack: Stack,
) -> None:
    spec = echo_spec(0)
    spec["autoscale"] = {
        "min": 0,
        "max": 2,
        "up_window_s": 1,
        "down_window_s": 2,
        "scale_to_zero_after_s": 3,
        "cold_start_timeout_s": 60,
    }
    await stack.create_cluster(spec)
    async with running_gateway(stack.bus) as gw, aiohttp.ClientSession() as session:
        body = {"model": "echo", "messages": [{"role": "user", "content": "hello there"}]}
        sent = time.monotonic()
        async with session.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            text = await resp.text()
            assert resp.status == 200, text
        took = time.monotonic() - sent
        assert "hello there" in text

        [cold] = stack.events("cluster.scaled.v1")
        assert (cold.payload.previous, cold.payload.replicas) == (0, 1)
        assert "cold start" in cold.payload.cause
        assert cold.payload.inputs is not None and cold.payload.inputs.held >= 1
        assert stack.events("replica.ready.v1"), "the request was answered by a started replica"
        assert took < 30, took

        # Idle now: back to zero replicas, and the workload stops.
        await stack.wait_until(
            lambda: any(e.payload.replicas == 0 for e in stack.events("cluster.scaled.v1")[1:]),
            timeout=30,
        )
        back = stack.events("cluster.scaled.v1")[-1]
        assert "no request for" in back.payload.cause
        await stack.wait_until(lambda: not stack.workloads(), timeout=30)
