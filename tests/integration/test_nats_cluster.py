"""NATS is no single point of failure once it is a cluster: three nats-servers joined by routes
on loopback (wire/nats_cluster.py), every process dialling the list of their URLs.

A client whose server dies moves to another in milliseconds; the streams of ours keep three
copies there and survive the loss; the whole stack (controller, agents, gateway) serves through
the SIGKILL of a server with no failed request, and nothing moves."""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import nats.errors
import pytest
from nats.js.api import StreamConfig

from events.contract import subjects
from tests.integration.gateway_kit import running_gateway, until
from tests.integration.stack import Stack, echo_spec
from tests.integration.test_failover_processes import serving
from tests.integration.test_gateway_stack import start_clients
from wire.nats_bus import NatsBus, ensure_stream
from wire.nats_cluster import NatsCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
async def cluster(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[NatsCluster]:
    async with NatsCluster(tmp_path / "nats", binary=nats_server_binary) as c:
        yield c


async def test_a_client_moves_to_another_server_when_its_server_dies(
    cluster: NatsCluster,
) -> None:
    a = await NatsBus.connect(cluster.urls, name="a", reconnect_wait=0.1)
    b = await NatsBus.connect(cluster.urls, name="b", reconnect_wait=0.1)
    try:
        assert (a.cluster_size, a.stream_replicas) == (3, 3)
        info = await ensure_stream(
            a.jetstream(timeout=10), StreamConfig(name="T", subjects=["t.>"]), replicas=3
        )
        assert info.config.num_replicas == 3
        got: list[bytes] = []
        await b.subscribe("x", handler=lambda m: got.append(m.data))
        await b.flush()
        port = a.client.connected_url.port
        victim = next(s for s in cluster.servers if s.port == port)
        assert victim.pid is not None
        victim_pid = victim.pid
        began = time.monotonic()
        import os

        os.kill(victim_pid, signal.SIGKILL)
        await until(lambda: a.is_connected and a.client.connected_url.port != port, within=5)
        moved_s = time.monotonic() - began
        await until(lambda: b.is_connected, within=5)
        await a.publish("x", b"after")
        await until(lambda: got == [b"after"], within=5)
        assert moved_s < 2.0
        # The stream lost a copy, not its data: it takes writes again (a quorum of two) once
        # it has elected a leader among the two left, if the dead one led it.
        ack = None
        for _ in range(60):
            try:
                ack = await a.jetstream(timeout=2).publish("t.1", b"still here")
                break
            except nats.errors.Error:
                await asyncio.sleep(0.25)
        assert ack is not None and ack.stream == "T"
    finally:
        await a.close()
        await b.close()


@pytest.mark.timeout(150)
async def test_the_stack_serves_through_the_loss_of_a_nats_server(
    tmp_path: Path, nats_server_binary: Path
) -> None:
    stack = Stack(tmp_path / "stack", agents=3, nats_binary=nats_server_binary, nats_servers=3)
    try:
        await stack.start(timeout=60)
        await stack.create_cluster(echo_spec(3))
        cluster = await serving(stack, 3)
        placed = {(r["replica_id"], r["epoch"]) for r in cluster["replicas"]}
        async with running_gateway(stack.bus) as gw:
            await until(lambda: len(gw.router.routes("echo")) >= 3, within=10)
            stop = asyncio.Event()
            log: list[Any] = []
            async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tasks:
                start_clients(tasks, session, gw.url, stop, log)
                await asyncio.sleep(1.0)
                assert stack.nats_cluster is not None
                # The server that leads the command stream: its loss is the hardest one.
                info = await stack.bus.jetstream(timeout=10).stream_info(subjects.COMMANDS_STREAM)
                assert info.cluster is not None and info.config.num_replicas == 3
                victim = next(
                    s
                    for s in stack.nats_cluster.servers
                    if s.cluster is not None and s.cluster.server_name == info.cluster.leader
                )
                assert victim.pid is not None
                import os

                os.kill(victim.pid, signal.SIGKILL)
                killed_at = time.monotonic()
                await asyncio.sleep(6.0)  # past two leases and the offline window
                stop.set()
        after = [e for e in log if e[0] >= killed_at]
        assert after, "no request after the kill"
        failed = [e for e in log if e[2] != 200]
        assert failed == [], failed[:3]
        # Nothing moved: no node was declared offline, every replica kept its epoch.
        assert stack.events("node.health_changed.v1", state="offline") == []
        cluster = await serving(stack, 3)
        assert {(r["replica_id"], r["epoch"]) for r in cluster["replicas"]} == placed
    finally:
        left = await stack.close()
        assert left == [], f"processes survived the teardown: {left}"


async def test_a_cluster_that_does_not_advertise_leaves_clients_to_their_own_list(
    tmp_path: Path, nats_server_binary: Path
) -> None:
    """`up --ha`'s shape: a client learns of no server it was not given (so a controller behind
    relays cannot dial past them), and still counts the cluster by its list for its streams."""
    async with NatsCluster(tmp_path / "nats", binary=nats_server_binary, advertise=False) as c:
        first = c.servers[0].url
        alone = await NatsBus.connect(first, name="one-url")
        listed = await NatsBus.connect(c.urls, name="listed")
        try:
            assert alone.client.discovered_servers == []
            assert listed.client.discovered_servers == []
            assert [s.netloc for s in alone.client.servers] == [first.split("://")[1]]
            assert (listed.cluster_size, listed.stream_replicas) == (3, 3)
        finally:
            await alone.close()
            await listed.close()
    async with NatsCluster(tmp_path / "nats2", binary=nats_server_binary) as c:
        told = await NatsBus.connect(c.servers[0].url, name="told")
        try:
            # The default advertises: the same single URL learns the other two.
            assert len(told.client.discovered_servers) == 2
            assert told.cluster_size == 3
        finally:
            await told.close()
