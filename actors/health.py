"""Node health from heartbeats: pure rules, no clock, no I/O.

Hardware faults (driver, uncorrectable ECC, critical XIDs, a failed row remap) make a node
unhealthy; heat and clocks held down by a hardware slowdown make it degraded, with hysteresis
so a card hovering at the threshold does not flap; silence is handled by the NodeActor's
timer (missed heartbeats), not here. docs/gpus.md explains each signal and the XID
classification.
"""

from __future__ import annotations

from dataclasses import dataclass

from events import GpuMetrics
from events.node import SLOWDOWN_REASONS, HealthReason, HealthState

# A node's lease is this share of the silence that makes it offline (clock-rate margin).
LEASE_FRACTION = 0.8

# XIDs after which the GPU is not to be trusted until it is reset or serviced: the node is
# unhealthy and its replicas move (docs/gpus.md, "XID errors", has the sources).
CRITICAL_XIDS: dict[int, str] = {
    48: "double-bit ECC error",
    64: "ECC page retirement or row remap failed",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
# XIDs an application causes (a bad kernel, a page fault in its own memory, its channel
# reset): that process fails and is restarted; the GPU serves others. Reported, not acted on.
APPLICATION_XIDS: dict[int, str] = {
    13: "graphics engine exception (an application's kernel)",
    31: "GPU memory page fault (an application's access)",
    43: "GPU stopped processing (an application's channel reset)",
    45: "preemptive cleanup after an earlier error (an application was stopped)",
}
# Clock event reasons that mean the hardware, not the workload, holds the clocks down. The
# others (idle, a power cap, application clocks, sync boost) are normal under load.
SLOWDOWNS = SLOWDOWN_REASONS


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    heartbeat_interval: float = 1.0
    suspect_after: int = 2  # missed heartbeats before a healthy node is recorded suspect
    offline_after: int = 3  # missed heartbeats before the node is declared offline
    thermal_high_c: float = 85.0  # at or above: degraded
    thermal_low_c: float = 75.0  # at or below again: the thermal condition clears
    # A slowdown (SLOWDOWNS) degrades at once and clears after this many readings in a row
    # without one, on every GPU (GpuMetrics.unthrottled_readings: the agent counts them).
    throttle_clear_after: int = 10
    # An offline node silent this long is removed from the fleet (NodeRemoved, with the
    # reason); 0 keeps it listed as offline for ever.
    remove_offline_after_s: float = 86_400.0

    @property
    def lease_s(self) -> float:
        """How long a node may serve its replicas after a heartbeat without hearing from the
        controller again: strictly less than the silence after which the controller declares
        it offline, measured by the agent from when it sent the heartbeat (before the
        controller saw it), so a lease ends before its replicas could be replaced."""
        return self.offline_after * self.heartbeat_interval * LEASE_FRACTION

    @property
    def grace_s(self) -> float:
        """How long after a controller begins to take heartbeats in it declares nobody suspect
        or offline, and places only on nodes it has heard from: a full lease (a node may
        still serve on one granted before, or kept while no controller answered) plus the
        offline window."""
        return self.lease_s + self.offline_after * self.heartbeat_interval


@dataclass(frozen=True, slots=True)
class Verdict:
    state: HealthState
    reason: HealthReason
    detail: str = ""


HEALTHY = Verdict("healthy", "recovered")


def evaluate(
    gpus: tuple[GpuMetrics, ...],
    probe_error: str,
    current: HealthState,
    current_reason: str,
    policy: HealthPolicy,
) -> Verdict:
    """The health a heartbeat implies, given the node's current verdict (for hysteresis)."""
    if probe_error:
        return Verdict("unhealthy", "driver", probe_error[:200])
    ecc = [g.index for g in gpus if g.ecc_uncorrected > 0]
    if ecc:
        return Verdict("unhealthy", "ecc", f"uncorrectable ECC errors on GPU {_list(ecc)}")
    critical = [(g.index, x) for g in gpus for x in g.xids if x in CRITICAL_XIDS]
    if critical:
        index, xid = critical[0]
        more = f" (+{len(critical) - 1} more)" if len(critical) > 1 else ""
        return Verdict("unhealthy", "xid", f"XID {xid} on GPU {index}: {CRITICAL_XIDS[xid]}{more}")
    # An agent that counts XIDs without naming them: every one counts, as before codes.
    unnamed = [g.index for g in gpus if g.xid_errors > 0 and not g.xids]
    if unnamed:
        return Verdict("unhealthy", "xid", f"XID errors on GPU {_list(unnamed)}")
    failed = [g.index for g in gpus if g.row_remap_failed]
    if failed:
        return Verdict("unhealthy", "ecc", f"row remapping failed on GPU {_list(failed)}")
    hottest = max((g.temperature_c for g in gpus), default=0.0)
    if hottest >= policy.thermal_high_c:
        return Verdict("degraded", "thermal", f"{hottest:.0f} C >= {policy.thermal_high_c:.0f} C")
    if current == "degraded" and current_reason == "thermal" and hottest > policy.thermal_low_c:
        # Still cooling down: stay degraded until below the low mark.
        return Verdict(
            "degraded", "thermal", f"{hottest:.0f} C, cooling to {policy.thermal_low_c:.0f} C"
        )
    slowed = [(g.index, r) for g in gpus for r in g.throttle_reasons if r in SLOWDOWNS]
    if slowed:
        where = ", ".join(f"{r} on GPU {i}" for i, r in slowed[:3])
        return Verdict("degraded", "throttle", where + (", ..." if len(slowed) > 3 else ""))
    if current == "degraded" and current_reason == "throttle":
        # Clean again, but not for long enough: an agent that counts (> 0) must have seen
        # `throttle_clear_after` clean readings in a row on every GPU.
        need = policy.throttle_clear_after
        counts = [g.unthrottled_readings for g in gpus if 0 < g.unthrottled_readings < need]
        if counts:
            return Verdict(
                "degraded", "throttle", f"clocks free for {min(counts)} of {need} readings"
            )
    # A page or row waiting for a reset to be retired or remapped (XID 63) is reported, not
    # acted on: NVIDIA's guidance is that work goes on, new work included, until the reset.
    return HEALTHY


def missed_heartbeats(now: float, last_seen: float, policy: HealthPolicy) -> int:
    return int((now - last_seen) / policy.heartbeat_interval)


def _list(indices: list[int]) -> str:
    return ",".join(map(str, indices))
