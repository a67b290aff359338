"""The heartbeat recorder: batched appends to heartbeat streams, and which heartbeats a
NodeActor must see."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from actors.health import HealthPolicy
from actors.heartbeat_recorder import HeartbeatRecorder, NodeLiveness
from events import MemoryEventStore, NodeHeartbeat
from events.contract.messages import Heartbeat, ReplicaState
from events.envelope import NewEvent
from events.errors import EventStoreError
from events.node import GpuMetrics, HealthState
from sim.env import sim_env
from tests.factories import EventMaker

POLICY = HealthPolicy()


class CountingStore(MemoryEventStore):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[int] = []

    async def append_many(
        self, appends: Sequence[tuple[str, Sequence[NewEvent], int]]
    ) -> list[list[int] | EventStoreError]:
        self.calls.append(len(appends))
        return await super().append_many(appends)


def beat(node: str, seq: int, temperature: float = 50.0, **fields: object) -> Heartbeat:
    gpus = (GpuMetrics(index=0, temperature_c=temperature),)
    return Heartbeat(node_id=node, seq=seq, gpus=gpus, **fields)  # type: ignore[arg-type]


class Recorded:
    def __init__(self) -> None:
        self.lost: list[tuple[str, int]] = []

    def __call__(self, kind: str, count: int, detail: str) -> None:
        assert detail
        self.lost.append((kind, count))


async def record(recorder: HeartbeatRecorder, offered: int) -> None:
    await recorder.record_pending()
    assert recorder.recorded == offered


async def test_a_turns_heartbeats_from_many_nodes_are_one_append() -> None:
    store = CountingStore()
    recorder = HeartbeatRecorder(sim_env(1, store), Recorded())
    for n in range(300):
        assert recorder.offer(beat(f"n{n:03d}", 1))
    await record(recorder, 300)
    assert store.calls == [300]
    assert await store.read_stream("node/n000") == []  # the NodeActor's stream is its own


async def test_a_nodes_second_heartbeat_of_a_turn_waits_for_the_next_commit() -> None:
    """One event per stream per append: on JetStream an append of several is an atomic batch,
    of which the server takes only 50 in flight for the whole log."""
    store = CountingStore()
    recorder = HeartbeatRecorder(sim_env(1, store), Recorded())
    for seq in (1, 2, 3):
        assert recorder.offer(beat("n000", seq))
        assert recorder.offer(beat(f"n{seq:03d}", 1))
    await record(recorder, 6)
    assert store.calls == [4, 1, 1]
    stored = await store.read_stream("heartbeat/n000")
    assert [(e.version, e.payload.seq) for e in stored] == [(1, 1), (2, 2), (3, 3)]  # type: ignore[union-attr]


async def test_what_a_heartbeat_records() -> None:
    store = MemoryEventStore()
    recorder = HeartbeatRecorder(sim_env(1, store), Recorded())
    replicas = (
        ReplicaState(replica_id="r1", epoch=2, state="ready"),
        ReplicaState(replica_id="r2", epoch=1, state="stopped"),
    )
    recorder.offer(beat("a", 7, sent_at_ns=123, probe_error="", replicas=replicas))
    await record(recorder, 1)
    (envelope,) = await store.read_stream("heartbeat/a")
    assert envelope.payload == NodeHeartbeat(
        node_id="a",
        seq=7,
        sent_at_ns=123,
        gpus=(GpuMetrics(index=0, temperature_c=50.0),),
        running=("r1@2",),
    )


async def test_versions_go_on_from_an_earlier_controllers_heartbeats() -> None:
    store = MemoryEventStore()
    make = EventMaker()
    earlier = [make(NodeHeartbeat(node_id="a", seq=i)) for i in range(3)]
    await store.append("heartbeat/a", earlier, 0)
    recorder = HeartbeatRecorder(sim_env(1, store), Recorded())
    recorder.offer(beat("a", 3))
    await record(recorder, 1)
    assert await store.stream_version("heartbeat/a") == 4


async def test_a_second_writer_costs_its_heartbeats_and_is_reported() -> None:
    store = MemoryEventStore()
    lost = Recorded()
    recorder = HeartbeatRecorder(sim_env(1, store), lost)
    recorder.offer(beat("a", 1))
    await record(recorder, 1)
    make = EventMaker()
    await store.append("heartbeat/a", [make(NodeHeartbeat(node_id="a", seq=99))], 1)
    recorder.offer(beat("a", 2))
    recorder.offer(beat("b", 1))
    await record(recorder, 2)
    assert lost.lost == [("conflict", 1)]
    recorder.offer(beat("a", 3))  # it goes on from where the stream is now
    await record(recorder, 3)
    assert [e.payload.seq for e in await store.read_stream("heartbeat/a")] == [1, 99, 3]  # type: ignore[union-attr]


async def test_a_refused_write_is_reported_and_the_next_goes_through() -> None:
    class Refusing(MemoryEventStore):
        refuse = True

        async def append_many(
            self, appends: Sequence[tuple[str, Sequence[NewEvent], int]]
        ) -> list[list[int] | EventStoreError]:
            if self.refuse:
                return [EventStoreError("disk full") for _ in appends]
            return await super().append_many(appends)

    store = Refusing()
    lost = Recorded()
    recorder = HeartbeatRecorder(sim_env(1, store), lost)
    recorder.offer(beat("a", 1))
    recorder.offer(beat("b", 1))
    await recorder.record_pending()
    assert recorder.recorded == 0
    store.refuse = False
    recorder.offer(beat("a", 2))
    await record(recorder, 1)
    assert lost.lost == [("store_error", 1), ("store_error", 1)]
    assert [e.payload.seq for e in await store.read_stream("heartbeat/a")] == [2]  # type: ignore[union-attr]


def test_a_full_backlog_refuses_more() -> None:
    recorder = HeartbeatRecorder(sim_env(1), Recorded(), max_pending=2)
    assert recorder.offer(beat("a", 1))
    assert recorder.offer(beat("b", 1))
    assert not recorder.offer(beat("c", 1))


@pytest.mark.parametrize(
    ("held", "temperature", "probe_error", "must_see"),
    [
        (None, 50.0, "", True),  # the actor has not said what it holds yet
        (("healthy", "registered"), 50.0, "", False),  # the common case: nothing to decide
        (("healthy", "recovered"), 90.0, "", True),  # too hot: degraded
        (("degraded", "thermal"), 90.0, "", False),  # still hot: already degraded
        (("degraded", "thermal"), 80.0, "", False),  # cooling, above the low mark
        (("degraded", "thermal"), 70.0, "", True),  # cooled: healthy again
        (("healthy", "registered"), 50.0, "NVML: driver gone", True),
        (("unhealthy", "driver"), 50.0, "NVML: driver gone", False),
        (("offline", "missed_heartbeats"), 50.0, "", True),  # back from silence
    ],
)
def test_a_node_actor_sees_the_heartbeats_that_could_change_its_verdict(
    held: tuple[HealthState, str] | None, temperature: float, probe_error: str, must_see: bool
) -> None:
    liveness = NodeLiveness()
    if held is not None:
        liveness.verdicts["a"] = held
    hb = beat("a", 1, temperature, probe_error=probe_error)
    assert liveness.may_change_verdict(hb, POLICY) is must_see
