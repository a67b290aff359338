"""Property tests: the fold is deterministic, snapshot-safe, replay-safe and compaction-safe."""

from __future__ import annotations

from hypothesis import given, strategies as st

import projections
from events import (
    HEARTBEAT_TYPE,
    DomainEvent,
    Envelope,
    MemoryEventStore,
    NewEvent,
    NodeHeartbeat,
    NodeRegistered,
    Undecodable,
    stream_of,
)
from projections import FleetState
from tests.strategies import NODES, domain_events, logs, metrics

heartbeats = st.builds(
    NodeHeartbeat,
    node_id=st.sampled_from(NODES[:2]),
    seq=st.integers(0, 1000),
    gpus=st.lists(metrics, max_size=2).map(tuple),
)


def fold_all(log: list[Envelope]) -> FleetState:
    return projections.rebuild(log)


@given(log=logs, cut_points=st.lists(st.integers(0, 120), max_size=6))
def test_incremental_fold_equals_rebuild(log: list[Envelope], cut_points: list[int]) -> None:
    # Live: the state is carried across batches of whatever size subscriptions deliver.
    live = FleetState()
    previous = 0
    for cut in [*sorted(cut_points), len(log)]:
        for envelope in log[previous:cut]:
            projections.apply(live, envelope)
        previous = max(previous, cut)
    assert live == fold_all(log)


@given(log=logs, replays=st.lists(st.integers(0, 119), max_size=20))
def test_replayed_positions_are_no_ops(log: list[Envelope], replays: list[int]) -> None:
    state = FleetState()
    for envelope in log:
        projections.apply(state, envelope)
        for index in replays:
            if index < len(log) and log[index].position <= envelope.position:
                projections.apply(state, log[index])
    assert state == fold_all(log)


@given(log=logs, split=st.integers(0, 120))
def test_snapshot_plus_tail_equals_full_fold(log: list[Envelope], split: int) -> None:
    head = projections.rebuild(log[:split])
    restored = projections.restore(projections.snapshot(head))
    assert restored == head
    assert projections.rebuild(log[split:], restored) == fold_all(log)


@given(log=logs)
def test_undecodable_events_are_reported_by_position_never_dropped(log: list[Envelope]) -> None:
    state = fold_all(log)
    assert state.undecodable == [e.position for e in log if isinstance(e.payload, Undecodable)]
    assert state.position == (log[-1].position if log else 0)


# Registered nodes with many heartbeats, so compaction has something to remove that matters.
heartbeat_heavy = st.lists(
    st.one_of(heartbeats, heartbeats, heartbeats, domain_events), max_size=120
).map(lambda rest: [*(NodeRegistered(node_id=n) for n in NODES), *rest])


@given(payloads=heartbeat_heavy, cutoff_percent=st.integers(0, 120))
async def test_heartbeat_compaction_changes_no_projection(
    payloads: list[DomainEvent], cutoff_percent: int
) -> None:
    store = MemoryEventStore()
    versions: dict[str, int] = {}
    for i, payload in enumerate(payloads):
        stream = stream_of(payload)
        event = NewEvent(event_id=f"e{i}", payload=payload, recorded_at=(i + 1) * 1_000_000_000)
        await store.append(stream, [event], versions.get(stream, 0))
        versions[stream] = versions.get(stream, 0) + 1
    before = projections.rebuild(await store.read_all(1, 10_000))
    cutoff = len(payloads) * cutoff_percent * 10_000_000
    removed = await store.compact_heartbeats(cutoff)
    after_log = await store.read_all(1, 10_000)
    assert projections.rebuild(after_log) == before
    heartbeats = sum(1 for p in payloads if isinstance(p, NodeHeartbeat))
    remaining = sum(1 for e in after_log if e.type == HEARTBEAT_TYPE)
    assert remaining + removed == heartbeats
