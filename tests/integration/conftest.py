"""Integration fixtures: one real nats-server per test, on a port it picks, JetStream in a
temporary directory."""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import pytest

from wire.nats_bus import NatsBus
from wire.nats_server import EmbeddedNats, find_nats_server


@pytest.fixture(scope="session")
def nats_server_binary() -> Path:
    """Fail the whole session at once, with one clear line, if the binary cannot run."""
    binary = find_nats_server()
    done = subprocess.run([binary, "--version"], capture_output=True, timeout=10, check=False)
    if done.returncode != 0:
        pytest.fail(f"{binary} --version failed: {done.stderr.decode(errors='replace')}")
    return binary


@pytest.fixture
async def nats_server(nats_server_binary: Path, tmp_path: Path) -> AsyncIterator[EmbeddedNats]:
    server = EmbeddedNats(tmp_path / "nats", binary=nats_server_binary)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


@pytest.fixture
async def bus(nats_server: EmbeddedNats) -> AsyncIterator[NatsBus]:
    b = await NatsBus.connect(nats_server.url, name="test", reconnect_wait=0.1)
    try:
        yield b
    finally:
        await b.close()


@pytest.fixture
async def connect(nats_server: EmbeddedNats) -> AsyncIterator[Callable[[str], Awaitable[NatsBus]]]:
    """More connections to the same server (publishers beside subscribers, integrators)."""
    opened: list[NatsBus] = []

    async def open_bus(name: str) -> NatsBus:
        b = await NatsBus.connect(nats_server.url, name=name, reconnect_wait=0.1)
        opened.append(b)
        return b

    try:
        yield open_bus
    finally:
        for b in reversed(opened):
            await b.close()
