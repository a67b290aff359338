"""The routing table in concrete scenarios: what a gateway may and may not route to."""

from __future__ import annotations

import projections
from events import (
    ClusterCreated,
    ClusterDeleted,
    ClusterSpec,
    DomainEvent,
    NodeHealthChanged,
    NodeRegistered,
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaStarting,
    ReplicaStopped,
)
from projections import FleetState, Route
from tests.strategies import commit


def fold(*payloads: DomainEvent) -> FleetState:
    return projections.rebuild(commit(list(payloads)))


BASE: tuple[DomainEvent, ...] = (
    NodeRegistered(node_id="n1"),
    NodeRegistered(node_id="n2"),
    ClusterCreated(spec=ClusterSpec(name="llama", replicas=2)),
    ReplicaPlaced(replica_id="llama-0", cluster="llama", node_id="n1", epoch=1),
    ReplicaPlaced(replica_id="llama-1", cluster="llama", node_id="n2", epoch=1),
)


def routes(state: FleetState) -> tuple[Route, ...]:
    return state.routing.routes.get("llama", ())


def test_only_ready_replicas_are_routed() -> None:
    state = fold(*BASE, ReplicaReady(replica_id="llama-0", epoch=1, address="http://a"))
    assert routes(state) == (
        Route(replica_id="llama-0", node_id="n1", address="http://a", epoch=1),
    )
    assert state.replicas.replicas["llama-1"].status == "placed"


def test_an_offline_node_stops_routing_and_recovery_restores_it() -> None:
    ready = (
        ReplicaReady(replica_id="llama-0", epoch=1, address="http://a"),
        ReplicaReady(replica_id="llama-1", epoch=1, address="http://b"),
    )
    offline = NodeHealthChanged(node_id="n1", state="offline", reason="missed_heartbeats")
    state = fold(*BASE, *ready, offline)
    assert [r.replica_id for r in routes(state)] == ["llama-1"]
    back = NodeHealthChanged(node_id="n1", state="healthy", reason="recovered")
    assert [r.replica_id for r in routes(fold(*BASE, *ready, offline, back))] == [
        "llama-0",
        "llama-1",
    ]


def test_a_degraded_node_keeps_serving_while_replicas_migrate() -> None:
    state = fold(
        *BASE,
        ReplicaReady(replica_id="llama-0", epoch=1, address="http://a"),
        NodeHealthChanged(node_id="n1", state="degraded", reason="thermal"),
    )
    assert [r.replica_id for r in routes(state)] == ["llama-0"]


def test_a_suspect_node_is_shown_suspect_and_keeps_serving_until_offline() -> None:
    ready = ReplicaReady(replica_id="llama-0", epoch=1, address="http://a")
    suspect = NodeHealthChanged(
        node_id="n1", state="suspect", reason="missed_heartbeats", detail="2 heartbeats missed"
    )
    state = fold(*BASE, ready, suspect)
    node = state.nodes.nodes["n1"]
    assert (node.health, node.health_reason, node.health_detail) == (
        "suspect",
        "missed_heartbeats",
        "2 heartbeats missed",
    )
    assert [r.replica_id for r in routes(state)] == ["llama-0"]
    assert "n1" not in state.routing.unroutable_nodes
    offline = NodeHealthChanged(node_id="n1", state="offline", reason="missed_heartbeats")
    assert routes(fold(*BASE, ready, suspect, offline)) == ()


def test_a_new_epoch_supersedes_and_stale_events_are_ignored() -> None:
    state = fold(
        *BASE,
        ReplicaReady(replica_id="llama-0", epoch=1, address="http://old"),
        ReplicaPlaced(replica_id="llama-0", cluster="llama", node_id="n2", epoch=2),
        # The partitioned node reports its old replica ready again: fenced by the epoch.
        ReplicaReady(replica_id="llama-0", epoch=1, address="http://old"),
    )
    assert routes(state) == ()
    assert state.replicas.replicas["llama-0"].epoch == 2
    assert state.replicas.replicas["llama-0"].node_id == "n2"
    state = fold(
        *BASE,
        ReplicaReady(replica_id="llama-0", epoch=1, address="http://old"),
        ReplicaPlaced(replica_id="llama-0", cluster="llama", node_id="n2", epoch=2),
        ReplicaReady(replica_id="llama-0", epoch=2, address="http://new"),
        ReplicaStopped(replica_id="llama-0", epoch=1),
    )
    assert routes(state) == (
        Route(replica_id="llama-0", node_id="n2", address="http://new", epoch=2),
    )


def test_failure_and_cluster_deletion_remove_routes() -> None:
    ready = ReplicaReady(replica_id="llama-0", epoch=1, address="http://a")
    failed = ReplicaFailed(replica_id="llama-0", epoch=1, reason="workload_exited")
    assert routes(fold(*BASE, ready, failed)) == ()
    assert routes(fold(*BASE, ready, ClusterDeleted(name="llama"))) == ()
    assert fold(*BASE, ready, failed).replicas.replicas["llama-0"].failure_reason == (
        "workload_exited"
    )


def test_a_replica_restarting_in_place_is_not_routed_until_ready_again() -> None:
    ready = ReplicaReady(replica_id="llama-0", epoch=1, address="http://a")
    restarting = ReplicaStarting(replica_id="llama-0", epoch=1, port=8000)
    assert routes(fold(*BASE, ready, restarting)) == ()
    assert fold(*BASE, ready, restarting).replicas.replicas["llama-0"].status == "starting"
    assert [r.replica_id for r in routes(fold(*BASE, ready, restarting, ready))] == ["llama-0"]
