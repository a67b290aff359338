"""`gpumesh status` against a real stack (nats-server, a controller process, two agents).

`--once` and `--json` run in this process through `gpumesh.cli.main`, as in
tests/integration/test_cluster_cli.py; the live loop (`gpumesh.status.watch`) runs on a real
NATS connection, and a cluster created behind it must reach the screen through the events
subject, with no polling of its own.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from gpumesh import status
from gpumesh.cli import main
from tests.integration.stack import Stack, echo_spec
from wire.nats_bus import NatsBus

pytestmark = pytest.mark.integration


async def test_status_once_json_and_live(
    tmp_path: Path, nats_server_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with Stack(tmp_path / "stack", agents=2, nats_binary=nats_server_binary) as stack:
        common = ["--nats", stack.url, "--data-dir", str(stack.root), "--log-level", "warning"]

        async def cli(*argv: str) -> str:
            capsys.readouterr()
            code = await asyncio.to_thread(main, ["status", *argv, *common])
            out, err = capsys.readouterr()
            assert code == 0, err
            return out

        # The live loop first: it must show the cluster once the events say it changed.
        bus = await NatsBus.connect(stack.url, name="test-status", reconnect_wait=0.1)
        shown: list[dict[str, Any]] = []
        changed = asyncio.Event()

        def show(data: dict[str, Any]) -> None:
            shown.append(data)
            changed.set()

        try:
            source = status.StatusSource(bus, stack.url)
            async with asyncio.TaskGroup() as tg:
                # idle_s far beyond the test: only an event can cause the second refresh.
                watching = tg.create_task(status.watch(bus, source, show, idle_s=600))
                await asyncio.wait_for(changed.wait(), 10)
                assert shown[0]["error"] == "" and shown[0]["clusters"] == []
                assert [n["node_id"] for n in shown[0]["nodes"]] == ["node-0", "node-1"]
                await stack.create_cluster(echo_spec(1))
                while not any(r["status"] == "ready" for r in shown[-1]["replicas"]):
                    changed.clear()
                    await asyncio.wait_for(changed.wait(), 20)
                watching.cancel()
        finally:
            await bus.close()
        assert shown[-1]["clusters"][0]["name"] == "echo"
        assert any(e["type"] == "cluster.created.v1" for e in shown[-1]["events"])

        data = json.loads(await cli("--json"))
        assert [(n["node_id"], n["health"], n["gpus"]) for n in data["nodes"]] == [
            ("node-0", "healthy", 2),
            ("node-1", "healthy", 2),
        ]
        assert [(c["name"], c["ready"], c["desired"]) for c in data["clusters"]] == [("echo", 1, 1)]
        (replica,) = data["replicas"]
        assert replica["replica_id"] == "echo-0" and replica["status"] == "ready"
        assert replica["epoch"] == 1 and replica["node_id"] in ("node-0", "node-1")
        assert 0 < len(data["events"]) <= status.EVENTS_SHOWN
        assert not any(e["type"] == "node.heartbeat.v1" for e in data["events"])

        text = await cli("--once")
        rows = [line.split() for line in text.splitlines()]
        assert text.startswith(f"gpumesh status  {stack.url}  at ")
        for node_id in ("node-0", "node-1"):
            assert [node_id, "healthy"] in [row[:2] for row in rows]
        assert ["echo", "1/1", "1", "-"] in rows
        assert ["echo-0", "echo", "1", "ready", replica["node_id"]] in rows
        assert "\x1b" not in text  # not a terminal: plain text
