"""All projections folded together, with the log position they have reached.

`apply` is the single fold the controller, the gateway, the projector, the rebuild command and
the simulator share, so live state and a rebuild cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import msgspec

from events import Envelope, Undecodable

from . import clusters, links, node_registry, replicas, routing
from .views import FleetState

SNAPSHOT_SCHEMA = "fleet-state.v1"

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(FleetState)

Fold = Callable[[FleetState, Envelope], object]


def _nodes(s: FleetState, e: Envelope) -> object:
    return node_registry.apply(s.nodes, e)


def _clusters(s: FleetState, e: Envelope) -> object:
    return clusters.apply(s.clusters, e)


def _replicas(s: FleetState, e: Envelope) -> object:
    return replicas.apply(s.replicas, e)


def _routing(s: FleetState, e: Envelope) -> object:
    return routing.apply(s.routing, e)


def _links(s: FleetState, e: Envelope) -> object:
    return links.apply(s.links, e)


# Which folds care about which stream family, so a heartbeat touches only the registry.
_BY_FAMILY: dict[str, tuple[Fold, ...]] = {
    "node": (_nodes, _routing, _links),
    "links": (_links,),
    "cluster": (_clusters, _routing),
    "replica": (_replicas, _clusters, _routing),
}
_HEARTBEAT: tuple[Fold, ...] = (_nodes,)
_NONE: tuple[Fold, ...] = ()


def apply(state: FleetState, envelope: Envelope) -> FleetState:
    """Fold one committed event into every projection.

    A position at or below the one already reached is a replay and changes nothing. An
    undecodable payload is recorded by position and skipped, never dropped silently.
    """
    if envelope.position <= state.position:
        return state
    state.position = envelope.position
    if isinstance(envelope.payload, Undecodable):
        state.undecodable.append(envelope.position)
        return state
    if envelope.type == "node.heartbeat.v1":
        folds = _HEARTBEAT
    else:
        folds = _BY_FAMILY.get(envelope.stream.partition("/")[0], _NONE)
    for fold in folds:
        fold(state, envelope)
    return state


def rebuild(envelopes: Iterable[Envelope], state: FleetState | None = None) -> FleetState:
    """Fold a sequence of events from scratch (or on top of `state`, e.g. a snapshot)."""
    result = state if state is not None else FleetState()
    for envelope in envelopes:
        apply(result, envelope)
    return result


def snapshot(state: FleetState) -> bytes:
    return _encoder.encode(state)


def restore(data: bytes) -> FleetState:
    return _decoder.decode(data)


def copy(state: FleetState) -> FleetState:
    """A deep copy: folds update in place, so callers that keep a state must copy it."""
    return restore(snapshot(state))
