"""The NATS subject contract, version 1. docs/subjects.md documents each subject and payload.

Changing a subject or a payload's meaning means a new version prefix (`gpumesh.v2`), never an
edit here: integrators subscribe to these names.
"""

from __future__ import annotations

from events.catalog import check_stream

VERSION = "v1"
PREFIX = f"gpumesh.{VERSION}"

# JetStream streams.
EVENTS_STREAM = "GPUMESH_EVENTS"  # every committed event, for replay by integrators
COMMANDS_STREAM = "GPUMESH_COMMANDS"  # durable per-node command queues
ROUTING_STREAM = "GPUMESH_ROUTING"  # the last routing table, for a gateway with no controller
LEADER_STREAM = "GPUMESH_LEADER"  # the controllers' leader lease, one key

# Headers of a message on the events stream (docs/subjects.md): the event's global position in
# the log and its version in its stream. Only the controller's outbox sets them.
POSITION_HEADER = "Gpumesh-Position"
VERSION_HEADER = "Gpumesh-Stream-Version"

# Agent -> controller.
HEARTBEAT_ALL = f"{PREFIX}.node.*.heartbeat"
REGISTER_ALL = f"{PREFIX}.node.*.register"
REPORT_ALL = f"{PREFIX}.node.*.report"
LEAVING_ALL = f"{PREFIX}.node.*.leaving"  # an agent told to stop (SIGTERM: a preemption)

# Controller -> agent (JetStream), and chaos -> agent (request/reply).
COMMAND_ALL = f"{PREFIX}.node.*.cmd"

# Events, published after commit: gpumesh.v1.events.<kind>.<id>
EVENTS_ALL = f"{PREFIX}.events.>"

# Gateway -> agent: HTTP requests tunnelled over NATS (the overlay transport).
TUNNEL_ALL = f"{PREFIX}.node.*.tunnel"
# Agent <-> agent: pipeline stages' TCP links carried over NATS (the stage link). Every frame's
# subject names its sender in a token NATS permissions pin to the sender's own node id.
STAGELINK_ALL = f"{PREFIX}.node.*.stagelink.>"

# Controller -> agents: the CA's revocation list, at start and whenever it changes; and its
# request subject, for an agent that (re)connects (wire/crl_share.py).
CRL = f"{PREFIX}.security.crl"
CRL_GET = f"{PREFIX}.security.crl.get"

# Controller -> gateways.
ROUTING = f"{PREFIX}.routing"

# The leader lease's key (a JetStream subject): every write of it, a leader's renewal included,
# is also a plain message agents watch (docs/subjects.md, GPUMESH_LEADER).
LEADER = f"{PREFIX}.leader.controller"
# A leader acts at most this long after sending a renewal that then succeeded (actors/
# leadership.py, LeaseTiming.acts_s): an agent that saw a renewal go by, and finds the lease
# still holding it this long after, knows that leader has stopped acting (nodeagent/agent.py).
LEADER_ACTS_S = 1.3

# Gateway -> controller: a replica the gateway ejected after consecutive failures.
SUSPECT = f"{PREFIX}.gateway.suspect"
# Gateways' per-cluster load, every second (GatewayLoad): the autoscaler's input.
LOAD = f"{PREFIX}.gateway.load"
# Gateways -> gateways: each limited tenant's demand on each gateway, every second, so that
# together they serve a tenant no more than its limits (gateway/quota_share.py).
QUOTA = f"{PREFIX}.gateway.quota"

# Control API, request/reply: gpumesh.v1.api.<verb>
API_ALL = f"{PREFIX}.api.>"
API_VERBS = (
    "cluster.create",
    "cluster.list",
    "cluster.get",
    "cluster.scale",
    "cluster.delete",
    "cluster.apply",
    "cluster.history",
    "cluster.rollback",
    "cluster.canary",
    "cluster.promote",
    "cluster.abort",
    "cluster.plan",
    "node.list",
    "node.drain",
    "node.undrain",
    "node.remove",
    "node.cordon",
    "node.uncordon",
    "routing.get",
    "events.list",
)


def heartbeat(node_id: str) -> str:
    return f"{PREFIX}.node.{node_id}.heartbeat"


def register(node_id: str) -> str:
    return f"{PREFIX}.node.{node_id}.register"


def report(node_id: str) -> str:
    return f"{PREFIX}.node.{node_id}.report"


def leaving(node_id: str) -> str:
    return f"{PREFIX}.node.{node_id}.leaving"


def command(node_id: str) -> str:
    return f"{PREFIX}.node.{node_id}.cmd"


def fault(node_id: str) -> str:
    return f"{PREFIX}.node.{node_id}.fault"


def links(node_id: str) -> str:
    """Controller -> agent, request/reply: measure your links to these peers (LinksRequest)."""
    return f"{PREFIX}.node.{node_id}.links"


def tunnel(node_id: str) -> str:
    return f"{PREFIX}.node.{node_id}.tunnel"


def stagelink(node_id: str) -> str:
    """The root of a node's stage link subjects; the node subscribes to `<root>.>`."""
    return f"{PREFIX}.node.{node_id}.stagelink"


def stagelink_to_stage(worker_node: str, head_node: str, stream: str) -> str:
    """Head -> worker: OPEN, then the head's frames of one stream."""
    return f"{stagelink(worker_node)}.stage.{head_node}.{stream}"


def stagelink_to_head(head_node: str, worker_node: str, stream: str) -> str:
    """Worker -> head: ACCEPT or ERROR, then the worker's frames of one stream."""
    return f"{stagelink(head_node)}.head.{worker_node}.{stream}"


def event(stream: str) -> str:
    """`node/gpu-1` -> `gpumesh.v1.events.node.gpu-1`.

    A node's heartbeats (stream `heartbeat/gpu-1`) are published on its node subject, as they
    were before they had a stream of their own: `events.node.gpu-1` still carries everything
    about the node, and the envelope's `stream` tells the two apart. Its link measurements
    (`links/gpu-1`) too.
    """
    check_stream(stream)
    kind, _, ident = stream.partition("/")
    if kind in ("heartbeat", "links"):
        kind = "node"
    return f"{PREFIX}.events.{kind}.{ident}"


def api(verb: str) -> str:
    if verb not in API_VERBS:
        raise ValueError(f"unknown API verb {verb!r}; known: {', '.join(API_VERBS)}")
    return f"{PREFIX}.api.{verb}"


def node_of(subject: str) -> str:
    """The node id token of a `gpumesh.v1.node.<id>.<kind>` subject ('' if it is not one)."""
    parts = subject.split(".")
    if len(parts) == 5 and parts[0] == "gpumesh" and parts[1] == VERSION and parts[2] == "node":
        return parts[3]
    return ""
