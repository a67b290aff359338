"""Fold: replicas, their placement, status and epoch.

An event whose epoch is older than the slot's newest placement is stale and ignored: that is
the fence against a node that returns from a partition still running a superseded replica.
"""

from __future__ import annotations

from events import (
    Envelope,
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaStageReady,
    ReplicaStarting,
    ReplicaStopped,
    ReplicaStopping,
)

from .views import Replicas, ReplicaView

# The failures that are the workload's own (not its node's): what a bad revision causes.
WORKLOAD_FAILURES = frozenset(
    ("workload_exited", "readiness_timeout", "liveness_failed", "start_failed")
)


def apply(state: Replicas, envelope: Envelope) -> Replicas:
    payload = envelope.payload
    if isinstance(payload, ReplicaPlaced):
        current = state.replicas.get(payload.replica_id)
        if current is None or payload.epoch > current.epoch:
            # A slot placed again at the same revision keeps its count: the revision failed.
            same = current is not None and payload.revision and current.revision == payload.revision
            state.replicas[payload.replica_id] = ReplicaView(
                replica_id=payload.replica_id,
                cluster=payload.cluster,
                node_id=payload.node_id,
                epoch=payload.epoch,
                gpu_indices=payload.gpu_indices,
                why=payload.why,
                version=envelope.version,
                revision=payload.revision,
                crashes=current.crashes if same and current is not None else 0,
                stages=payload.stages,
            )
        return state
    if isinstance(payload, ReplicaStageReady):
        view = state.replicas.get(payload.replica_id)
        if view is not None and payload.epoch == view.epoch:
            view.version = envelope.version
            view.stage_addresses = {**view.stage_addresses, payload.rank: payload.address}
        return state
    if not isinstance(
        payload, ReplicaStarting | ReplicaReady | ReplicaFailed | ReplicaStopping | ReplicaStopped
    ):
        return state
    view = state.replicas.get(payload.replica_id)
    if view is None or payload.epoch != view.epoch:
        return state
    view.version = envelope.version
    match payload:
        case ReplicaStarting(port=port):
            if view.status == "ready" and view.revision:
                view.crashes += 1  # it was serving and restarts in place: a crash
            view.status = "starting"
            view.port = port
        case ReplicaReady(address=address):
            view.status = "ready"
            view.address = address
        case ReplicaFailed(reason=reason, detail=detail, node_id=failed_on):
            if reason in WORKLOAD_FAILURES and view.revision and view.status != "failed":
                view.crashes += 1
            view.status = "failed"
            view.failure_reason = reason
            view.failure_detail = detail
            view.failure_node = failed_on
        case ReplicaStopping():
            view.status = "stopping"
        case ReplicaStopped():
            view.status = "stopped"
    return state
