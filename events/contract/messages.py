"""Wire messages on the NATS subjects (events/contract/subjects.py): msgspec JSON, tagged and
versioned.

These are not events: they are requests and reports between processes. The controller turns
the facts they carry into events after validating them.
"""

from __future__ import annotations

import datetime as dt
import re
from typing import Annotated, Any, Literal, TypeAlias

import msgspec

from events.cluster import ClusterSpec
from events.node import GpuInfo, GpuMetrics, LinkMeasurement

ReplicaRunState = Literal["starting", "ready", "failed", "stopped"]


class ReplicaState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What an agent knows about one replica it runs (or ran)."""

    replica_id: str
    epoch: int
    state: ReplicaRunState
    port: int = 0
    address: str = ""
    detail: str = ""
    exit_code: int | None = None


class Register(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="register.v1"):
    """Agent -> controller, request/reply, on connect and on every reconnect."""

    node_id: str
    hostname: str = ""
    address: str = ""
    region: str = ""
    zone: str = ""
    labels: dict[str, str] = {}
    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str = ""
    cuda_version: str = ""
    agent_version: str = ""
    price_per_hour: float = 0.0
    replicas: tuple[ReplicaState, ...] = ()  # what it runs now, so the controller reconciles
    # The node's X25519 public key (32 bytes, base64), which secrets are sealed to
    # (SealedSecrets). Absent: an agent older than `secret_env`, which is sent no secrets.
    sealing_key: str = ""
    # The node's model cache directory (`gpumesh agent --model-cache`) and the names of what it
    # holds (nodeagent/model_cache.py); sent again when that changes. Absent: none.
    model_cache: str = ""
    cached_models: tuple[str, ...] = ()
    # The container images the node holds (the docker driver's `docker image ls`, as
    # REPOSITORY:TAG, sorted, at most 256); absent with the process driver.
    images: tuple[str, ...] = ()


class RegisterReply(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="register_reply.v1"
):
    accepted: bool
    heartbeat_interval_s: float = 1.0
    error: str = ""


class Leaving(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="leaving.v1"):
    """Agent -> controller, request/reply: this node goes away within `grace_s` (a spot
    preemption, a reboot: the agent got SIGTERM). The controller drains it, so its replicas are
    replaced elsewhere first and stopped here after; the agent serves until then."""

    node_id: str
    grace_s: float
    reason: str = ""


class LeavingReply(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="leaving_reply.v1"
):
    accepted: bool
    error: str = ""


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="heartbeat.v1"):
    """Agent -> controller, every heartbeat interval."""

    node_id: str
    seq: int
    sent_at_ns: int = 0  # the agent's wall clock: latency and clock-skew diagnostics
    gpus: tuple[GpuMetrics, ...] = ()
    probe_error: str = ""
    replicas: tuple[ReplicaState, ...] = ()


class ReplicaLease(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A replica the controller holds current on the node, at exactly this epoch."""

    replica_id: str
    epoch: int


class HeartbeatAck(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="heartbeat_ack.v1"
):
    """Controller -> agent, on the reply subject of a heartbeat that asked for one: the node's
    lease. The agent serves only the replicas listed, and only until `lease_s` after it sent
    that heartbeat: by then the controller may have declared it offline and replaced them."""

    node_id: str
    seq: int  # the heartbeat's
    lease_s: float
    replicas: tuple[ReplicaLease, ...] = ()
    term: int = 0  # as StartReplica.term: a lease from an older term than one seen is ignored


class ReplicaReport(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="replica_report.v1"
):
    """Agent -> controller, at once when a replica changes state (not waiting for a heartbeat)."""

    node_id: str
    replica: ReplicaState


class SealedSecrets(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The values of a StartReplica's `secret:` references, sealed to the node's key
    (wire/sealing.py; docs/security.md, Secrets): X25519 between `ephemeral_key` (used for
    this message only) and the node's key, HKDF-SHA256, ChaCha20-Poly1305 over the JSON
    `{name: value}`, with the node, replica and epoch as associated data."""

    ephemeral_key: str  # base64 of the sender's one-time X25519 public key (32 bytes)
    ciphertext: str  # base64 of the ChaCha20-Poly1305 ciphertext, its 16-byte tag at the end


class StageLaunch(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What one stage of a sharded replica needs to join its pipeline (docs/sharding.md): the
    agent fills the command's stage placeholders and GPUMESH_* variables from it. Workers
    (rank >= 1) are started first; the head (rank 0) once every worker is up, with their
    addresses in `peers`."""

    rank: int
    world_size: int
    first_layer: int
    last_layer: int  # exclusive
    total_layers: int
    split: tuple[int, ...] = ()  # layers per stage, rank order
    head_host: str = ""  # the head node's address (a rendezvous for engines that need one)
    peers: tuple[str, ...] = ()  # the head's: each worker's host:port, rank order
    # Each worker's node, rank order (the head's only: with links over the overlay its agent
    # carries a local port to each), and the head's node (a worker's agent admits links from
    # it alone). Added with the stage link: older controllers send neither.
    peer_nodes: tuple[str, ...] = ()
    head_node: str = ""
    overlay: bool = False  # the stages reach each other over the overlay (sharding.stage_links)


class StartReplica(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cmd.start.v1"
):
    command_id: str
    replica_id: str
    epoch: int
    spec: ClusterSpec
    gpu_indices: tuple[int, ...] = ()
    port: int = 0
    # The leadership term of the controller that sent it (0: one that holds no lease). An
    # agent drops a command from a term older than one it has seen: a deposed leader's.
    term: int = 0
    # The values of the spec's `secret:` references, sealed to this node's key; absent when
    # the spec has none (its `file:` references the agent reads itself).
    secrets: SealedSecrets | None = None
    # One stage of a sharded replica (None: the whole replica runs here). Added after v1: an
    # agent older than it would ignore the field and run the spec's own command, so a fleet
    # that serves sharded clusters runs agents of this release or later (docs/sharding.md).
    stage: StageLaunch | None = None


class StopReplica(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cmd.stop.v1"):
    command_id: str
    replica_id: str
    epoch: int
    reason: str = ""
    grace_s: float = 10.0
    term: int = 0  # as StartReplica.term


class PullImage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cmd.pull.v1"):
    """Pull `image` now, ahead of any placement (a spec's `[docker] prepull`). An agent without
    the docker driver logs that it cannot, and acks; an agent older than this command drops it
    as undecodable, and acks. Once pulled, the agent registers again with the image listed."""

    command_id: str
    image: str
    cluster: str = ""  # whose spec asked, for the agent's log
    term: int = 0  # as StartReplica.term


Command: TypeAlias = StartReplica | StopReplica | PullImage


class RevocationList(msgspec.Struct, frozen=True, kw_only=True, tag="crl.v1"):
    """The CA's signed list of revoked TLS certificates, as PEM (`crl.pem`), on
    `gpumesh.v1.security.crl` and in answer to `...crl.get`; `pem` "" when there is none yet.
    An agent takes it only once its signature is shown to be the CA's (wire/crl_share.py)."""

    pem: str = ""


FaultKind = Literal["thermal", "driver", "ecc", "xid", "throttle", "clear"]


class Fault(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="fault.v1"):
    """Chaos -> agent, request/reply: drive a fake GPU (`gpumesh agent fault NODE thermal 95`)."""

    kind: FaultKind
    value: float = 0.0
    gpu: int = -1  # -1: every GPU


class FaultReply(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="fault_reply.v1"
):
    ok: bool
    error: str = ""


# Bounds of a links request: a node measures at most this many peers per request, and
# pushes at most this many bytes to each (nodeagent/link_probe.py refuses more).
LINKS_MAX_PEERS = 64
LINKS_MAX_PUSH_BYTES = 64 * 1024 * 1024
LINKS_MAX_PINGS = 50


class LinkPeer(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A peer to measure the link to: its node id and its link responder's `host:port`."""

    node_id: str
    endpoint: str


class LinksRequest(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="links_request.v1"
):
    """Controller -> agent, request/reply: measure your links to `peers` (their responders,
    directly, as pipeline stages reach each other), `pings` round trips of a few bytes each
    and one push of `push_bytes`; each peer's measurement gives up after `timeout_s`. An empty
    `peers` asks only where this node's responder listens."""

    peers: tuple[LinkPeer, ...] = ()
    pings: int = 5
    push_bytes: int = 1024 * 1024
    timeout_s: float = 2.0


class LinksReply(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="links_reply.v1"
):
    """Agent -> controller: the measurements, in the request's order, and where this node's
    link responder listens (`host:port`; "" when it runs none). `ok` false: the request was
    refused whole (`error`, one line)."""

    ok: bool
    node_id: str = ""
    endpoint: str = ""
    method: str = ""
    links: tuple[LinkMeasurement, ...] = ()
    error: str = ""


class LeaderRecord(msgspec.Struct, frozen=True, kw_only=True):
    """The leader lease's value (`gpumesh.v1.leader.controller`): who leads, since when, when it
    last renewed (the leader's wall clock, ns), and its term (the revision the lease was
    created at; 0 in that first write itself)."""

    controller_id: str
    since_ns: int
    renewed_ns: int = 0
    term: int = 0


class RouteEntry(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    replica_id: str
    node_id: str
    address: str
    epoch: int


class CanarySplit(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A cluster's canary: `weight` percent of the cluster's requests go to the cluster `to`."""

    to: str
    weight: int


class RoutingUpdate(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="routing.v1"
):
    """Controller -> gateways: the whole table at a log position (small; idempotent to apply)."""

    position: int
    routes: dict[str, tuple[RouteEntry, ...]] = {}
    # Every live cluster, with or without routes: a gateway tells "unknown cluster" (404) from
    # "no ready replica yet" (wait, then 503). Absent from controllers older than this field.
    clusters: tuple[str, ...] = ()
    # The model name clients send -> its cluster, where a spec's `model` differs from its name.
    models: dict[str, str] = {}
    # Clusters that scale from zero (`[autoscale] min = 0`) -> how long a gateway holds a
    # request while a replica starts (their `cold_start_timeout_s`). Absent: the usual wait.
    cold_start: dict[str, float] = {}
    # Clusters with a canary (`cluster canary`) -> where and how much of their traffic goes.
    # A gateway sends that share to the canary's cluster while it has a ready replica, and the
    # rest (all of it, when the canary has none) to the cluster. Absent: no split.
    splits: dict[str, CanarySplit] = {}


class ClusterLoad(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One cluster's load as one gateway sees it, over the report's interval."""

    in_flight: int = 0  # requests sent to a replica and not yet answered in full
    held: int = 0  # requests waiting for a replica (none ready: a cold start, a replacement)
    requests_per_s: float = 0.0  # arrivals over the interval
    ttft_p50_ms: float = 0.0  # median time to first byte of the interval's answers; 0: none


class GatewayLoad(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="gateway_load.v1"
):
    """Gateway -> controllers, on `gpumesh.v1.gateway.load` every second (and at once when a
    request is first held for a cluster with no replica): the leader's autoscaler sums the
    current reports of every gateway. A cluster with no traffic in the interval is left out."""

    gateway_id: str
    interval_s: float = 1.0
    clusters: dict[str, ClusterLoad] = {}


_NonNegative = Annotated[float, msgspec.Meta(ge=0)]
_Share = Annotated[float, msgspec.Meta(ge=0, le=1)]


class TenantDemand(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One tenant's demand on one gateway, over the report's interval."""

    requests_per_s: _NonNegative = 0.0  # requests asked for, admitted or not
    tokens_per_min: _NonNegative = 0.0  # tokens its answers were charged (a token budget's)
    share: _Share = 0.0  # the share of the tenant's limits this gateway serves now


class QuotaReport(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="quota_report.v1"
):
    """Gateway -> gateways, on `gpumesh.v1.gateway.quota` every second: every tenant with
    limits in its key file, its demand there and the share of its limits it serves (idle ones
    too). Each gateway sets its shares from these (gateway/quota_share.py). A gateway that says
    nothing for a while is one that is gone."""

    gateway_id: str
    interval_s: float = 1.0
    tenants: dict[str, TenantDemand] = {}
    # This gateway process's own token (its start, in ns): two gateways given one
    # `--gateway-id` are told apart, said so, and share as two. Added later: "" from older ones.
    instance: str = ""


class ReplicaSuspicion(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="suspicion.v1"
):
    """Gateway -> controller: the gateway ejected a replica after consecutive failures."""

    gateway_id: str
    cluster: str
    replica_id: str
    node_id: str
    epoch: int
    reason: str
    failures: int = 0
    ejected_for_s: float = 0.0


class ApiReply(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="api_reply.v1"):
    """Every control API reply. `error` is one line; `data` is the verb's JSON result."""

    ok: bool
    error: str = ""
    data: Any = None


class ScaleRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str
    replicas: int


class NameRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    name: str


class RollbackRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """`cluster.rollback`: record an earlier revision's spec as the next revision."""

    name: str
    to: int = 0  # the revision to go back to; 0: the one before the current


class CanaryRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """`cluster.canary`: serve `spec` (a ClusterSpec mapping, its name the cluster's) beside
    the cluster's own, with `weight` percent of its requests (1..99)."""

    name: str
    spec: dict[str, Any]
    weight: int = 10


class CanaryEndRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """`cluster.promote` and `cluster.abort`: end the cluster's canary."""

    name: str
    reason: str = ""


class DrainRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    node_id: str


class CordonRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """`node.cordon`: no new replicas on the node until `until_ns`; its replicas keep serving."""

    node_id: str
    until_ns: int = 0  # wall clock, ns since the epoch; 0: until node.uncordon
    reason: str = ""


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)([smhd])$")
_UNIT_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_until(text: str, now_ns: int) -> int:
    """A cordon's end as `until_ns`: an ISO 8601 time with `Z` or an offset
    (`2026-11-26T03:00:00Z`, `2026-11-26T04:00+01:00`), or a duration from `now_ns` (`90s`,
    `30m`, `2h`, `1d`). Raises ValueError with a one-line reason. Whether the end is still to
    come is the controller's to judge, on its own clock."""
    text = text.strip()
    if duration := _DURATION.match(text):
        seconds = float(duration.group(1)) * _UNIT_S[duration.group(2)]
        if seconds <= 0:
            raise ValueError(f"until: a duration must be positive, got {text!r}")
        return now_ns + round(seconds * 1e9)
    try:
        when = dt.datetime.fromisoformat(text.replace("z", "Z"))
    except ValueError:
        raise ValueError(
            f"until: not a time or a duration: {text!r} (try 2026-11-26T03:00:00Z, 30m or 2h)"
        ) from None
    if when.tzinfo is None:
        raise ValueError(f"until: {text!r} has no time zone (end it with Z or an offset, +01:00)")
    delta = when - dt.datetime(1970, 1, 1, tzinfo=dt.UTC)
    return (delta.days * 86_400 + delta.seconds) * 1_000_000_000 + delta.microseconds * 1_000


class EventsRequest(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """`events.list`: committed events after a log position, oldest first."""

    after: int = 0
    limit: int = 500
    heartbeats: bool = False  # heartbeats are most of the log; leave them out unless asked


WireMessage: TypeAlias = (
    Register
    | RegisterReply
    | Heartbeat
    | HeartbeatAck
    | ReplicaReport
    | StartReplica
    | StopReplica
    | PullImage
    | Fault
    | FaultReply
    | RoutingUpdate
    | ReplicaSuspicion
    | GatewayLoad
    | QuotaReport
    | ApiReply
)
CreateClusterRequest = ClusterSpec
