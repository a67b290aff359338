"""What this gateway reports of each cluster's load to the leader's autoscaler: requests in
flight and held, arrivals and time to first byte, per reporting interval (GatewayLoad on
`gpumesh.v1.gateway.load`; actors/autoscaler.py sums every gateway's).

Counting only, on the injected clock: the simulator's gateway (sim/world.py) counts with the
same code, and the autoscaler sees the same figures there as for real.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from events.contract.messages import ClusterLoad, GatewayLoad
from runtime.env import Clock

# First-byte samples kept per cluster and interval: enough for a median, bounded under a flood.
_TTFT_SAMPLES = 4096


@dataclass(slots=True)
class _Counts:
    in_flight: int = 0
    held: int = 0
    arrived: int = 0  # in the current interval
    ttft_s: list[float] = field(default_factory=list)  # in the current interval

    @property
    def idle(self) -> bool:
        return not (self.in_flight or self.held or self.arrived)


class LoadMeter:
    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._clusters: dict[str, _Counts] = {}
        # Read at the first count or report, not here: a meter may be made before its loop
        # runs (the simulator's world is), and the clock is the running loop's.
        self._interval_began: float | None = None

    def _counts(self, cluster: str) -> _Counts:
        if self._interval_began is None:
            self._interval_began = self._clock.monotonic()
        counts = self._clusters.get(cluster)
        if counts is None:
            counts = self._clusters[cluster] = _Counts()
        return counts

    def arrived(self, cluster: str) -> None:
        self._counts(cluster).arrived += 1

    def hold_began(self, cluster: str) -> int:
        """A request waits for a replica; returns how many of the cluster's now wait."""
        counts = self._counts(cluster)
        counts.held += 1
        return counts.held

    def hold_ended(self, cluster: str) -> None:
        self._counts(cluster).held -= 1

    def sent(self, cluster: str) -> None:
        self._counts(cluster).in_flight += 1

    def first_byte(self, cluster: str, seconds: float) -> None:
        samples = self._counts(cluster).ttft_s
        if len(samples) < _TTFT_SAMPLES:
            samples.append(seconds)

    def done(self, cluster: str) -> None:
        self._counts(cluster).in_flight -= 1

    def held(self, cluster: str) -> int:
        counts = self._clusters.get(cluster)
        return counts.held if counts is not None else 0

    def report(self, gateway_id: str) -> GatewayLoad:
        """The interval since the last report, which begins a new one. Clusters with nothing in
        flight, held or arrived are left out (and forgotten)."""
        now = self._clock.monotonic()
        began = now - 1.0 if self._interval_began is None else self._interval_began
        interval = max(now - began, 1e-9)
        # Arrivals per second over at least a second: a report sent at once for a hold comes
        # a few microseconds into its interval, and one request over 115 us read as 8,700/s.
        rate_over = max(interval, 1.0)
        self._interval_began = now
        clusters: dict[str, ClusterLoad] = {}
        for name in sorted(self._clusters):
            counts = self._clusters[name]
            if counts.idle:
                del self._clusters[name]
                continue
            samples = sorted(counts.ttft_s)
            clusters[name] = ClusterLoad(
                in_flight=counts.in_flight,
                held=counts.held,
                requests_per_s=round(counts.arrived / rate_over, 3),
                ttft_p50_ms=round(samples[len(samples) // 2] * 1000, 3) if samples else 0.0,
            )
            counts.arrived = 0
            counts.ttft_s = []
        return GatewayLoad(gateway_id=gateway_id, interval_s=round(interval, 3), clusters=clusters)
