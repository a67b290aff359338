"""End to end over a real nats-server: `gpumesh agent` as a process registers, heartbeats,
takes a fault from `gpumesh agent fault`, runs the echo workload from a JetStream command and
stops it cleanly on SIGTERM."""

from __future__ import annotations

import asyncio
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from events.cluster import ClusterSpec
from events.contract import subjects
from events.contract.messages import (
    Heartbeat,
    Register,
    RegisterReply,
    ReplicaReport,
    StartReplica,
)

pytestmark = pytest.mark.integration

nats_server = pytest.importorskip("wire.nats_server")
nats_bus = pytest.importorskip("wire.nats_bus")
nats_commands = pytest.importorskip("wire.nats_commands")

REPO = Path(__file__).resolve().parents[2]
ECHO = ClusterSpec(
    name="chat",
    command=f"{shlex.quote(sys.executable)} -m nodeagent.workload.echo --port {{port}} "
    "--model {model}",
)


async def gpumesh(*argv: str, log: Path) -> asyncio.subprocess.Process:
    with log.open("ab") as out:
        return await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.nodeagent.cli_main", *argv,
            stdout=out, stderr=asyncio.subprocess.STDOUT, cwd=REPO,
        )  # fmt: skip


async def test_agent_over_nats_end_to_end(tmp_path: Path) -> None:
    async with nats_server.EmbeddedNats(tmp_path / "nats") as server:
        bus = await nats_bus.NatsBus.connect(server.url, name="test-controller")
        try:
            await scenario(bus, server.url, tmp_path)
        finally:
            await bus.close()


async def scenario(b: Any, url: str, tmp_path: Path) -> None:
    queue = await nats_commands.JetStreamCommandQueue.create(b)
    registers = await b.subscribe(subjects.register("n1"))
    heartbeats = await b.subscribe(subjects.heartbeat("n1"))
    reports = await b.subscribe(subjects.report("n1"))
    agent_log = tmp_path / "agent.log"
    agent = await gpumesh(
        "--data-dir", str(tmp_path), "agent", "--node-id", "n1", "--fake-gpus", "A100:80GiB:2",
        "--nats", url, "--stop-grace", "5", log=agent_log,
    )  # fmt: skip
    try:
        msg = await registers.next_msg(30)
        register = msgspec.json.decode(msg.data, type=Register)
        assert [g.model for g in register.gpus] == ["A100", "A100"]
        reply = RegisterReply(accepted=True, heartbeat_interval_s=0.2)
        await b.publish(msg.reply, msgspec.json.encode(reply))
        await heartbeats.next_msg(10)

        fault = await gpumesh(
            "agent", "fault", "n1", "thermal", "95", "--gpu", "1", "--nats", url,
            log=tmp_path / "fault.log",
        )  # fmt: skip
        assert await asyncio.wait_for(fault.wait(), 30) == 0
        assert "n1: thermal 95 applied to GPU 1" in (tmp_path / "fault.log").read_text()
        async with asyncio.timeout(10):
            while True:
                beat = msgspec.json.decode((await heartbeats.next_msg(10)).data, type=Heartbeat)
                if beat.gpus and beat.gpus[1].temperature_c == 95.0:
                    break

        await queue.send("n1", StartReplica(command_id="c1", replica_id="r1", epoch=1, spec=ECHO))
        async with asyncio.timeout(30):
            while True:
                state = msgspec.json.decode(
                    (await reports.next_msg(30)).data, type=ReplicaReport
                ).replica
                if state.state == "ready":
                    break
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"{state.address}/v1/models") as response,
        ):
            assert (await response.json())["data"][0]["id"] == "chat"

        agent.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(agent.wait(), 30) == 0
        stopped = msgspec.json.decode((await reports.next_msg(10)).data, type=ReplicaReport)
        assert (stopped.replica.state, stopped.replica.exit_code) == ("stopped", 0)
        with pytest.raises(aiohttp.ClientConnectorError):
            async with aiohttp.ClientSession() as session, session.get(state.address):
                pass
        replica_log = tmp_path / "logs" / "replicas" / "n1" / "r1-1.log"
        assert "echo: serving model 'chat'" in replica_log.read_text()
    finally:
        if agent.returncode is None:
            agent.kill()
            await agent.wait()
        if agent.returncode != 0:
            print(agent_log.read_text())  # shown by pytest when the test failed
