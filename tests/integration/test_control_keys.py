"""`gpumesh gateway` as a process, its control API keyed: closed by default, open with
`--insecure-api` (said once), scoped admin keys against a real controller, and the key file read
again when it changes, a broken one keeping the keys it replaced."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from actors.controller import Controller
from tests.integration.gateway_kit import free_port, until
from tests.integration.test_control_rest import controller, spec
from wire.nats_server import EmbeddedNats

pytestmark = pytest.mark.integration
__all__ = ["controller"]  # the fixture, shared with test_control_rest.py


class GatewayProcess:
    def __init__(self, proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
        self.proc = proc
        self.url = url
        self.log = log

    def lines(self, word: str) -> list[str]:
        return [line for line in self.log.read_text().splitlines() if word in line]


def spawn(argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.asynccontextmanager
async def gateway_process(
    nats: EmbeddedNats, tmp_path: Path, *flags: str
) -> AsyncIterator[GatewayProcess]:
    port = free_port()
    log = tmp_path / f"gateway-{port}.log"
    argv: Sequence[str] = [
        sys.executable,
        "-m",
        "gpumesh",
        "--data-dir",
        str(tmp_path / "data"),
        "gateway",
        "--nats",
        nats.url,
        "--listen",
        f"127.0.0.1:{port}",
        "--routes-wait",
        "0",
        "--no-access-log",
        *flags,
    ]
    proc = spawn(argv, log)
    url = f"http://127.0.0.1:{port}"
    try:
        async with aiohttp.ClientSession() as http:

            async def serving() -> bool:
                assert proc.poll() is None, log.read_text()[-2000:]
                with contextlib.suppress(aiohttp.ClientError):
                    async with http.get(f"{url}/healthz") as resp:
                        return resp.status == 200
                return False

            await until(serving, within=30)
        yield GatewayProcess(proc, url, log)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


async def status(
    http: aiohttp.ClientSession, method: str, url: str, key: str = "", body: Any = None
) -> int:
    async with http.request(method, url, headers=auth(key), json=body) as resp:
        if resp.status in (401, 403):
            error = (await resp.json())["error"]
            assert error["type"] in ("admin_key_required", "forbidden"), error
        return resp.status


async def test_without_keys_the_api_is_closed_and_insecure_api_opens_it_saying_so(
    nats_server: EmbeddedNats, tmp_path: Path
) -> None:
    async with aiohttp.ClientSession() as http:
        async with gateway_process(nats_server, tmp_path) as gw:
            async with http.get(f"{gw.url}/api/v1/nodes") as resp:
                assert resp.status == 401
                message = (await resp.json())["error"]["message"]
                assert "--insecure-api" in message and "\n" not in message
            # Inference stays open on a key-less gateway (a local stack): not a 401.
            async with http.get(f"{gw.url}/v1/models") as resp:
                assert resp.status == 200
            assert gw.lines("/api/v1 is closed")
            assert not gw.lines("control_api_open")
        async with gateway_process(nats_server, tmp_path, "--insecure-api") as gw:
            # No controller answers here: a 503 from the controller's side, not a 401.
            assert await status(http, "GET", f"{gw.url}/api/v1/nodes") == 503
            assert await status(http, "GET", f"{gw.url}/api/v1/clusters") == 503
            assert len(gw.lines("control_api_open")) == 1, gw.log.read_text()


KEYS = """
admin_keys = ["gm-root"]

[admins.ro]
keys = ["gm-ro"]
scope = "read"

[admins.llama-team]
keys = ["gm-llama"]
scope = "operate"
clusters = ["llama"]
"""


def write_keys(path: Path, text: str) -> None:
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    os.replace(fresh, path)


async def test_scoped_keys_against_a_controller_and_reloads_without_a_restart(
    nats_server: EmbeddedNats, controller: Controller, tmp_path: Path
) -> None:
    keys = tmp_path / "keys.toml"
    write_keys(keys, KEYS)
    async with (
        aiohttp.ClientSession() as http,
        gateway_process(nats_server, tmp_path, "--keys", str(keys)) as gw,
    ):
        api = f"{gw.url}/api/v1"
        for name in ("llama", "mistral"):
            assert await status(http, "POST", f"{api}/clusters", "gm-root", spec(name)) == 201
        assert await status(http, "GET", f"{api}/nodes") == 401

        # Read-only: GET, and nothing else.
        for path in ("/nodes", "/clusters", "/clusters/llama", "/events"):
            assert await status(http, "GET", f"{api}{path}", "gm-ro") == 200, path
        scale = {"replicas": 2}
        assert await status(http, "PATCH", f"{api}/clusters/llama", "gm-ro", scale) == 403
        assert await status(http, "DELETE", f"{api}/clusters/llama", "gm-ro") == 403
        assert await status(http, "POST", f"{api}/clusters", "gm-ro", spec("x")) == 403

        # Cluster-scoped: its cluster, not another; no node verbs.
        assert await status(http, "PATCH", f"{api}/clusters/llama", "gm-llama", scale) == 200
        assert await status(http, "PATCH", f"{api}/clusters/mistral", "gm-llama", scale) == 403
        assert await status(http, "POST", f"{api}/nodes/gpu-1/drain", "gm-llama") == 403
        cluster = await (await http.get(f"{api}/clusters/llama", headers=auth("gm-ro"))).json()
        assert cluster["desired"] == 2

        # A new key in the file works without a restart; the file's old ones go.
        write_keys(keys, KEYS.replace('"gm-ro"', '"gm-ro-2"'))

        async def new_key_works() -> bool:
            return await status(http, "GET", f"{api}/nodes", "gm-ro-2") == 200

        await until(new_key_works, within=10)
        assert await status(http, "GET", f"{api}/nodes", "gm-ro") == 401

        # A broken file keeps the keys it would have replaced, and says so in one line.
        write_keys(keys, "admin_keys = [")
        await until(lambda: bool(gw.lines("keys_reload_failed")), within=10)
        assert await status(http, "GET", f"{api}/nodes", "gm-ro-2") == 200
        assert await status(http, "PATCH", f"{api}/clusters/llama", "gm-llama", scale) == 200

        # SIGHUP reads it again at once: still broken, one more line, the keys kept.
        gw.proc.send_signal(signal.SIGHUP)
        await until(lambda: len(gw.lines("keys_reload_failed")) == 2, within=10)
        assert gw.proc.poll() is None
        assert await status(http, "GET", f"{api}/nodes", "gm-root") == 200
