"""The log of record on a NATS cluster of three (events/jetstream_store/ on wire/nats_cluster.py):
a log stream made with one copy (a single server, or an older release) gets the three copies
of the cluster it now runs on when a controller opens it, and keeps every acknowledged event
through the SIGKILL of the server that leads the stream."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from events.envelope import NewEvent
from events.errors import StoreIOError
from events.jetstream_store import JetStreamEventStore, JetStreamOptions
from events.node import NodeRegistered
from wire.nats_bus import NatsBus
from wire.nats_cluster import NatsCluster

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
async def cluster(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[NatsCluster]:
    async with NatsCluster(tmp_path / "nats", binary=nats_server_binary) as c:
        yield c


def event(n: int) -> NewEvent:
    return NewEvent(
        event_id=f"event-{n}", payload=NodeRegistered(node_id="a", hostname="h"), recorded_at=n
    )


@pytest.mark.timeout(90)
async def test_an_r1_log_gets_three_copies_and_survives_its_leaders_loss(
    cluster: NatsCluster,
) -> None:
    bus = await NatsBus.connect(cluster.urls, name="t", reconnect_wait=0.1)
    try:
        one = await JetStreamEventStore.open(bus.client, JetStreamOptions(replicas=1))
        await one.append("node/a", [event(1)], 0)
        await one.close()
        three = await JetStreamEventStore.open(
            bus.client, JetStreamOptions(replicas=bus.stream_replicas)
        )
        js = bus.jetstream(timeout=10)
        info = await js.stream_info("GPUMESH_LOG")
        assert info.config.num_replicas == 3
        for n in range(2, 50):
            await three.append("node/a", [event(n)], n - 1)
        assert info.cluster is not None
        names = [m.server_name for m in cluster.members]
        leader = cluster.servers[names.index(info.cluster.leader or "")]
        assert leader.pid is not None
        os.kill(leader.pid, signal.SIGKILL)
        # The other two elect a new stream leader. An append sent into the change-over may get
        # no answer (StoreIOError); the same append again, as the controller retries, is
        # stored once.
        began = time.monotonic()
        for _ in range(3):
            try:
                assert await three.append("node/a", [event(50)], 49) == [50]
                break
            except StoreIOError:
                continue
        else:
            raise AssertionError("the append was never stored")
        print(f"appended again {time.monotonic() - began:.2f} s after the SIGKILL")
        assert [e.event_id for e in await three.read_all(1, 100)] == [
            f"event-{n}" for n in range(1, 51)
        ]
        await three.close()
    finally:
        await bus.close()


async def test_a_stream_is_never_shrunk_by_a_smaller_view_of_the_cluster(
    cluster: NatsCluster,
) -> None:
    """While a server is down, a process sees a cluster of two and asks for two copies; the
    stream keeps its three (wire/nats_bus.py, ensure_stream)."""
    from nats.js.api import StreamConfig

    from wire.nats_bus import ensure_stream

    bus = await NatsBus.connect(cluster.urls, name="t", reconnect_wait=0.1)
    try:
        js = bus.jetstream(timeout=10)
        await ensure_stream(js, StreamConfig(name="S", subjects=["s.>"]), replicas=3)
        changed = StreamConfig(name="S", subjects=["s.>"], description="another config")
        info = await ensure_stream(js, changed, replicas=2)
        assert info.config.num_replicas == 3
        assert info.config.description == "another config"
    finally:
        await bus.close()
