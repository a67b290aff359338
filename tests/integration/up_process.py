"""A real `gpumesh up` started by a test: start it, read its URLs, talk to its control API."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import msgspec

from events.contract import subjects
from events.contract.messages import ApiReply
from tests.integration.stack import STACK_ENV
from wire.nats_access import SecurityLayout, load_credentials
from wire.nats_bus import NatsBus


def start_up(
    data_dir: Path, marker: str, *, nodes: int = 4, extra: Sequence[str] = ()
) -> subprocess.Popen[bytes]:
    """`gpumesh up` with `nodes` agents and a gateway on a free port, marked with `marker`."""
    data_dir.mkdir(parents=True)
    with (data_dir.parent / "up.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "up", "--data-dir", str(data_dir), "--nodes",
             str(nodes), "--gateway", "127.0.0.1:0", "--log-format", "json", *extra],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, STACK_ENV: marker, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )  # fmt: skip


def reap(up: subprocess.Popen[bytes]) -> None:
    """Whatever state the test left `up` in: gone, with its pipe closed."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(up.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        up.wait(10)
    if up.stdout is not None:
        up.stdout.close()


def read_urls(up: subprocess.Popen[bytes]) -> tuple[str, str]:
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


async def connect_admin(data_dir: Path, nats: str, name: str) -> NatsBus:
    """The operator's connection: the stack's `admin` identity when its NATS is secured."""
    creds = None
    if nats.startswith("tls://"):
        creds = load_credentials(SecurityLayout(data_dir).creds("admin"))
    return await NatsBus.connect(nats, name=name, credentials=creds)


async def api(bus: NatsBus, verb: str, body: object) -> Any:
    raw = await bus.request(subjects.api(verb), msgspec.json.encode(body), timeout=30.0)
    reply = msgspec.json.decode(raw.data, type=ApiReply)
    assert reply.ok, reply.error
    return reply.data


async def until(predicate: Any, timeout: float, why: str) -> Any:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        value = await predicate()
        if value:
            return value
        assert loop.time() < deadline, f"not within {timeout:g} s: {why}"
        await asyncio.sleep(0.2)


def run_chaos(
    args: Sequence[str], *, marker: str, timeout: float
) -> subprocess.CompletedProcess[bytes]:
    """`gpumesh chaos ARGS` to its end. One still running after `timeout` is asked for its
    asyncio tasks (SIGUSR1: runtime/task_dump.py), then killed, and the test fails with the
    end of its stderr, the dump included: what it waited on."""
    chaos = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "chaos", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, STACK_ENV: marker},
    )
    try:
        out, err = chaos.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        chaos.send_signal(signal.SIGUSR1)
        try:
            out, err = chaos.communicate(timeout=3)
        except subprocess.TimeoutExpired:
            chaos.kill()
            out, err = chaos.communicate()
        raise AssertionError(
            f"gpumesh chaos still running after {timeout:g} s; its stderr ends:\n"
            + err.decode(errors="replace")[-12000:]
        ) from None
    return subprocess.CompletedProcess(chaos.args, chaos.returncode, out, err)
