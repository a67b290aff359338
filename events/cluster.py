"""Events in a cluster's stream (`cluster/<name>`) and the spec they carry."""

from __future__ import annotations

import msgspec

from .replica import Candidate


class GpuRequirement(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    models: tuple[str, ...] = ()  # accepted GPU models; empty accepts any
    min_vram_mib: int = 0
    count: int = 1  # GPUs per replica


class ClusterSpec(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What a user declares: what to run, on which GPUs, how many replicas."""

    name: str
    replicas: int = 1
    gpu: GpuRequirement = GpuRequirement()
    command: str = ""  # with {port}, {gpu_ids} and {model} substituted
    image: str = ""
    model: str = ""  # the model name clients send; defaults to the cluster name
    env: dict[str, str] = {}
    port: int = 0  # 0: the agent picks a free port
    health_path: str = "/health"
    preferred_region: str = ""  # a ranking preference among the nodes that pass the filters
    labels: dict[str, str] = {}  # node labels a placement requires
    # Regions a replica may be placed in (a hard filter); empty allows any. Added after v1 was
    # written, so older logs decode with the default and mean what they meant: anywhere.
    regions: tuple[str, ...] = ()


class ClusterCreated(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.created.v1"
):
    spec: ClusterSpec


class ClusterSpecChanged(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.spec_changed.v1"
):
    spec: ClusterSpec


class ClusterScaled(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.scaled.v1"
):
    name: str
    replicas: int
    previous: int = 0


class ClusterDeleted(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.deleted.v1"
):
    name: str


class ClusterUnschedulable(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="cluster.unschedulable.v1"
):
    """The scheduler found no node for a replica the cluster wants: the decision and why."""

    name: str
    missing: int  # replicas wanted but not placed
    reason: str
    candidates: tuple[Candidate, ...] = ()
