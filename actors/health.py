"""Node health from heartbeats: pure rules, no clock, no I/O.

Hardware faults (driver, ECC, XID) make a node unhealthy; heat makes it degraded, with
hysteresis so a card hovering at the threshold does not flap; silence is handled by the
NodeActor's timer (missed heartbeats), not here.
"""

from __future__ import annotations

from dataclasses import dataclass

from events import GpuMetrics
from events.node import HealthReason, HealthState

# A node's lease is this share of the silence that makes it offline (clock-rate margin).
LEASE_FRACTION = 0.8


@dataclass(frozen=True, slots=True)
class HealthPolicy:
    heartbeat_interval: float = 1.0
    suspect_after: int = 2  # missed heartbeats before a healthy node is recorded suspect
    offline_after: int = 3  # missed heartbeats before the node is declared offline
    thermal_high_c: float = 85.0  # at or above: degraded
    thermal_low_c: float = 75.0  # at or below again: the thermal condition clears
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
    xid = [g.index for g in gpus if g.xid_errors > 0]
    if xid:
        return Verdict("unhealthy", "xid", f"XID errors on GPU {_list(xid)}")
    hottest = max((g.temperature_c for g in gpus), default=0.0)
    if hottest >= policy.thermal_high_c:
        return Verdict("degraded", "thermal", f"{hottest:.0f} C >= {policy.thermal_high_c:.0f} C")
    if current == "degraded" and current_reason == "thermal" and hottest > policy.thermal_low_c:
        # Still cooling down: stay degraded until below the low mark.
        return Verdict(
            "degraded", "thermal", f"{hottest:.0f} C, cooling to {policy.thermal_low_c:.0f} C"
        )
    return HEALTHY


def missed_heartbeats(now: float, last_seen: float, policy: HealthPolicy) -> int:
    return int((now - last_seen) / policy.heartbeat_interval)


def _list(indices: list[int]) -> str:
    return ",".join(map(str, indices))
