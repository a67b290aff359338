"""The agent with the real ProcessDriver and the echo workload, on the real loop and a MemoryBus."""

from __future__ import annotations

import os
import shlex
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import aiohttp
import pytest

from events import MemoryEventStore
from events.cluster import ClusterSpec
from nodeagent.agent import Agent
from nodeagent.config import AgentConfig
from nodeagent.workload.probing import ProbeSettings
from nodeagent.workload.process import ProcessDriver, ProcessWorkload
from runtime.real_env import real_env

from .harness import NODE, Harness, start, stop

pytestmark = pytest.mark.integration

ECHO = ClusterSpec(
    name="chat",
    model="echo-7b",
    command=f"{shlex.quote(sys.executable)} -m nodeagent.workload.echo "
    "--port {port} --model {model}",
)


class RecordingDriver(ProcessDriver):
    """The real driver, remembering what it started so the test can crash it."""

    started: list[ProcessWorkload]

    async def start(
        self, replica_id: str, epoch: int, spec: ClusterSpec, gpu_indices: Sequence[int], port: int
    ) -> ProcessWorkload:
        workload = await super().start(replica_id, epoch, spec, gpu_indices, port)
        self.started.append(workload)
        return workload


async def test_the_agent_runs_restarts_and_stops_a_real_echo_process(tmp_path: Path) -> None:
    driver = RecordingDriver(
        tmp_path / "logs",
        probes=ProbeSettings(readiness_interval_s=0.05, liveness_interval_s=0.1),
    )
    driver.started = []
    h = Harness(config=AgentConfig(node_id=NODE, stop_grace_s=5.0))
    h.env = real_env(MemoryEventStore(), bus=h.bus, seed=1)
    h.agent = Agent(h.env, h.commands, h.probe, driver, h.config)
    async with h.running():
        await h.send(start(spec=ECHO, gpu_indices=(0, 1)))
        ready = (await h.reports.until(lambda r: r.state == "ready", timeout=30))[-1]
        await h.acked(timeout=5)
        url = f"{ready.address}/v1/chat/completions"
        request = {"messages": [{"role": "user", "content": "hello from the agent"}]}
        async with aiohttp.ClientSession() as session, session.post(url, json=request) as resp:
            answer = await resp.json()
        assert answer["choices"][0]["message"]["content"] == "hello from the agent"

        # Killed from outside: restarted in place, on the same port.
        os.kill(driver.started[0].pid, signal.SIGKILL)
        reports = await h.reports.until(lambda r: r.state == "ready", timeout=30)
        assert reports[0].detail == "restart 1 after exit code -9"
        assert reports[-1].address == ready.address

        await h.send(stop(grace_s=5.0))
        stopped = (await h.reports.until(lambda r: r.state == "stopped", timeout=30))[-1]
        await h.acked(timeout=5)
        assert stopped.exit_code == 0  # echo shuts down cleanly on SIGTERM
        assert all(w.returncode is not None for w in driver.started)
        log = driver.log_path("r1", 1).read_text()
        assert log.count("echo: serving model 'echo-7b'") == 2
