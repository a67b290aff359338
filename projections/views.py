"""Read-model shapes. Plain msgspec Structs, so a state compares by value and snapshots cheaply."""

from __future__ import annotations

from typing import Literal

import msgspec

from events import ClusterSpec, GpuInfo, GpuMetrics, StagePlacement
from events.contract.messages import RouteEntry
from events.node import HealthState

Route = RouteEntry  # one ready replica a gateway may use; the wire type, so no conversion

ReplicaStatus = Literal["pending", "placed", "starting", "ready", "failed", "stopping", "stopped"]


class NodeView(msgspec.Struct, kw_only=True):
    node_id: str
    hostname: str = ""
    address: str = ""
    region: str = ""
    zone: str = ""
    labels: dict[str, str] = {}
    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str = ""
    cuda_version: str = ""
    price_per_hour: float = 0.0
    sealing_key: str = ""  # the key secrets are sealed to; "": an agent that takes none
    model_cache: str = ""  # the node's model cache directory; "": none named
    cached_models: tuple[str, ...] = ()  # what it holds (nodeagent/model_cache.py)
    images: tuple[str, ...] = ()  # container images it holds, REPOSITORY:TAG (docker driver)
    health: HealthState = "healthy"
    health_reason: str = "registered"
    health_detail: str = ""
    drained: bool = False
    # Cordon (node.cordoned.v1): 0 none; -1 until uncordoned; otherwise its end, wall clock ns
    # since the epoch. An ended cordon stays recorded here: placements compare it with their
    # clock (actors/scheduler.py), and no event marks its end.
    cordoned_until_ns: int = 0
    cordon_reason: str = ""
    last_heartbeat_at: int = 0  # recorded_at of the latest heartbeat, ns
    last_heartbeat_seq: int = 0
    metrics: tuple[GpuMetrics, ...] = ()
    probe_error: str = ""
    running: tuple[str, ...] = ()
    version: int = 0  # stream version of the last event folded in


class ClusterView(msgspec.Struct, kw_only=True):
    spec: ClusterSpec
    unschedulable: str = ""  # why the last placement attempt found no node
    version: int = 0
    revision: int = 1  # the spec's revision (cluster.spec_changed.v1); creating it is 1
    rolled_out: int = 0  # the last revision every wanted replica ran, ready; 0: none yet
    canary: str = ""  # the canary's cluster while one runs (cluster.canary_started.v1)
    canary_weight: int = 0  # percent of the requests it takes


class ReplicaView(msgspec.Struct, kw_only=True):
    replica_id: str
    cluster: str
    node_id: str
    epoch: int
    gpu_indices: tuple[int, ...] = ()
    status: ReplicaStatus = "placed"
    port: int = 0
    address: str = ""
    failure_reason: str = ""
    failure_detail: str = ""
    failure_node: str = ""  # the node at fault, where the failure names one
    why: str = ""
    version: int = 0
    revision: int = 0  # the cluster spec's revision it runs; 0: placed before revisions
    # Failures of the workload at this revision (readiness, exits, crashes in place), over
    # this slot's placements at it: what an automatic rollback counts.
    crashes: int = 0
    # A sharded replica's pipeline stages (rank 0, the head, is node_id and gpu_indices), and
    # the workers' addresses once each is up (rank -> host:port). Empty for one node.
    stages: tuple[StagePlacement, ...] = ()
    stage_addresses: dict[int, str] = {}

    @property
    def node_ids(self) -> tuple[str, ...]:
        """Every node this replica runs on: its own, then its worker stages' in rank order.
        A sharded replica is lost when any of them is."""
        if not self.stages:
            return (self.node_id,)
        return tuple(stage.node_id for stage in self.stages)

    def holds(self) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(node, GPU indices) for each node whose GPUs it holds while it is live."""
        if not self.stages:
            return ((self.node_id, self.gpu_indices),)
        return tuple((stage.node_id, stage.gpu_indices) for stage in self.stages)


class NodeRegistry(msgspec.Struct, kw_only=True):
    nodes: dict[str, NodeView] = {}


class Clusters(msgspec.Struct, kw_only=True):
    clusters: dict[str, ClusterView] = {}


class Replicas(msgspec.Struct, kw_only=True):
    replicas: dict[str, ReplicaView] = {}


class RoutingTable(msgspec.Struct, kw_only=True):
    """cluster -> ready replicas on routable nodes, with addresses and epochs.

    `routes` is derived from the other fields and kept up to date so a lookup is one dict get.
    """

    routes: dict[str, tuple[Route, ...]] = {}
    live_clusters: dict[str, bool] = {}
    ready: dict[str, dict[str, Route]] = {}  # cluster -> replica_id -> route
    replica_cluster: dict[str, str] = {}
    epochs: dict[str, int] = {}  # replica_id -> newest epoch seen
    placed_nodes: dict[str, str] = {}  # replica_id -> node of the newest epoch
    unroutable_nodes: dict[str, str] = {}  # node_id -> why (offline, unhealthy, removed)


class LinkView(msgspec.Struct, kw_only=True):
    """A link between two nodes as last measured (node.links_measured.v1), either way: a
    pipeline's activations cross it one way and the sampled token the other."""

    rtt_ms: float
    gbps: float
    measured_by: str  # the node that measured it
    measured_at: int = 0  # recorded_at of the measurement, ns
    position: int = 0  # its position in the log


class Links(msgspec.Struct, kw_only=True):
    """The fleet's link view (projections/links.py)."""

    endpoints: dict[str, str] = {}  # node -> its link responder's host:port
    links: dict[str, dict[str, LinkView]] = {}  # node -> peer -> the link (both directions)

    def link(self, a: str, b: str) -> LinkView | None:
        return self.links.get(a, {}).get(b)


class FleetState(msgspec.Struct, kw_only=True):
    """Every projection together, plus where in the log the fold has got to."""

    position: int = 0
    nodes: NodeRegistry = msgspec.field(default_factory=NodeRegistry)
    clusters: Clusters = msgspec.field(default_factory=Clusters)
    replicas: Replicas = msgspec.field(default_factory=Replicas)
    routing: RoutingTable = msgspec.field(default_factory=RoutingTable)
    links: Links = msgspec.field(default_factory=Links)
    undecodable: list[int] = []  # positions kept raw and skipped
