"""Fold: clusters and their desired spec."""

from __future__ import annotations

import msgspec

from events import (
    ClusterCanaryEnded,
    ClusterCanaryStarted,
    ClusterCreated,
    ClusterDeleted,
    ClusterRolledOut,
    ClusterScaled,
    ClusterSpecChanged,
    ClusterUnschedulable,
    Envelope,
    ReplicaPlaced,
)

from .views import Clusters, ClusterView


def apply(state: Clusters, envelope: Envelope) -> Clusters:
    match envelope.payload:
        case ClusterCreated(spec=spec):
            state.clusters[spec.name] = ClusterView(spec=spec, version=envelope.version)
        case ClusterSpecChanged(spec=spec, revision=revision):
            view = state.clusters.get(spec.name)
            previous = view.revision if view is not None else 0
            state.clusters[spec.name] = ClusterView(
                spec=spec,
                version=envelope.version,
                revision=revision or previous + 1,
                rolled_out=view.rolled_out if view is not None else 0,
                canary=view.canary if view is not None else "",
                canary_weight=view.canary_weight if view is not None else 0,
            )
        case ClusterRolledOut(name=name, revision=revision):
            view = state.clusters.get(name)
            if view is not None:
                view.rolled_out = revision
                view.version = envelope.version
        case ClusterScaled() as scaled:
            view = state.clusters.get(scaled.name)
            if view is not None:
                view.spec = msgspec.structs.replace(view.spec, replicas=scaled.replicas)
                view.version = envelope.version
        case ClusterCanaryStarted(name=name, canary=canary, weight=weight):
            view = state.clusters.get(name)
            if view is not None:
                view.canary, view.canary_weight = canary, weight
                view.version = envelope.version
        case ClusterCanaryEnded(name=name):
            view = state.clusters.get(name)
            if view is not None:
                view.canary, view.canary_weight = "", 0
                view.version = envelope.version
        case ClusterDeleted() as deleted:
            state.clusters.pop(deleted.name, None)
        case ClusterUnschedulable(name=name, reason=reason):
            view = state.clusters.get(name)
            if view is not None:
                view.unschedulable = reason
                view.version = envelope.version
        case ReplicaPlaced(cluster=name):
            view = state.clusters.get(name)
            if view is not None:
                view.unschedulable = ""
        case _:
            pass
    return state
