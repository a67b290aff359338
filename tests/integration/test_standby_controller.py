"""Two controllers, one leader: real processes on one NATS and one data directory.

The first controller holds the leader lease (a JetStream key); a second stands by. SIGKILL of
the leader: the standby leads within the lease's time to live and accepts `cluster scale`, and
`gpumesh controller status` names each leader in turn. Clients see nothing of it.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest

from actors.cli import READ_MODEL_FILE
from events import TERMS_STREAM, LeaderTermBegan
from events.jetstream_store import JetStreamEventStore, JetStreamOptions
from gpumesh.cli import main
from projections.projector import load_checkpoint
from runtime.errors import BusError
from tests.integration.stack import Stack, echo_spec, started_stack
from tests.integration.test_failover_processes import serving

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
async def stack(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[Stack]:
    async with started_stack(tmp_path / "stack", 2, nats_server_binary) as s:
        yield s


async def status(stack: Stack, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    args = ["--data-dir", str(stack.root), "controller", "status", "--nats", stack.url]
    assert await asyncio.to_thread(main, [*args, "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()[-1]
    return dict(json.loads(out))


@pytest.mark.timeout(120)
async def test_a_standby_leads_within_the_lease_when_the_leader_is_killed(
    stack: Stack, capsys: pytest.CaptureFixture[str]
) -> None:
    await stack.create_cluster(echo_spec(2))
    await serving(stack, 2)
    first = await status(stack, capsys)
    assert first["leader"] and first["term"] > 0
    stack.start_standby("standby-1")
    await asyncio.sleep(2.0)  # it campaigns, and stays a standby
    assert (await status(stack, capsys))["leader"] == first["leader"]

    await stack.kill_controller()
    killed = time.monotonic()
    await stack.wait_until(
        lambda: _leads(stack, capsys, "standby-1"), timeout=15, why="the standby leads"
    )
    # Once it has caught up with the log it answers the control API, and changes the fleet.
    await stack.wait_until(lambda: _scaled(stack), timeout=15, why="cluster.scale accepted")
    took = time.monotonic() - killed
    with capsys.disabled():
        print(f"\nthe standby led and scaled {took:.2f} s after the leader's SIGKILL")
    assert took < 8.0, took  # TTL 3 s, renewals 1 s, polls 0.25 s: the issue asks 5 s
    cluster = await serving(stack, 1)
    assert [r["status"] for r in cluster["replicas"]].count("ready") == 1
    second = await status(stack, capsys)
    assert second["term"] > first["term"]


async def _scaled(stack: Stack) -> bool:
    try:
        await stack.api("cluster.scale", {"name": "echo", "replicas": 1}, timeout=2)
    except BusError:  # no responders yet: the new leader is still catching up
        return False
    return True


async def _leads(stack: Stack, capsys: pytest.CaptureFixture[str], name: str) -> bool:
    return (await status(stack, capsys))["leader"] == name


# -- the log of record on JetStream: controllers that share nothing but NATS -----------------


@pytest.fixture
async def js_stack(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[Stack]:
    root = tmp_path / "stack"
    async with started_stack(
        root, 2, nats_server_binary, controller_args=["--event-log", "jetstream"]
    ) as s:
        yield s


async def roster(stack: Stack) -> list[dict[str, Any]]:
    from actors.roster import Roster

    bus = stack.bus
    return [msgspec.to_builtins(e) for e in await Roster(bus).entries()]


@pytest.mark.timeout(120)
async def test_with_the_log_on_jetstream_a_standby_elsewhere_follows_and_takes_over(
    js_stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = js_stack
    await stack.create_cluster(echo_spec(2))
    await serving(stack, 2)
    first = await status(stack, capsys)
    # Its own data directory: no file in common with the leader.
    stack.start_standby("standby-1", data_dir=tmp_path / "elsewhere")

    async def follows() -> bool:
        entries = {e["controller_id"]: e for e in await roster(stack)}
        leader, standby = entries.get(first["leader"]), entries.get("standby-1")
        return (
            leader is not None
            and standby is not None
            and standby["role"] == "standby"
            and standby["follows"]
            and standby["applied"] > 0
            and standby["applied"] >= leader["applied"] - 50
        )

    await stack.wait_until(follows, timeout=20, why="the standby follows the log")
    shown = await status(stack, capsys)
    assert [s["controller_id"] for s in shown["standbys"]] == ["standby-1"]

    await stack.kill_controller()
    killed = time.monotonic()
    await stack.wait_until(lambda: _scaled(stack), timeout=15, why="cluster.scale accepted")
    took = time.monotonic() - killed
    with capsys.disabled():
        print(f"\nthe following standby led and scaled {took:.2f} s after the leader's SIGKILL")
    assert took < 8.0, took
    # The cluster it never saw created came to it through the log, and it acts on it.
    cluster = await serving(stack, 1)
    assert cluster["desired"] == 1
    assert (await status(stack, capsys))["leader"] == "standby-1"
    # Each term began with its record, the one its appends were fenced on.
    terms = await term_records(stack)
    assert [t.controller_id for t in terms][-1] == "standby-1", terms
    assert len(terms) >= 2 and [t.term for t in terms] == sorted({t.term for t in terms}), terms


async def term_records(stack: Stack) -> list[LeaderTermBegan]:
    log = await JetStreamEventStore.open(
        stack.bus.client, JetStreamOptions(replicas=stack.bus.stream_replicas)
    )
    try:
        found = [e.payload for e in await log.read_stream(TERMS_STREAM)]
    finally:
        await log.close()
    return [t for t in found if isinstance(t, LeaderTermBegan)]


@pytest.mark.timeout(120)
async def test_a_leader_paused_past_its_lease_writes_nothing_when_it_wakes(
    js_stack: Stack, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = js_stack
    await stack.create_cluster(echo_spec(2))
    await serving(stack, 2)
    old = stack.controller
    assert old is not None
    stack.start_standby("standby-1", data_dir=tmp_path / "elsewhere")
    await asyncio.sleep(1.0)
    os.kill(old.pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:
        await stack.wait_until(lambda: _scaled(stack), timeout=15, why="the standby scales")
        took = time.monotonic() - stopped
        assert took < 8.0, took
    finally:
        os.kill(old.pid, signal.SIGCONT)

    def stepped_down() -> bool:
        text = old.log_path.read_text()
        return "leadership_lost" in text

    await stack.wait_until(stepped_down, timeout=10, why="the old leader steps down")
    lines = [
        json.loads(line)
        for line in old.log_path.read_text().splitlines()
        if line.startswith("{") and "leadership_lost" in line
    ]
    assert "paused" in lines[-1]["reason"] or "expired" in lines[-1]["reason"], lines[-1]
    # The new leader goes on undisturbed: its term stands, and the fleet follows it.
    await serving(stack, 1)
    assert (await status(stack, capsys))["leader"] == "standby-1"


@pytest.mark.timeout(120)
async def test_a_controller_on_jetstream_restarts_from_its_read_model(js_stack: Stack) -> None:
    """A clean stop writes the fold and its position to the local read model; the controller
    started again on that data directory folds only what the log gained since."""
    stack = js_stack
    await stack.create_cluster(echo_spec(2))
    await serving(stack, 2)
    await stack.stop_controller()
    saved = await load_checkpoint(stack.root / READ_MODEL_FILE)
    assert saved is not None and saved.position > 0
    assert "echo" in saved.clusters.clusters
    await stack.start_controller()
    await serving(stack, 2)
    assert stack.controller is not None
    [followed] = [
        json.loads(line)
        for line in stack.controller.log_path.read_text().splitlines()
        if line.startswith("{") and '"log_followed"' in line
    ]
    assert followed["from_read_model"] == saved.position, followed
    assert followed["position"] >= saved.position
