"""Fold: the fleet's link view, from the nodes' link measurements (node.links_measured.v1).

Each measurement replaces the link's last one, in both directions (a link is one pair of
nodes, whoever measured it); a measurement that failed (`error`) changes nothing, so a peer
unreachable for a moment keeps its last figures until it is measured again. A node removed
takes its endpoint and its links with it.
"""

from __future__ import annotations

from events import Envelope, NodeLinksMeasured, NodeRemoved

from .views import Links, LinkView


def apply(state: Links, envelope: Envelope) -> Links:
    """Fold one event in. Updates `state` in place and returns it; no I/O, time or randomness."""
    match envelope.payload:
        case NodeLinksMeasured() as measured:
            node = measured.node_id
            if measured.endpoint:
                state.endpoints[node] = measured.endpoint
            for m in measured.links:
                if m.error or m.peer == node:
                    continue
                view = LinkView(
                    rtt_ms=m.rtt_ms,
                    gbps=m.gbps,
                    measured_by=node,
                    measured_at=envelope.recorded_at,
                    position=envelope.position,
                )
                state.links.setdefault(node, {})[m.peer] = view
                state.links.setdefault(m.peer, {})[node] = view
        case NodeRemoved(node_id=node):
            state.endpoints.pop(node, None)
            for peer in state.links.pop(node, {}):
                state.links.get(peer, {}).pop(node, None)
        case _:
            pass
    return state
