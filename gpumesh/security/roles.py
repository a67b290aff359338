"""What each role may publish and subscribe to: the whole authorization policy, as data.

A node is confined to its own subjects: it publishes its own heartbeat, registration and
reports, consumes only its own JetStream command consumer, answers only requests it received
(tunnel, fault), and reads replies only under its own inbox prefix. The controller already
refuses a body whose node id differs from its subject's; with these permissions a node cannot
even put a message on another node's subject. docs/security.md has the same table in prose.
"""

from __future__ import annotations

import msgspec

from events.contract import subjects
from wire.nats_access import Role, inbox_prefix
from wire.nats_commands import consumer_name

JS_API = "$JS.API"
JS_ACK = "$JS.ACK"
# An agent streams a tunnelled response to the gateway's reply subject, frame by frame, for as
# long as the workload streams: bound the number and lifetime of those replies generously.
RESPONSE_MAX_MSGS = 1_000_000
RESPONSE_EXPIRES = "1h"
API_READ_VERBS = ("cluster.list", "cluster.get", "node.list", "routing.get", "events.list")


class Permissions(msgspec.Struct, frozen=True):
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    responses: bool = False  # may publish to the reply subject of a request it received


def permissions(role: Role, name: str) -> Permissions | None:
    """The subjects `name` may use; None for the roles that run the control plane (everything)."""
    if role in ("controller", "admin"):
        return None
    inbox = inbox_prefix(role, name) + ".>"
    if role == "node":
        return _node(name, inbox)
    if role == "gateway":
        return Permissions(
            publish=(
                subjects.TUNNEL_ALL,
                subjects.SUSPECT,
                # Its load, each second, for the leader's autoscaler (gateway/load_publisher.py).
                subjects.LOAD,
                # Its tenants' demand, for the other gateways' shares (gateway/quota_share.py).
                subjects.QUOTA,
                # The gateway's admin REST (/api/v1, admin keys only) calls the control API.
                subjects.API_ALL,
                # The last routing table, when no controller answers (wire/routing_log.py).
                f"{JS_API}.STREAM.MSG.GET.{subjects.ROUTING_STREAM}",
            ),
            subscribe=(subjects.ROUTING, subjects.EVENTS_ALL, subjects.QUOTA, inbox),
        )
    # integrator: read the events, live or replayed from JetStream, and the read-only API.
    stream = subjects.EVENTS_STREAM
    return Permissions(
        publish=(
            f"{JS_API}.INFO",
            f"{JS_API}.STREAM.INFO.{stream}",
            f"{JS_API}.CONSUMER.CREATE.{stream}",
            f"{JS_API}.CONSUMER.CREATE.{stream}.>",
            f"{JS_API}.CONSUMER.DURABLE.CREATE.{stream}.>",
            f"{JS_API}.CONSUMER.INFO.{stream}.>",
            f"{JS_API}.CONSUMER.DELETE.{stream}.>",
            f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.>",
            f"{JS_ACK}.{stream}.>",
            *(subjects.api(verb) for verb in API_READ_VERBS),
        ),
        subscribe=(subjects.EVENTS_ALL, inbox),
    )


def _node(node_id: str, inbox: str) -> Permissions:
    stream = subjects.COMMANDS_STREAM
    consumer = consumer_name(node_id)
    return Permissions(
        publish=(
            subjects.register(node_id),
            subjects.heartbeat(node_id),
            subjects.report(node_id),
            subjects.leaving(node_id),
            # Creating its consumer names the filter in the subject, so the server checks that
            # the filter is this node's own command subject and nobody else's.
            f"{JS_API}.CONSUMER.CREATE.{stream}.{consumer}.{subjects.command(node_id)}",
            f"{JS_API}.CONSUMER.INFO.{stream}.{consumer}",
            f"{JS_API}.CONSUMER.MSG.NEXT.{stream}.{consumer}",
            f"{JS_ACK}.{stream}.{consumer}.>",
            # The leader lease, read through its stream's leader when the controller answers
            # nothing (nodeagent/agent.py, a stalled leader; wire/lease_read.py).
            f"{JS_API}.STREAM.MSG.GET.{subjects.LEADER_STREAM}",
            # Stage links (nodeagent/stage_link.py): frames to any node, only as itself (the
            # sender's token in the subject is its own id).
            f"{subjects.PREFIX}.node.*.stagelink.stage.{node_id}.*",
            f"{subjects.PREFIX}.node.*.stagelink.head.{node_id}.*",
            # The CA's revocation list, asked for at start and after a reconnection.
            subjects.CRL_GET,
        ),
        # ... and its renewals going by; the controller's requests to measure its links
        # (nodeagent/link_probe.py, docs/sharding.md).
        subscribe=(
            subjects.tunnel(node_id),
            subjects.fault(node_id),
            subjects.links(node_id),
            f"{subjects.stagelink(node_id)}.>",
            subjects.CRL,
            subjects.LEADER,
            inbox,
        ),
        responses=True,
    )
