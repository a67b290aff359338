"""The spec's `[probes]` section with the real ProcessDriver and a tiny HTTP workload on
127.0.0.1: separate readiness and liveness paths, the readiness timeout, and the liveness
failures in a row that end a workload."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from events import MemoryEventStore
from events.cluster import ClusterSpec, ProbeSpec
from events.contract.messages import ReplicaState, StartReplica
from nodeagent.config import AgentConfig, RestartPolicy
from nodeagent.replica import ReplicaRunner
from nodeagent.workload.fake import FakeDriver
from nodeagent.workload.probing import ProbeSettings
from nodeagent.workload.process import ProcessDriver, ProcessWorkload
from runtime.real_env import real_env
from sim import run_simulation

pytestmark = pytest.mark.integration

WORKLOAD = Path(__file__).with_name("probe_workload.py")
# The agent's own settings: patient, so that every short timeout below is the spec's.
AGENT = ProbeSettings(
    readiness_timeout_s=20.0,
    readiness_interval_s=0.05,
    liveness_interval_s=5.0,
    liveness_failures=10,
    request_timeout_s=1.0,
)


def spec(probes: ProbeSpec, *, ready_after: float = 0.0) -> ClusterSpec:
    command = (
        f"{shlex.quote(sys.executable)} {shlex.quote(str(WORKLOAD))} {{port}} "
        f"--ready-after {ready_after:g}"
    )
    # No /health on this workload: probing the old default path would never pass.
    return ClusterSpec(name="probed", command=command, probes=probes)


@pytest.fixture
def driver(tmp_path: Path) -> ProcessDriver:
    return ProcessDriver(tmp_path / "logs", probes=AGENT)


@pytest.fixture
async def started() -> AsyncIterator[list[ProcessWorkload]]:
    workloads: list[ProcessWorkload] = []
    yield workloads
    for workload in workloads:
        await workload.stop(0)


async def get(url: str) -> str:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(url) as response,
    ):
        return await response.text()


async def hits(workload: ProcessWorkload) -> dict[str, int]:
    result: dict[str, int] = json.loads(await get(f"http://127.0.0.1:{workload.port}/hits"))
    return result


async def test_a_replica_loading_within_its_readiness_timeout_becomes_ready(
    driver: ProcessDriver, started: list[ProcessWorkload]
) -> None:
    probes = ProbeSpec(readiness_path="/ready", readiness_timeout_s=10.0)
    workload = await driver.start("r1", 1, spec(probes, ready_after=2.0), (), 0)
    started.append(workload)
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert await workload.wait_ready() is None  # 503 for 2 s: still loading, not killed
    assert loop.time() - began >= 1.5
    assert workload.returncode is None
    seen = await hits(workload)
    assert seen["/ready"] > 2 and "/health" not in seen


async def test_a_replica_not_ready_within_its_readiness_timeout_is_a_readiness_timeout(
    driver: ProcessDriver, started: list[ProcessWorkload]
) -> None:
    probes = ProbeSpec(readiness_path="/ready", readiness_timeout_s=0.5)
    workload = await driver.start("r2", 1, spec(probes, ready_after=60.0), (), 0)
    started.append(workload)
    ended = await asyncio.wait_for(workload.wait_ready(), 10)  # the agent's 20 s would not do
    assert ended is not None and ended.reason == "readiness_timeout"
    assert f"http://127.0.0.1:{workload.port}/ready within 0.5 s" in ended.detail
    assert "HTTP 503" in ended.detail


async def test_liveness_probes_its_own_path_and_ends_only_after_n_failures_in_a_row(
    driver: ProcessDriver, started: list[ProcessWorkload]
) -> None:
    probes = ProbeSpec(
        readiness_path="/ready",
        liveness_path="/live",
        liveness_interval_s=0.05,
        liveness_failures=3,
        liveness_timeout_s=1.0,
    )
    workload = await driver.start("r3", 1, spec(probes), (), 0)
    started.append(workload)
    assert await workload.wait_ready() is None
    assert "/live" not in await hits(workload)  # readiness probes the readiness path only
    base = f"http://127.0.0.1:{workload.port}"
    async with asyncio.timeout(15), asyncio.TaskGroup() as group:
        watching = group.create_task(workload.wait_ended())
        # Two failures in a row, then answers again: alive.
        live = (await hits(workload)).get("/live", 0)
        await get(f"{base}/fail?n=2")
        # Polling: the workload's counters are the only signal it gives.
        while (await hits(workload)).get("/live", 0) < live + 2 + 3:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        assert not watching.done()
        # Three in a row: dead.
        await get(f"{base}/fail?n=3")
    ended = watching.result()
    assert ended.reason == "liveness_failed"
    assert f"3 failed health checks in a row (last: GET {base}/live: HTTP 500)" in ended.detail
    seen = await hits(workload)
    assert "/health" not in seen and seen["/ready"] >= 1
    assert workload.returncode is None  # still running: the agent stops it


async def test_the_agent_reports_a_readiness_timeout_from_the_spec(tmp_path: Path) -> None:
    reports: list[ReplicaState] = []

    async def publish(state: ReplicaState) -> None:
        reports.append(state)

    probes = ProbeSpec(readiness_path="/ready", readiness_timeout_s=0.3)
    command = StartReplica(
        command_id="c1", replica_id="r4", epoch=1, spec=spec(probes, ready_after=60.0)
    )
    runner = ReplicaRunner(
        command,
        env=real_env(MemoryEventStore(), seed=1),
        driver=ProcessDriver(tmp_path / "logs", probes=AGENT),
        config=AgentConfig(node_id="n1", stop_grace_s=1.0, restart=RestartPolicy(max_restarts=0)),
        publish=publish,
    )
    await asyncio.wait_for(runner.run(), 15)
    assert [r.state for r in reports] == ["starting", "failed"]
    assert "readiness_timeout" in reports[-1].detail and "/ready within 0.3 s" in reports[-1].detail


def test_the_fake_driver_keeps_a_spec_s_readiness_timeout_as_the_real_drivers_do() -> None:
    """The simulator's workloads honour `[probes] readiness_timeout_s`: one still loading when
    the timeout ends is reported `readiness_timeout`; within it, ready."""

    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        seen: list[tuple[str, float]] = []
        driver = FakeDriver(ready_delay_s=10.0)
        for timeout in (5.0, 20.0, None):
            spec = ClusterSpec(name="x", command="c", probes=ProbeSpec(readiness_timeout_s=timeout))
            began = loop.time()
            workload = await driver.start("x-0", 1, spec, (), 0)
            ended = await workload.wait_ready()
            seen.append((ended.reason if ended else "ready", loop.time() - began))
        return seen

    assert run_simulation(main()) == [
        ("readiness_timeout", 5.0),
        ("ready", 10.0),
        ("ready", 10.0),  # unset: the agent's 300 s
    ]
