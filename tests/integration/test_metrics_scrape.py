"""`--metrics-listen` on a real controller and agent: Prometheus scrapes them over HTTP."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.gateway_kit import free_port
from tests.integration.stack import Stack

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


async def _scrape(http: aiohttp.ClientSession, url: str) -> Samples:
    async with http.get(url) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = await response.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_controller_and_agent_serve_their_metrics(
    tmp_path: Path, nats_server_binary: Path
) -> None:
    controller_port, agent_port = free_port(), free_port()
    controller_url = f"http://127.0.0.1:{controller_port}/metrics"
    agent_url = f"http://127.0.0.1:{agent_port}/metrics"
    async with (
        Stack(
            tmp_path / "stack",
            agents=1,
            nats_binary=nats_server_binary,
            controller_args=["--metrics-listen", f"127.0.0.1:{controller_port}"],
            agent_args=["--metrics-listen", f"127.0.0.1:{agent_port}"],
        ) as stack,
        aiohttp.ClientSession() as http,
    ):
        controller: Samples = {}

        async def recorded() -> bool:
            nonlocal controller
            controller = await _scrape(http, controller_url)
            return controller.get(("gpumesh_controller_heartbeats_recorded_total", ()), 0) >= 1

        await stack.wait_until(recorded, timeout=15, why="a heartbeat recorded")
        assert controller["gpumesh_controller_leader", ()] == 1
        assert controller["gpumesh_controller_term", ()] >= 1
        assert controller["gpumesh_controller_nodes", (("health", "healthy"),)] == 1
        assert controller["gpumesh_controller_nodes", (("health", "offline"),)] == 0
        assert controller["gpumesh_controller_heartbeat_lag_seconds_count", ()] >= 1
        assert controller["gpumesh_controller_log_position", ()] > 0

        agent = await _scrape(http, agent_url)
        gpu0 = (("gpu", "0"), ("node", "node-0"))
        assert agent["gpumesh_agent_gpu_temperature_celsius", gpu0] == 35.0  # a fake GPU, idle
        assert agent["gpumesh_agent_gpu_memory_total_bytes", gpu0] == 24 * 2**30
        assert agent["gpumesh_agent_gpu_probe_ok", (("node", "node-0"),)] == 1
        assert agent["gpumesh_agent_registered", (("node", "node-0"),)] == 1

        # A hot GPU: the agent's next sample shows it, and the controller counts the node degraded.
        await stack.fault("node-0", "thermal", 95)

        async def degraded() -> bool:
            nonlocal controller
            controller = await _scrape(http, controller_url)
            return controller[("gpumesh_controller_nodes", (("health", "degraded"),))] == 1

        await stack.wait_until(degraded, timeout=15, why="the node degraded in the metrics")
        agent = await _scrape(http, agent_url)
        assert agent["gpumesh_agent_gpu_temperature_celsius", gpu0] == 95.0
        throttled = (*gpu0, ("reason", "sw_thermal_slowdown"))
        assert agent["gpumesh_agent_gpu_throttled", throttled] == 1
        health = "gpumesh_controller_events_total"
        assert controller[health, (("family", "node"), ("type", "node.health_changed"))] >= 1
