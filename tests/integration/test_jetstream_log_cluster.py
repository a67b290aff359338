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


class _Lease:
    """Always leading: what is refused here is refused by the servers."""

    def holds_lease(self) -> bool:
        return True

    def deposed(self, reason: str) -> None:
        raise AssertionError(f"deposed: {reason}")


@pytest.mark.timeout(90)
async def test_a_leaders_concurrent_appends_are_all_stored_on_three_servers(
    cluster: NatsCluster,
) -> None:
    """A clustered stream takes one conditional publish per subject in flight, and every
    append of a leader is conditional on the one terms subject: appends sent side by side
    were refused (error 10164; 45% of a hundred heartbeats were lost before the writer sent
    one fenced publish at a time and a turn of heartbeats as one batch)."""
    import asyncio

    from actors.fenced_store import fenced
    from events import ANY, LeaderTermBegan, NodeHeartbeat

    bus = await NatsBus.connect(cluster.urls, name="t", reconnect_wait=0.1)
    try:
        store = await JetStreamEventStore.open(bus.client, JetStreamOptions(replicas=3))
        leader = fenced(store, _Lease(), term=1)
        n = iter(range(1, 1_000_000))

        def new(payload: object) -> NewEvent:
            i = next(n)
            return NewEvent(event_id=f"e-{i}", payload=payload, recorded_at=i)  # type: ignore[arg-type]

        await leader.begin_term(new(LeaderTermBegan(controller_id="c1", term=1)))
        for round_ in range(5):
            singles = [
                leader.append(f"node/n{i}", [new(NodeRegistered(node_id=f"n{i}"))], round_)
                for i in range(8)
            ]
            beats = leader.append_many(
                [
                    (f"heartbeat/h{i}", [new(NodeHeartbeat(node_id=f"h{i}", seq=round_))], ANY)
                    for i in range(100)
                ]
            )
            *stored, outcomes = await asyncio.gather(*singles, beats)
            assert all(isinstance(s, list) for s in stored), stored
            assert all(isinstance(o, list) for o in outcomes), outcomes
        for i in range(8):
            assert [e.version for e in await store.read_stream(f"node/n{i}")] == [1, 2, 3, 4, 5]
        assert len(await store.read_stream("heartbeat/h99")) == 5
        await store.close()
    finally:
        await bus.close()
