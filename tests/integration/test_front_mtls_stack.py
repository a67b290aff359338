"""`gpumesh up`, secured by default, runs the nodes' fronts over mutual TLS with no flag
(issue 22, part 1), with real processes: its gateway reaches replicas through them, anyone
else is refused, the fence holds over TLS after a partition (as tests/integration/
test_fencing.py over plain HTTP), and `gpumesh certs revoke gateway` shuts the gateway out."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.integration.stack import echo_spec, kill_marked, marked_pids
from tests.integration.up_process import api, connect_admin, read_urls, reap, start_up, until
from wire.nats_access import SecurityLayout, load_credentials

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CHAT = b'{"model": "echo", "messages": [{"role": "user", "content": "fronted?"}]}'
PATH = "/v1/chat/completions"


def _agent_pid(marker: str, node_id: str) -> int:
    for pid in marked_pids(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"agent" in argv and node_id.encode() in argv:
            return pid
    return 0


async def _post(url: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http, http.post(url, data=CHAT, ssl=context) as reply:
        return reply.status, await reply.read()


def _tls(address: str) -> str:
    """A front's advertised address (http://...), dialled as the gateway dials it: TLS."""
    return address.replace("http://", "https://", 1) + PATH


@pytest.mark.timeout(150)
async def test_up_serves_through_mutual_tls_fronts_and_only_its_gateway(tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    marker = f"mtls-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    up = start_up(data_dir, marker, nodes=2)
    try:
        gateway, nats = await asyncio.wait_for(asyncio.to_thread(read_urls, up), timeout=40)
        assert nats.startswith("tls://"), (tmp_path / "up.log").read_text()[-2000:]
        layout = SecurityLayout(data_dir)
        as_gateway = load_credentials(layout.creds("gateway")).tls_context(server=False)
        bus = await connect_admin(data_dir, nats, "test-mtls")
        try:
            await api(bus, "cluster.create", echo_spec(1))

            async def placed() -> dict[str, Any] | None:
                cluster = await api(bus, "cluster.get", {"name": "echo"})
                ready = [r for r in cluster["replicas"] if r["status"] == "ready"]
                return ready[0] if ready else None

            first = await until(placed, 30, "echo-0 ready")
            node, epoch, old = first["node_id"], first["epoch"], first["address"]
            assert "/replica/" in old and old.startswith("http://127.0.0.1:"), old
            for log in (data_dir / "logs").glob("agent-*.log"):
                assert "mutual, gateways only" in log.read_text(), log

            # The gateway reaches it over mutual TLS; so does anyone holding its certificate.
            status, body = await _post(gateway + PATH)
            assert status == 200, body
            assert (await _post(_tls(old), as_gateway))[0] == 200
            # Nobody else: plain HTTP, or TLS without a certificate.
            with pytest.raises(aiohttp.ClientError):
                await _post(old + PATH)
            with pytest.raises(aiohttp.ClientError):
                await _post(_tls(old), ssl.create_default_context(cafile=layout.ca_cert))

            # The fence over TLS: a partition (SIGSTOP) past the offline window, a replacement
            # elsewhere, and the healed node refuses a stale gateway at the old address.
            agent = _agent_pid(marker, node)
            assert agent, f"no agent process for {node}"
            os.kill(agent, signal.SIGSTOP)
            try:

                async def replaced() -> dict[str, Any] | None:
                    now = await placed()
                    return now if now and now["epoch"] > epoch and now["node_id"] != node else None

                second = await until(replaced, 40, "echo-0 replaced elsewhere")
            finally:
                os.kill(agent, signal.SIGCONT)
            status, body = await _post(_tls(old), as_gateway)
            assert status == 503 and b'"fenced"' in body, (status, body)
            assert (await _post(_tls(second["address"]), as_gateway))[0] == 200

            # The gateway's certificate revoked: the fronts refuse it within a second or so.
            revoked = await asyncio.to_thread(
                subprocess.run,
                [sys.executable, "-m", "gpumesh", "--data-dir", str(data_dir), "certs", "revoke",
                 "gateway"],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert revoked.returncode == 0, revoked.stderr
            assert "crl.pem" in revoked.stdout

            async def shut_out() -> bool:
                status, body = await _post(gateway + PATH)
                return status == 403 and b"revoked" in body

            await until(shut_out, 5, "the gateway refused by the fronts")
        finally:
            await bus.close()
        up.send_signal(signal.SIGINT)
        await asyncio.to_thread(up.wait, 30)
    finally:
        reap(up)
        await asyncio.to_thread(kill_marked, marker)
