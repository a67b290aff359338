"""The one tagged union of domain events, and which stream each event belongs to."""

from __future__ import annotations

from typing import TypeAlias

import msgspec

from .cluster import (
    ClusterCanaryEnded,
    ClusterCanaryStarted,
    ClusterCreated,
    ClusterDeleted,
    ClusterRolledOut,
    ClusterScaled,
    ClusterSpecChanged,
    ClusterUnschedulable,
)
from .controller import TERMS_STREAM, ControllerGrace, LeaderTermBegan
from .errors import InvalidAppend
from .ids import valid_id
from .node import (
    NodeCordoned,
    NodeDrained,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeLinksMeasured,
    NodeRegistered,
    NodeRemoved,
    NodeUncordoned,
    NodeUndrained,
)
from .replica import (
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaStageReady,
    ReplicaStarting,
    ReplicaStopped,
    ReplicaStopping,
    ReplicaSuspected,
)

NodeEvent: TypeAlias = (
    NodeRegistered
    | NodeHeartbeat
    | NodeHealthChanged
    | NodeDrained
    | NodeUndrained
    | NodeCordoned
    | NodeUncordoned
    | NodeRemoved
    | NodeLinksMeasured
)
ClusterEvent: TypeAlias = (
    ClusterCreated
    | ClusterSpecChanged
    | ClusterScaled
    | ClusterDeleted
    | ClusterUnschedulable
    | ClusterRolledOut
    | ClusterCanaryStarted
    | ClusterCanaryEnded
)
ReplicaEvent: TypeAlias = (
    ReplicaPlaced
    | ReplicaStarting
    | ReplicaReady
    | ReplicaFailed
    | ReplicaStopping
    | ReplicaStopped
    | ReplicaSuspected
    | ReplicaStageReady
)
ControllerEvent: TypeAlias = ControllerGrace | LeaderTermBegan
DomainEvent: TypeAlias = NodeEvent | ClusterEvent | ReplicaEvent | ControllerEvent

EVENT_TYPES: tuple[type[DomainEvent], ...] = (
    NodeRegistered,
    NodeHeartbeat,
    NodeHealthChanged,
    NodeDrained,
    NodeUndrained,
    NodeCordoned,
    NodeUncordoned,
    NodeRemoved,
    NodeLinksMeasured,
    ClusterCreated,
    ClusterSpecChanged,
    ClusterScaled,
    ClusterDeleted,
    ClusterUnschedulable,
    ClusterRolledOut,
    ClusterCanaryStarted,
    ClusterCanaryEnded,
    ReplicaPlaced,
    ReplicaStarting,
    ReplicaReady,
    ReplicaFailed,
    ReplicaStopping,
    ReplicaStopped,
    ReplicaSuspected,
    ReplicaStageReady,
    ControllerGrace,
    LeaderTermBegan,
)

HEARTBEAT_TYPE = "node.heartbeat.v1"

_NODE_TYPES = (
    NodeRegistered,
    NodeHealthChanged,
    NodeDrained,
    NodeUndrained,
    NodeCordoned,
    NodeUncordoned,
    NodeRemoved,
)
# Heartbeats have a stream of their own beside `node/<id>`: the controller records them in
# batches, one append for many nodes, without taking a turn in each NodeActor's mailbox, and
# the NodeActor, which owns `node/<id>` and its decisions, never races those appends.
# A node's link measurements have one too (`links/<id>`), written by the controller's link
# survey (actors/link_survey.py), for the same reason.
STREAM_KINDS = ("node", "heartbeat", "links", "cluster", "replica", "controller", "leadership")
_CLUSTER_SPEC_TYPES = (ClusterCreated, ClusterSpecChanged)
_CLUSTER_NAMED_TYPES = (
    ClusterScaled,
    ClusterDeleted,
    ClusterUnschedulable,
    ClusterRolledOut,
    ClusterCanaryStarted,
    ClusterCanaryEnded,
)


def type_tag(event: DomainEvent) -> str:
    """The explicit versioned tag stored beside the payload, e.g. `node.heartbeat.v1`."""
    tag = type(event).__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def stream_of(event: DomainEvent) -> str:
    """The stream an event belongs to; an append to any other stream is refused."""
    if isinstance(event, NodeHeartbeat):
        return f"heartbeat/{event.node_id}"
    if isinstance(event, NodeLinksMeasured):
        return f"links/{event.node_id}"
    if isinstance(event, _NODE_TYPES):
        return f"node/{event.node_id}"
    if isinstance(event, _CLUSTER_SPEC_TYPES):
        return f"cluster/{event.spec.name}"
    if isinstance(event, _CLUSTER_NAMED_TYPES):
        return f"cluster/{event.name}"
    if isinstance(event, ControllerGrace):
        return f"controller/{event.controller_id}"
    if isinstance(event, LeaderTermBegan):
        return TERMS_STREAM
    return f"replica/{event.replica_id}"


def stream_name(kind: str, ident: str) -> str:
    """Build `kind/ident`, refusing ids that cannot appear in a NATS subject."""
    if kind not in STREAM_KINDS:
        raise InvalidAppend(
            f"unknown stream kind {kind!r}: expected node, heartbeat, links, cluster, "
            "replica, controller or leadership"
        )
    if not valid_id(ident):
        raise InvalidAppend(f"invalid {kind} id {ident!r}: use 1-128 of [A-Za-z0-9_-]")
    return f"{kind}/{ident}"


def check_stream(stream: str) -> None:
    if stream in _VALID_STREAMS:
        return
    kind, sep, ident = stream.partition("/")
    if not sep:
        raise InvalidAppend(
            f"invalid stream {stream!r}: expected node/<id>, heartbeat/<id>, links/<id>, "
            "cluster/<name>, replica/<id>, controller/<id> or leadership/terms"
        )
    stream_name(kind, ident)
    if len(_VALID_STREAMS) >= _VALID_STREAMS_KEPT:
        _VALID_STREAMS.clear()
    _VALID_STREAMS.add(stream)


# Streams already found valid: every append checks its stream, and a fleet appends to the same
# few thousand over and over (a regular expression per heartbeat otherwise). Only valid names
# are kept, so garbage cannot grow it; the bound covers a fleet's streams many times over.
_VALID_STREAMS: set[str] = set()
_VALID_STREAMS_KEPT = 1 << 17


def event_type_names() -> list[str]:
    return [type_tag_of_class(cls) for cls in EVENT_TYPES]


def type_tag_of_class(cls: type[msgspec.Struct]) -> str:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag
