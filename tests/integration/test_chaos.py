"""`gpumesh chaos` end to end: a short scenario against a real `gpumesh up` started by the test.

`gpumesh up` runs NATS, the controller (in its process), the gateway and four agent processes;
the test marks it with STACK_ENV so every process it causes (agents, workloads, an agent chaos
started again under its keeper) can be found in /proc and must be gone once `up` has stopped.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.nats_bus import NatsBus
from events import subjects
from events.messages import ApiReply
from tests.integration.stack import STACK_ENV, echo_spec, kill_marked, marked_pids, pid_alive

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


def _start_up(data_dir: Path, marker: str) -> subprocess.Popen[bytes]:
    """`gpumesh up` with 4 agents and a gateway on a free port, marked with `marker`."""
    data_dir.mkdir(parents=True)
    with (data_dir.parent / "up.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "up", "--data-dir", str(data_dir), "--nodes", "4",
             "--gateway", "127.0.0.1:0", "--log-format", "json"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, STACK_ENV: marker, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )  # fmt: skip


def _urls(up: subprocess.Popen[bytes]) -> tuple[str, str]:
    """The gateway and NATS URLs from the summary `gpumesh up` prints once it is up."""
    assert up.stdout is not None
    gateway = nats = ""
    for raw in up.stdout:
        line = raw.decode().strip()
        if line.startswith("gateway:"):
            gateway = line.split()[1].removesuffix("/v1")
        elif line.startswith("NATS:"):
            nats = line.split()[1]
        elif line.startswith("stop:"):
            break
    return gateway, nats


async def _api(bus: NatsBus, verb: str, body: object) -> Any:
    raw = await bus.request(subjects.api(verb), msgspec.json.encode(body), timeout=30.0)
    reply = msgspec.json.decode(raw.data, type=ApiReply)
    assert reply.ok, reply.error
    return reply.data


async def _until(predicate: Any, timeout: float, why: str) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        assert loop.time() < deadline, f"not within {timeout:g} s: {why}"
        await asyncio.sleep(0.2)


async def test_power_loss_on_the_real_stack_reads_like_the_simulator(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    marker = f"chaos-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    up = _start_up(data_dir, marker)
    try:
        gateway, nats = await asyncio.wait_for(asyncio.to_thread(_urls, up), timeout=40)
        assert gateway and nats, (tmp_path / "up.log").read_text()[-2000:]
        bus = await NatsBus.connect(nats, name="test-chaos")
        try:
            # A cluster placed before the run, so that the victim named holds a replica.
            await _api(bus, "cluster.create", echo_spec(2))

            async def placed() -> str:
                cluster = await _api(bus, "cluster.get", {"name": "echo"})
                ready = [r for r in cluster["replicas"] if r["status"] == "ready"]
                return ready[0]["node_id"] if len(ready) == 2 else ""

            victim = await _until(placed, 30, "2 echo replicas ready")
            scenario = tmp_path / "short.toml"
            scenario.write_text(SCENARIO.format(victim=victim))
            done = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "gpumesh", "chaos", str(scenario), "--data-dir",
                 str(data_dir), "--gateway", gateway, "--json"],
                capture_output=True, timeout=60, check=False,
                env={**os.environ, STACK_ENV: marker},
            )  # fmt: skip
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
                nodes = await _api(bus, "node.list", {})
                return any(n["node_id"] == victim and n["health"] == "healthy" for n in nodes)

            await _until(back, 15, f"{victim} healthy again after the run")
        finally:
            await bus.close()
        # `gpumesh up` stops its agents; the keeper stops the agent chaos started again.
        up.send_signal(signal.SIGINT)
        await asyncio.to_thread(up.wait, 30)

        async def gone() -> bool:
            return not [p for p in marked_pids(marker) if pid_alive(p)]

        await _until(gone, 25, "every process of the stack gone after `gpumesh up` stopped")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(up.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            up.wait(10)
        if up.stdout is not None:
            up.stdout.close()
        left = await asyncio.to_thread(kill_marked, marker)
        assert left == []
