"""Fold: the routing table, cluster -> ready replicas a gateway may use.

A replica is routable when it is ready at its newest epoch, its cluster exists, and its node is
not offline, unhealthy or removed. A degraded node still serves while its replicas migrate, and
a suspect one (a few missed heartbeats) until it is declared offline.
"""

from __future__ import annotations

from events import (
    ClusterCreated,
    ClusterDeleted,
    Envelope,
    NodeHealthChanged,
    NodeRemoved,
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaStarting,
    ReplicaStopped,
    ReplicaStopping,
)

from .views import Route, RoutingTable


def apply(state: RoutingTable, envelope: Envelope) -> RoutingTable:
    payload = envelope.payload
    match payload:
        case ReplicaReady(replica_id=rid, epoch=epoch, address=address):
            if epoch != state.epochs.get(rid):
                return state  # stale, or ready without a placement: never routable
            cluster = state.replica_cluster[rid]
            state.ready.setdefault(cluster, {})[rid] = Route(
                replica_id=rid, node_id=state.placed_nodes[rid], address=address, epoch=epoch
            )
            _refresh(state, cluster)
        case ReplicaPlaced(replica_id=rid, cluster=cluster, epoch=epoch, node_id=node_id):
            if epoch <= state.epochs.get(rid, 0):
                return state
            state.epochs[rid] = epoch
            state.replica_cluster[rid] = cluster
            # A new placement supersedes the old one at once: never route to an old epoch.
            ready = state.ready.setdefault(cluster, {})
            ready.pop(rid, None)
            state.placed_nodes[rid] = node_id
            _refresh(state, cluster)
        case (
            ReplicaStarting(replica_id=rid, epoch=epoch)  # restarting in place after a crash
            | ReplicaFailed(replica_id=rid, epoch=epoch)
            | ReplicaStopping(replica_id=rid, epoch=epoch)
            | ReplicaStopped(replica_id=rid, epoch=epoch)
        ):
            if epoch != state.epochs.get(rid) or rid not in state.replica_cluster:
                return state
            cluster = state.replica_cluster[rid]
            if state.ready.get(cluster, {}).pop(rid, None) is not None:
                _refresh(state, cluster)
        case NodeHealthChanged(node_id=node_id, state=health):
            was = node_id in state.unroutable_nodes
            if health in ("offline", "unhealthy"):
                state.unroutable_nodes[node_id] = health
            else:
                state.unroutable_nodes.pop(node_id, None)
            if was != (node_id in state.unroutable_nodes):
                _refresh_node(state, node_id)
        case NodeRemoved(node_id=node_id):
            state.unroutable_nodes[node_id] = "removed"
            _refresh_node(state, node_id)
        case ClusterCreated(spec=spec):
            state.live_clusters[spec.name] = True
            _refresh(state, spec.name)
        case ClusterDeleted(name=name):
            state.live_clusters.pop(name, None)
            _refresh(state, name)
        case _:
            pass
    return state


def _refresh(state: RoutingTable, cluster: str) -> None:
    if not state.live_clusters.get(cluster):
        state.routes.pop(cluster, None)
        return
    ready = state.ready.get(cluster, {})
    routes = tuple(
        ready[rid] for rid in sorted(ready) if ready[rid].node_id not in state.unroutable_nodes
    )
    if routes:
        state.routes[cluster] = routes
    else:
        state.routes.pop(cluster, None)


def _refresh_node(state: RoutingTable, node_id: str) -> None:
    for cluster in sorted(state.ready):
        if any(route.node_id == node_id for route in state.ready[cluster].values()):
            _refresh(state, cluster)
