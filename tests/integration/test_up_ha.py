"""`gpumesh up --ha` as a user tries it: three nats-servers clustered by routes over TLS, two
controllers, the gateway and three agents, each its own process. A request through the
gateway succeeds; under client load, SIGKILL of the leading controller and then of a
nats-server (the one leading the lease's stream: the hardest one) each leave every request
served, and a controller leads again and answers its API; `up` starts each killed process
again; Ctrl-C stops everything it started, exit code 0."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import nats.errors
import pytest

from actors.errors import ControllerError
from actors.leader_kv import STREAM, KvLease
from runtime.errors import BusError
from tests.integration.stack import STACK_ENV, kill_marked, marked_pids, pid_alive
from tests.integration.up_process import connect_admin, reap
from wire.nats_bus import NatsBus

pytestmark = [pytest.mark.integration, pytest.mark.slow]

CLIENTS = 4
CHAT = {"model": "echo", "messages": [{"role": "user", "content": "hello gpumesh"}]}


def start_up_ha(data_dir: Path, marker: str) -> subprocess.Popen[bytes]:
    data_dir.mkdir(parents=True)
    with (data_dir.parent / "up.log").open("ab") as log:
        return subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "up", "--ha", "--demo", "--json", "--nodes", "3",
             "--data-dir", str(data_dir), "--gateway", "127.0.0.1:0", "--log-format", "json"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            env={**os.environ, STACK_ENV: marker, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )  # fmt: skip


def read_summary(up: subprocess.Popen[bytes]) -> dict[str, Any]:
    """The one JSON line `up --ha --json` prints once the stack serves."""
    assert up.stdout is not None
    for raw in up.stdout:
        line = raw.decode().strip()
        if line.startswith("{"):
            summary: dict[str, Any] = json.loads(line)
            return summary
    return {}


async def until(check: Callable[[], Awaitable[Any]], timeout: float, why: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = await check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not within {timeout:g} s: {why}"
        await asyncio.sleep(0.1)


async def lease(kv: KvLease) -> tuple[str, int] | None:
    """(leader, term) from the lease, or None while nobody holds it (or it cannot be read)."""
    try:
        found = await kv.leader()
    except (ControllerError, BusError, nats.errors.Error):
        return None
    if found is None:
        return None
    record, revision = found
    return record.controller_id, record.term or revision


async def api_answers(bus: NatsBus) -> bool:
    try:
        raw = await bus.request("gpumesh.v1.api.cluster.get", b'{"name": "echo"}', timeout=1.0)
    except BusError:
        return False
    return bool(json.loads(raw.data).get("ok"))


async def client(
    session: aiohttp.ClientSession, url: str, stop: asyncio.Event, log: list[tuple[float, int]]
) -> None:
    while not stop.is_set():
        try:
            async with session.post(
                url, json=CHAT, timeout=aiohttp.ClientTimeout(total=15)
            ) as resp:
                await resp.read()
                status = resp.status
        except (aiohttp.ClientError, TimeoutError):
            status = 0
        log.append((time.monotonic(), status))


def processes(data_dir: Path) -> dict[str, dict[str, Any]]:
    """What `up` runs now, by name, from the file it rewrites on every restart."""
    data = json.loads((data_dir / "up-ha.json").read_text())
    return {p["name"]: p for p in data["processes"]}


@pytest.mark.timeout(240)
async def test_up_ha_serves_through_the_loss_of_the_leader_and_of_a_nats_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data_dir = tmp_path / "stack"
    marker = f"ha-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    began = time.monotonic()
    up = start_up_ha(data_dir, marker)
    bus: NatsBus | None = None
    try:
        summary = await asyncio.wait_for(asyncio.to_thread(read_summary, up), timeout=150)
        served_s = time.monotonic() - began
        log_path = tmp_path / "up.log"
        assert summary, log_path.read_text()[-3000:]
        roles = sorted(p["role"] for p in summary["processes"])
        assert roles == ["agent"] * 3 + ["controller"] * 2 + ["gateway"] + ["nats-server"] * 3
        assert len({p["pid"] for p in summary["processes"]}) == 9  # each its own process
        assert all(p["kill"] == f"kill -9 {p['pid']}" for p in summary["processes"])
        urls = summary["nats"].split(",")
        assert len(urls) == 3 and all(u.startswith("tls://127.0.0.1:") for u in urls), urls
        gateway = summary["gateway"]
        assert gateway.startswith("http://127.0.0.1:") and gateway.endswith("/v1"), summary
        leader, term = summary["leader"], summary["term"]
        assert leader in ("ctl-0", "ctl-1") and term > 0
        await scrape_the_printed_metrics(summary, data_dir, leader)

        bus = admin = await connect_admin(data_dir, summary["nats"], "test-up-ha")
        kv = KvLease(admin, timeout=1.0)
        stop = asyncio.Event()
        requests: list[tuple[float, int]] = []
        async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tasks:
            url = f"{gateway}/chat/completions"
            async with session.post(url, json=CHAT) as resp:
                answer = await resp.json()
                assert resp.status == 200, answer
            assert "hello gpumesh" in answer["choices"][0]["message"]["content"], answer
            # The control API is keyed, as with `gpumesh up`: by the data directory's key.
            key_file = data_dir / "admin-key"
            assert key_file.stat().st_mode & 0o777 == 0o600
            api = gateway.removesuffix("/v1") + "/api/v1/nodes"
            async with session.get(api) as resp:
                assert resp.status == 401
            bearer = {"Authorization": f"Bearer {key_file.read_text().strip()}"}
            async with session.get(api, headers=bearer) as resp:
                assert resp.status == 200, await resp.text()
            for _ in range(CLIENTS):
                tasks.create_task(client(session, url, stop, requests))
            try:
                # 1. The leading controller dies: the standby leads, at a later term.
                await until(lambda: asyncio.sleep(0, len(requests) > 20), 30, "load started")
                os.kill(processes(data_dir)[leader]["pid"], signal.SIGKILL)
                killed = time.monotonic()

                async def new_term() -> bool:
                    found = await lease(kv)
                    return found is not None and found[1] > term

                await until(new_term, 20, "a controller leads at a new term")
                await until(lambda: api_answers(admin), 20, "the new leader answers its API")
                takeover_s = time.monotonic() - killed
                after_controller = len(requests)

                # 2. The nats-server that leads the lease's stream dies.
                info = await admin.jetstream(timeout=5).stream_info(STREAM)
                assert info.cluster is not None and info.config.num_replicas == 3
                victim = processes(data_dir)[info.cluster.leader or ""]
                assert victim["role"] == "nats-server"
                os.kill(victim["pid"], signal.SIGKILL)
                killed = time.monotonic()
                await until(
                    lambda: pid_alive_again(data_dir, victim), 20, "up starts the server again"
                )
                await until(lambda: lease(kv), 30, "a controller leads after the server's loss")
                await until(lambda: api_answers(admin), 30, "a leader answers after it")
                nats_s = time.monotonic() - killed
                after_nats = len(requests)
                await until(
                    lambda: asyncio.sleep(0, len(requests) > after_nats + 20), 30, "more load"
                )
            finally:
                stop.set()
        failed = [r for r in requests if r[1] != 200]
        assert failed == [], failed[:5]
        assert after_controller > 0 and len(requests) > after_nats
        with capsys.disabled():
            print(
                f"\nup --ha served in {served_s:.1f} s; the controller's SIGKILL: a leader "
                f"answered {takeover_s:.2f} s later; the lease stream leader's SIGKILL: "
                f"{nats_s:.2f} s; {len(requests)} requests, 0 failed"
            )

        await bus.close()
        bus = None
        up.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(up.wait, 60)
        assert code == 0, log_path.read_text()[-3000:]
        assert [pid for pid in marked_pids(marker) if pid_alive(pid)] == []
        assert not (data_dir / "up-ha.json").exists()
    finally:
        if bus is not None:
            await bus.close()
        reap(up)
        await asyncio.to_thread(kill_marked, marker)


async def scrape_the_printed_metrics(summary: dict[str, Any], data_dir: Path, leader: str) -> None:
    """Each controller and agent serves metrics on a port of its own, named per process in the
    summary and in up-ha.json, with a scrape configuration for all of them."""
    from tests.integration.test_up_demo import scrape

    where = {p["name"]: p["metrics"] for p in summary["processes"] if p.get("metrics")}
    assert sorted(where) == ["ctl-0", "ctl-1", "gw-0", "node-0", "node-1", "node-2"], where
    assert {n: p.get("metrics") for n, p in processes(data_dir).items()} == {
        p["name"]: p.get("metrics") for p in summary["processes"]
    }
    jobs = {j["job_name"]: j["static_configs"][0]["targets"] for j in summary["scrape_configs"]}
    assert sorted(jobs) == ["gpumesh-agent", "gpumesh-controller", "gpumesh-gateway"], jobs
    assert len(jobs["gpumesh-controller"]) == 2 and len(jobs["gpumesh-agent"]) == 3, jobs
    controller = await asyncio.to_thread(scrape, where[leader])
    assert controller["gpumesh_controller_leader"] == {(): 1.0}, controller
    assert sum(controller["gpumesh_controller_nodes"].values()) == 3, controller
    agent = await asyncio.to_thread(scrape, where["node-0"])
    assert agent["gpumesh_agent_registered"] == {(("node", "node-0"),): 1.0}, agent


async def pid_alive_again(data_dir: Path, victim: dict[str, Any]) -> bool:
    now = processes(data_dir).get(victim["name"], {})
    return bool(now.get("pid") not in (None, victim["pid"]) and pid_alive(now["pid"]))


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--ha", "--nats", "nats://127.0.0.1:4222"], "--ha starts its own three nats-servers"),
        (["--ha", "--nats-listen", "0.0.0.0:4222"], "--ha runs on this machine only"),
        (["--json"], "--json goes with --ha"),
    ],
)
def test_up_ha_refuses_what_it_cannot_do_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], says: str
) -> None:
    from gpumesh.cli import main

    assert main(["--data-dir", str(tmp_path), "up", *extra]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("gpumesh: error: ") and says in err[-1], err
    assert not (tmp_path / "nats-ha").exists()  # nothing was started
