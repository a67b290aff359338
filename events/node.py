"""Events in a node's stream (`node/<node_id>`)."""

from __future__ import annotations

from typing import Literal

import msgspec

# "suspect" (silent for `suspect_after` heartbeats, not yet `offline_after`) was added to v1
# after the others: every row written before still decodes with the meaning it had. A suspect
# node takes no new replicas; the ones it runs keep serving unless it goes offline.
HealthState = Literal["healthy", "suspect", "degraded", "unhealthy", "offline"]
HealthReason = Literal[
    "registered",  # first verdict after registration
    "recovered",  # the condition that changed health has cleared
    "missed_heartbeats",  # suspect/offline from silence
    "thermal",  # temperature over the threshold (degraded, with hysteresis)
    # The clocks held down by a hardware slowdown, power brake or thermal slowdown (degraded,
    # with hysteresis). Added to v1 later, as "suspect" was: older readers keep such a row as
    # undecodable rather than misread it.
    "throttle",
    "ecc",  # uncorrectable ECC errors
    "xid",  # XID errors reported by the driver
    "driver",  # the GPU probe itself fails
    "partition",  # reachable by some parties and not others
    "gateway_suspicion",  # a gateway ejected the node's replicas
]


# Clock event ("throttle") reasons that mean the hardware, not the workload, holds a GPU's
# clocks down: they degrade a node (actors/health.py). The others NVML gives (gpu_idle,
# sw_power_cap, applications_clocks_setting, sync_boost, display_clock_setting) are normal.
SLOWDOWN_REASONS = frozenset(
    {"hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown"}
)


class GpuInfo(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """Static facts about one GPU, read once at registration."""

    index: int
    uuid: str
    model: str
    vram_mib: int


class GpuMetrics(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One GPU's live readings, carried in every heartbeat."""

    index: int
    temperature_c: float = 0.0
    utilization_pct: float = 0.0
    memory_used_mib: int = 0
    memory_total_mib: int = 0
    ecc_uncorrected: int = 0
    xid_errors: int = 0  # XID events since the agent opened the driver (all of them)
    throttle_reasons: tuple[str, ...] = ()
    power_w: float = 0.0
    # Added to v1 later, each with a default, so every heartbeat written before still decodes
    # (docs/gpus.md says what each means and which make a node unhealthy):
    # the XID codes among `xid_errors`, distinct, ascending; () from an agent that counts
    # XIDs without naming them.
    xids: tuple[int, ...] = ()
    # Readings in a row, this one included, with no slowdown among `throttle_reasons`
    # (the agent counts, since it sees every reading); 0 from an agent that does not count.
    unthrottled_readings: int = 0
    # Memory the driver took out of use after errors (pre-A100 cards retire pages, A100 and
    # later remap rows); 0/False where the card does neither (most consumer cards).
    retired_pages: int = 0
    retired_pages_pending: bool = False  # a page waits for a GPU reset to be retired
    remapped_rows: int = 0
    row_remap_pending: bool = False  # a row waits for a GPU reset to be remapped
    row_remap_failed: bool = False  # a row could not be remapped: no spare rows left


class NodeRegistered(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="node.registered.v1"
):
    node_id: str
    hostname: str = ""
    address: str = ""  # where the node's workloads are reachable (host)
    region: str = ""
    zone: str = ""
    labels: dict[str, str] = {}
    gpus: tuple[GpuInfo, ...] = ()
    driver_version: str = ""
    cuda_version: str = ""
    agent_version: str = ""
    price_per_hour: float = 0.0
    # The node's X25519 public key (base64) that secrets are sealed to; "" for an agent older
    # than `secret_env` (and in every row written before it), which is sent no secrets.
    sealing_key: str = ""
    # The node's model cache directory and what it holds (nodeagent/model_cache.py), for
    # placement; added after v1, so older rows decode with none.
    model_cache: str = ""
    cached_models: tuple[str, ...] = ()
    images: tuple[str, ...] = ()  # the container images it holds (docker driver)


class NodeHeartbeat(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="node.heartbeat.v1"
):
    node_id: str
    seq: int  # the agent's own counter, to spot reordering and restarts
    sent_at_ns: int = 0  # the agent's wall clock when it sent the heartbeat
    gpus: tuple[GpuMetrics, ...] = ()
    probe_error: str = ""  # non-empty when the GPU probe failed this time
    running: tuple[str, ...] = ()  # replica ids ("<replica>@<epoch>") the agent runs


class NodeHealthChanged(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="node.health_changed.v1"
):
    node_id: str
    state: HealthState
    reason: HealthReason
    detail: str = ""


class NodeDrained(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="node.drained.v1"
):
    node_id: str
    reason: str = ""
    # The agent said it is going away (Leaving): registering again undrains it.
    leaving: bool = False


class NodeUndrained(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="node.undrained.v1"
):
    """The node takes new replicas again (a drain taken back by the operator)."""

    node_id: str
    reason: str = ""


class NodeCordoned(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="node.cordoned.v1"
):
    """No new replicas go to the node until `until_ns` (wall clock, ns since the epoch; 0: until
    it is uncordoned); the replicas it runs keep serving. A cordon recorded again replaces the
    one before. Its end needs no event of its own: placements accept the node again once the
    clock passes it."""

    node_id: str
    until_ns: int = 0
    reason: str = ""


class NodeUncordoned(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="node.uncordoned.v1"
):
    """The cordon is lifted before its end: the node takes new replicas again."""

    node_id: str
    reason: str = ""


class NodeRemoved(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="node.removed.v1"
):
    node_id: str
    reason: str = ""


class LinkMeasurement(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One link as a node measured it to a peer (nodeagent/link_probe.py, docs/sharding.md):
    the median round trip of small pings, and the throughput of a timed push of bytes."""

    peer: str
    rtt_ms: float = 0.0
    gbps: float = 0.0
    error: str = ""  # why it could not be measured (rtt_ms and gbps are 0 then)


class NodeLinksMeasured(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="node.links_measured.v1"
):
    """A node's links to some peers, measured on the controller's request. In the node's
    stream of links, `links/<node_id>`, apart from `node/<node_id>` (whose NodeActor owns it),
    as heartbeats are. `endpoint`: where the node's link responder listens (host:port), which
    its peers dial to measure their links to it."""

    node_id: str
    endpoint: str = ""
    method: str = ""  # how it was measured, e.g. "tcp: median of 5 pings, 1048576 bytes"
    links: tuple[LinkMeasurement, ...] = ()
