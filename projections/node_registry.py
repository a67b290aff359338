"""Fold: the node registry (specs, health, latest heartbeat and GPU metrics).

Only the latest heartbeat is kept, which is what lets old heartbeats be compacted away
without changing this projection.
"""

from __future__ import annotations

from events import (
    Envelope,
    NodeCordoned,
    NodeDrained,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRegistered,
    NodeRemoved,
    NodeUncordoned,
    NodeUndrained,
)

from .views import NodeRegistry, NodeView


def apply(state: NodeRegistry, envelope: Envelope) -> NodeRegistry:
    """Fold one event in. Updates `state` in place and returns it; no I/O, time or randomness."""
    match envelope.payload:
        case NodeHeartbeat() as hb:
            view = state.nodes.get(hb.node_id)
            if view is not None:
                view.last_heartbeat_at = envelope.recorded_at
                view.last_heartbeat_seq = hb.seq
                view.metrics = hb.gpus
                view.probe_error = hb.probe_error
                view.running = hb.running
        case NodeRegistered() as reg:
            previous = state.nodes.get(reg.node_id)
            state.nodes[reg.node_id] = NodeView(
                node_id=reg.node_id,
                hostname=reg.hostname,
                address=reg.address,
                region=reg.region,
                zone=reg.zone,
                labels=dict(reg.labels),
                gpus=reg.gpus,
                driver_version=reg.driver_version,
                cuda_version=reg.cuda_version,
                price_per_hour=reg.price_per_hour,
                sealing_key=reg.sealing_key,
                model_cache=reg.model_cache,
                cached_models=reg.cached_models,
                images=reg.images,
                # A re-registration (agent restart) keeps the verdicts already reached.
                health=previous.health if previous else "healthy",
                health_reason=previous.health_reason if previous else "registered",
                health_detail=previous.health_detail if previous else "",
                drained=previous.drained if previous else False,
                cordoned_until_ns=previous.cordoned_until_ns if previous else 0,
                cordon_reason=previous.cordon_reason if previous else "",
                last_heartbeat_at=previous.last_heartbeat_at if previous else 0,
                last_heartbeat_seq=previous.last_heartbeat_seq if previous else 0,
                metrics=previous.metrics if previous else (),
                probe_error=previous.probe_error if previous else "",
                running=previous.running if previous else (),
                version=envelope.version,
            )
        case NodeHealthChanged() as change:
            view = state.nodes.get(change.node_id)
            if view is not None:
                view.health = change.state
                view.health_reason = change.reason
                view.health_detail = change.detail
                view.version = envelope.version
        case NodeDrained() as drained:
            view = state.nodes.get(drained.node_id)
            if view is not None:
                view.drained = True
                view.version = envelope.version
        case NodeUndrained() as undrained:
            view = state.nodes.get(undrained.node_id)
            if view is not None:
                view.drained = False
                view.version = envelope.version
        case NodeCordoned() as cordoned:
            view = state.nodes.get(cordoned.node_id)
            if view is not None:
                view.cordoned_until_ns = cordoned.until_ns or -1  # 0 in the event: no end
                view.cordon_reason = cordoned.reason
                view.version = envelope.version
        case NodeUncordoned() as uncordoned:
            view = state.nodes.get(uncordoned.node_id)
            if view is not None:
                view.cordoned_until_ns = 0
                view.cordon_reason = ""
                view.version = envelope.version
        case NodeRemoved() as removed:
            state.nodes.pop(removed.node_id, None)
        case _:
            pass
    return state
