"""Events in a replica's stream (`replica/<replica_id>`).

A replica id names a slot of a cluster; each placement of that slot carries a higher epoch.
Events of an older epoch than the latest placement are stale and every fold ignores them:
that is what fences a node that comes back from a partition.
"""

from __future__ import annotations

from typing import Literal

import msgspec

FailureReason = Literal[
    "node_offline",  # the node stopped heartbeating
    "node_unhealthy",  # driver, ECC or XID errors on the node
    "workload_exited",  # the process died
    "readiness_timeout",  # it never answered its health path in time
    "liveness_failed",  # it answered, then stopped answering
    "start_failed",  # the driver could not start it at all
    "superseded",  # a newer epoch of the slot exists
]


class Candidate(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One node the scheduler considered, with its score or why it was filtered out."""

    node_id: str
    score: float = 0.0
    rejected: str = ""


class StagePlacement(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One pipeline stage of a sharded replica (docs/sharding.md): a node's GPUs and the
    layers they hold. Rank 0 is the head, which serves the API; the others are workers."""

    rank: int
    node_id: str
    gpu_indices: tuple[int, ...] = ()
    first_layer: int = 0
    last_layer: int = 0  # exclusive: the stage holds layers [first_layer, last_layer)


class ReplicaPlaced(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="replica.placed.v1"
):
    replica_id: str
    cluster: str
    node_id: str
    gpu_indices: tuple[int, ...] = ()
    epoch: int
    why: str = ""  # the winner and why, in one line
    candidates: tuple[Candidate, ...] = ()  # the others, in summary
    # The cluster's spec revision this placement runs (ClusterSpecChanged.revision). Added
    # after v1 was written: 0 in older rows, which predate revisions (so revision 1).
    revision: int = 0
    # A sharded replica's pipeline stages, rank order, the head (rank 0) first and equal to
    # node_id and gpu_indices above; empty for a replica on one node. Added after v1: older
    # rows decode with none. All stages are placed in this one event: a group is placed whole
    # or not at all, and never holds GPUs for a part of itself.
    stages: tuple[StagePlacement, ...] = ()


class ReplicaStarting(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="replica.starting.v1"
):
    replica_id: str
    epoch: int
    port: int = 0


class ReplicaStageReady(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="replica.stage_ready.v1"
):
    """A worker stage (rank >= 1) of a sharded replica is up at `address` (host:port, what the
    head connects to). The head is started once every worker is; the replica is ready when
    the head is (ReplicaReady), never before."""

    replica_id: str
    epoch: int
    rank: int
    node_id: str
    address: str


class ReplicaReady(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="replica.ready.v1"
):
    replica_id: str
    epoch: int
    address: str  # base URL, e.g. http://127.0.0.1:8001


class ReplicaFailed(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="replica.failed.v1"
):
    replica_id: str
    epoch: int
    reason: FailureReason
    detail: str = ""
    # The node at fault where it is known: a sharded replica's failing stage's, so that its
    # replacement avoids that node and not its healthy peers. Added later: "" in older rows.
    node_id: str = ""


class ReplicaStopping(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="replica.stopping.v1"
):
    replica_id: str
    epoch: int
    reason: str = ""


class ReplicaSuspected(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="replica.suspected.v1"
):
    """A gateway ejected this replica after consecutive failures: a hint, not a verdict.

    The controller records it so that `gpumesh events` shows what clients saw before the node's
    heartbeats said anything; health decisions stay with the node's own signals.
    """

    replica_id: str
    epoch: int
    gateway_id: str
    reason: str  # the last failure: connect_error, reset, status_5xx, first_byte_timeout, ...
    failures: int = 0  # consecutive failures that led to the ejection
    ejected_for_s: float = 0.0


class ReplicaStopped(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="replica.stopped.v1"
):
    replica_id: str
    epoch: int
    exit_code: int | None = None
