"""docs/security.md's recipe for a node on another machine, run command by command as the doc
writes it, with real processes and the real nats-server.

127.0.0.2 stands in for the controller machine's name (ctl.example.org) and the embedded
server listens there alone, on a free port, instead of on every interface at 4222; the node
gets a fake GPU (none here) and its own data directory, and the test copies the credentials
file where the doc says `scp`. Everything else is the doc's text.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from events.contract import subjects
from tests.integration.stack import STACK_ENV, kill_marked
from tests.integration.up_process import api
from wire.commandline import nats_for
from wire.crl_share import read_crl
from wire.nats_access import SecurityLayout, load_credentials
from wire.nats_bus import BusUnavailable, NatsBus

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
STAND_IN = "127.0.0.2"  # ctl.example.org, as the node dials it
_URL_LINE = re.compile(r"controller: NATS (\S+), event log")


def recipe() -> list[list[str]]:
    """The commands of the doc's remote-node block, comments dropped."""
    text = (ROOT / "docs" / "security.md").read_text()
    start = text.index("```bash", text.index("For nodes on other machines:")) + len("```bash")
    block = text[start : text.index("```", start)]
    lines = [line for line in block.splitlines() if line.split("#")[0].strip()]
    return [shlex.split(line, comments=True) for line in lines]


def _here(argv: list[str], url: str = "") -> list[str]:
    """The doc's command as this test runs it: the stand-in host, a free port."""
    swap = {
        "ctl.example.org": STAND_IN,
        "0.0.0.0:4222": f"{STAND_IN}:0",
        "tls://ctl.example.org:4222": url,
    }
    return [swap.get(arg, arg) for arg in argv]


def _gpumesh(argv: list[str], data_dir: Path) -> list[str]:
    assert argv[0] == "gpumesh", argv
    return [sys.executable, "-m", "gpumesh", *argv[1:], "--data-dir", str(data_dir)]


@pytest.fixture
def stand_in() -> None:
    with socket.socket() as probe:
        try:
            probe.bind((STAND_IN, 0))
        except OSError:
            pytest.skip(f"{STAND_IN} is not a loopback address here")


@pytest.fixture
async def marker() -> AsyncIterator[str]:
    """Every process the test starts carries it; teardown kills whatever is left."""
    mark = f"recipe-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        yield mark
    finally:
        await asyncio.to_thread(kill_marked, mark)


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_the_remote_node_recipe_works_as_written(
    tmp_path: Path, nats_server_binary: Path, stand_in: None, marker: str
) -> None:
    commands = recipe()
    assert [argv[:3] for argv in commands] == [
        ["gpumesh", "certs", "init"],
        ["gpumesh", "controller", "--nats-listen"],
        ["gpumesh", "node", "issue"],
        ["scp", "gpu-7.creds.json", "gpu-7:"],
        ["gpumesh", "agent", "--node-id"],
        ["gpumesh", "node", "revoke"],
    ], "the recipe changed shape: update this test with it"
    init, controller, issue, _scp, agent, revoke = commands

    ctl_home, ctl_data = tmp_path / "ctl", tmp_path / "ctl" / "data"
    node_home, node_data = tmp_path / "gpu-7", tmp_path / "gpu-7" / "data"
    ctl_home.mkdir()
    node_home.mkdir()
    env = {**os.environ, STACK_ENV: marker, "PYTHONUNBUFFERED": "1"}

    async def once(argv: list[str]) -> str:
        done = await asyncio.to_thread(
            subprocess.run,
            _gpumesh(_here(argv), ctl_data),
            cwd=ctl_home,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"{shlex.join(argv)}: {done.stderr}"
        return done.stdout

    # On the controller machine.
    assert "created" in await once(init)
    ctl = await asyncio.create_subprocess_exec(
        *_gpumesh(_here(controller), ctl_data), "--log-format", "json",
        cwd=ctl_home, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE, start_new_session=True,
    )  # fmt: skip
    assert ctl.stderr is not None
    said: list[str] = []
    url_seen: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def read_controller() -> None:
        assert ctl.stderr is not None
        async for raw in ctl.stderr:  # drained to the end: a full pipe would block it
            said.append(raw.decode(errors="replace").rstrip())
            if not url_seen.done() and (found := _URL_LINE.search(said[-1])):
                url_seen.set_result(found[1])
        if not url_seen.done():
            url_seen.set_exception(AssertionError("controller exited:\n" + "\n".join(said)))

    reader = asyncio.create_task(read_controller())
    node: asyncio.subprocess.Process | None = None
    operator: NatsBus | None = None
    try:
        url = await asyncio.wait_for(url_seen, 30)
        found = re.fullmatch(rf"tls://{re.escape(STAND_IN)}:(\d+)", url)
        assert found, url
        port = int(found[1])
        server_log = (ctl_data / "nats" / "nats-server.log").read_text()
        assert f"Listening for client connections on {STAND_IN}:{port}" in server_log

        # TLS is required, and nothing listens on the loopback address it used to bind alone.
        admin = load_credentials(SecurityLayout(ctl_data).creds("admin"))
        with pytest.raises(BusUnavailable):
            await NatsBus.connect(f"nats://{STAND_IN}:{port}", name="plain", connect_timeout=2)
        with pytest.raises(BusUnavailable, match="connection refused"):
            await NatsBus.connect(
                f"tls://127.0.0.1:{port}", name="loopback", credentials=admin, connect_timeout=2
            )

        issued = await once(issue)
        assert "reloaded" in issued, issued  # the running server let the new key in
        creds = node_home / "gpu-7.creds.json"
        shutil.copy2(ctl_home / "gpu-7.creds.json", creds)  # scp, as the doc says
        assert creds.stat().st_mode & 0o777 == 0o600

        operator = await NatsBus.connect(url, name="operator", credentials=admin)
        beats = await operator.subscribe(subjects.heartbeat("gpu-7"))
        await operator.flush()

        # On the node: its own directory, nothing of the controller's but the copied file.
        with (node_home / "agent.log").open("ab") as log:
            node = await asyncio.create_subprocess_exec(
                *_gpumesh(_here(agent, url), node_data),
                "--fake-gpus", "RTX4090:24GiB:1", "--log-format", "json",
                cwd=node_home, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                start_new_session=True,
            )  # fmt: skip
        await beats.next_msg(30)  # registered (heartbeats follow registration) over TLS
        nodes = {n["node_id"]: n for n in await api(operator, "node.list", {})}
        assert nodes["gpu-7"]["health"] == "healthy", nodes

        # A revocation on the controller machine reaches the node's own copy of the CA's list,
        # which its front reads, over NATS: nothing to copy by hand (wire/crl_share.py).
        await once(["gpumesh", "certs", "revoke", "gateway"])
        ca_pem = (ctl_data / "security" / "ca.pem").read_text()
        source, copy = ctl_data / "security" / "crl.pem", node_data / "security" / "crl.pem"
        listed = read_crl(source.read_bytes(), ca_pem)
        assert listed, "the gateway's certificate is in the CA's list"
        loop = asyncio.get_running_loop()
        start = loop.time()
        async with asyncio.timeout(10):
            # A file written by another process: nothing to await but its contents.
            while not copy.exists() or read_crl(copy.read_bytes(), ca_pem) != listed:  # noqa: ASYNC110
                await asyncio.sleep(0.05)
        print(f"revocation on the node {loop.time() - start:.2f} s after `certs revoke` returned")

        # Later: revoked, it is cut off and its agent exits.
        revoked = await once(revoke)
        assert "reloaded" in revoked, revoked
        assert await asyncio.wait_for(node.wait(), 30) == 1
        assert "refuses node gpu-7's credentials" in (node_home / "agent.log").read_text()

        ctl.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(ctl.wait(), 30) == 0, "\n".join(said[-20:])
    finally:
        if operator is not None:
            await operator.close()
        for proc in (node, ctl):
            if proc is not None and proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()
        await asyncio.wait_for(reader, 10)


async def test_without_nats_listen_the_embedded_server_listens_on_loopback_only(
    tmp_path: Path, nats_server_binary: Path
) -> None:
    """What `gpumesh up` and `gpumesh controller` run when --nats-listen is not given."""
    from gpumesh.security import identities

    identities.init(SecurityLayout(tmp_path), ["127.0.0.1", "localhost", "ctl.example.org"])
    async with nats_for(tmp_path, None) as url:
        found = re.fullmatch(r"tls://127\.0\.0\.1:(\d+)", url)
        assert found, url
        server_log = (tmp_path / "nats" / "nats-server.log").read_text()
        assert f"Listening for client connections on 127.0.0.1:{found[1]}" in server_log
        assert (tmp_path / "nats.url").read_text().strip() == url
