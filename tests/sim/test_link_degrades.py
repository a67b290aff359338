"""sim/scenarios/sharded-link-degrades.toml: the agents measure their links over the simulated
network (the `slow` fault's latency included), and a group whose link degrades past its bound
moves to nodes with good links, stopped only once the replacement is ready."""

from __future__ import annotations

from events import NodeLinksMeasured, ReplicaPlaced, ReplicaReady, ReplicaStopping
from sim.run import SCENARIOS, run_scenario
from sim.scenario import load


def test_a_degraded_link_moves_the_group_to_good_links_with_no_request_lost() -> None:
    result, world = run_scenario(load(SCENARIOS / "sharded-link-degrades.toml"), seed=1)
    assert result.violations == []
    assert result.availability["big"]["availability"] == 1.0
    log = world.store.read_all_now()
    first = next(e.payload for e in log if isinstance(e.payload, ReplicaPlaced))
    slow_pair = {s.node_id for s in first.stages}
    # What the agents measured: the slowed link's round trip, 20 ms each way, and the others'.
    measured = [
        (e.payload.node_id, m.peer, m.rtt_ms)
        for e in log
        if isinstance(e.payload, NodeLinksMeasured)
        for m in e.payload.links
    ]
    assert any({a, b} == slow_pair and rtt > 40 for a, b, rtt in measured)
    assert all(rtt < 5 for a, b, rtt in measured if not {a, b} & slow_pair)
    (stopping,) = [e for e in log if isinstance(e.payload, ReplicaStopping)]
    assert stopping.payload.replica_id == first.replica_id
    assert stopping.payload.reason.startswith("links too slow: a link too slow: estimated")
    (moved,) = [
        e.payload
        for e in log
        if isinstance(e.payload, ReplicaPlaced) and e.payload.replica_id != first.replica_id
    ]
    assert moved.why.startswith(f"replaces {first.replica_id}: a link too slow")
    assert not {s.node_id for s in moved.stages} & slow_pair
    ready = next(
        e.position
        for e in log
        if isinstance(e.payload, ReplicaReady) and e.payload.replica_id == moved.replica_id
    )
    assert ready < stopping.position
