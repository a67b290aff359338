"""`gpumesh chaos` end to end: a short scenario against a real `gpumesh up` started by the test.

`gpumesh up` runs NATS, the controller (in its process), the gateway and four agent processes;
the test marks it with STACK_ENV so every process it causes (agents, workloads, an agent chaos
started again under its keeper) can be found in /proc and must be gone once `up` has stopped.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import uuid
from pathlib import Path

import pytest

from tests.integration.stack import echo_spec, kill_marked, marked_pids, pid_alive
from tests.integration.up_process import (
    api,
    connect_admin,
    read_urls,
    reap,
    run_chaos,
    start_up,
    until,
)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SCENARIO = """
name = "chaos-short"
duration_s = 12
settle_s = 8

[fleet]
nodes = 4

[[clusters]]
name = "echo"
replicas = 2

[[clusters]]
name = "solo"
replicas = 1

[traffic]
rate_per_s = 5

[[faults]]
at_s = 3
kind = "power_loss"
nodes = ["{victim}"]
duration_s = 5
"""


async def test_power_loss_on_the_real_stack_reads_like_the_simulator(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    marker = f"chaos-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    up = start_up(data_dir, marker)
    try:
        gateway, nats = await asyncio.wait_for(asyncio.to_thread(read_urls, up), timeout=40)
        assert gateway and nats, (tmp_path / "up.log").read_text()[-2000:]
        # `up` secures its NATS by default: the operator's CLI identity is `admin`.
        assert nats.startswith("tls://")
        bus = await connect_admin(data_dir, nats, "test-chaos")
        try:
            # A cluster placed before the run, so that the victim named holds a replica.
            await api(bus, "cluster.create", echo_spec(2))

            async def placed() -> str:
                cluster = await api(bus, "cluster.get", {"name": "echo"})
                ready = [r for r in cluster["replicas"] if r["status"] == "ready"]
                return ready[0]["node_id"] if len(ready) == 2 else ""

            victim = await until(placed, 30, "2 echo replicas ready")
            scenario = tmp_path / "short.toml"
            scenario.write_text(SCENARIO.format(victim=victim))
            done = await asyncio.to_thread(
                run_chaos,
                [str(scenario), "--data-dir", str(data_dir), "--gateway", gateway, "--json"],
                marker=marker,
                timeout=60,
            )
            err = done.stderr.decode(errors="replace")
            assert done.returncode == 0, err
            result = json.loads(done.stdout)
            assert result["violations"] == [], err
            detected = result["detection"]["power_loss"]
            assert detected["count"] == 1
            assert 0.5 < detected["p50"] < 6.0, detected  # heartbeat 1 s: offline after 3 missed
            assert result["replacement"]["power_loss"]["count"] == 1
            timeline = "\n".join(result["timeline"])
            assert "cluster echo exists (2 replicas): left as it is" in timeline
            assert "cluster solo created (1 replicas): True" in timeline
            assert f"fault  power_loss {victim}: SIGKILL agent" in timeline
            assert f"end    power_loss {victim}" in timeline
            assert result["availability"]["echo"]["sent"] > 20
            assert result["availability"]["echo"]["availability"] > 0.5, result["availability"]

            async def back() -> bool:
                nodes = await api(bus, "node.list", {})
                return any(n["node_id"] == victim and n["health"] == "healthy" for n in nodes)

            await until(back, 15, f"{victim} healthy again after the run")
        finally:
            await bus.close()
        # `gpumesh up` stops its agents; the keeper stops the agent chaos started again.
        up.send_signal(signal.SIGINT)
        await asyncio.to_thread(up.wait, 30)

        async def gone() -> bool:
            return not [p for p in marked_pids(marker) if pid_alive(p)]

        await until(gone, 25, "every process of the stack gone after `gpumesh up` stopped")
    finally:
        reap(up)
        left = await asyncio.to_thread(kill_marked, marker)
        assert left == []
