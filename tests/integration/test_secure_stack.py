"""`gpumesh up` is secured by default, and `gpumesh node revoke` cuts a node off for real: its
agent process stops its replicas and exits, the controller marks it offline and replaces them."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.integration.stack import echo_spec, kill_marked, marked_pids, pid_alive
from tests.integration.up_process import api, connect_admin, read_urls, reap, start_up, until
from wire.nats_access import SecurityLayout

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _gpumesh(data_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpumesh", "--data-dir", str(data_dir), *args],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def _agent_pid(marker: str, node_id: str) -> int:
    for pid in marked_pids(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent" in argv and node_id.encode() in argv:
            return pid
    return 0


async def test_revoking_a_node_cuts_it_off_and_its_replica_moves(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    marker = f"secure-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    up = start_up(data_dir, marker, nodes=3)
    try:
        _, nats = await asyncio.wait_for(asyncio.to_thread(read_urls, up), timeout=40)
        assert nats.startswith("tls://"), (tmp_path / "up.log").read_text()[-2000:]
        layout = SecurityLayout(data_dir)
        assert oct(layout.creds("node-0").stat().st_mode & 0o777) == "0o600"
        # The CLI finds the admin credentials through the data directory.
        listed = _gpumesh(data_dir, "nodes", "--json")
        assert listed.returncode == 0, listed.stderr
        bus = await connect_admin(data_dir, nats, "test-secure")
        try:
            await api(bus, "cluster.create", echo_spec(2))

            async def placed() -> list[dict[str, object]]:
                cluster = await api(bus, "cluster.get", {"name": "echo"})
                ready = [r for r in cluster["replicas"] if r["status"] == "ready"]
                return ready if len(ready) == 2 else []

            ready = await until(placed, 30, "2 echo replicas ready")
            victim = str(ready[0]["node_id"])
            agent = _agent_pid(marker, victim)
            assert agent, f"no agent process for {victim}"

            revoked = _gpumesh(data_dir, "node", "revoke", victim)
            assert revoked.returncode == 0, revoked.stderr
            assert "reloaded" in revoked.stdout

            async def agent_gone() -> bool:
                return not pid_alive(agent)

            await until(agent_gone, 30, f"the revoked agent {victim} exits")
            log = (data_dir / "logs" / f"agent-{victim}.log").read_text()
            assert "refuses node" in log and "replicas are stopped" in log

            async def moved() -> bool:
                nodes = {n["node_id"]: n["health"] for n in await api(bus, "node.list", {})}
                cluster = await api(bus, "cluster.get", {"name": "echo"})
                serving = {r["node_id"] for r in cluster["replicas"] if r["status"] == "ready"}
                return nodes[victim] == "offline" and len(serving) == 2 and victim not in serving

            await until(moved, 30, f"{victim} offline and its replica ready elsewhere")
            # And it cannot come back with the same credentials.
            again = _gpumesh(data_dir, "certs", "list", "--json")
            assert f'"name":"{victim}"' in again.stdout and '"revoked_at":"20' in again.stdout
        finally:
            await bus.close()
        up.send_signal(signal.SIGINT)
        await asyncio.to_thread(up.wait, 30)
    finally:
        reap(up)
        await asyncio.to_thread(kill_marked, marker)
