"""The last 15 minutes of this gateway's own metrics per cluster, for the clusters page's charts.

Every `interval_s` (10 s) `MetricsHistory.run` reads the gateway's Prometheus registry (the
counters and the latency histogram gateway/instruments.py keeps; nothing is added to the data
path) and keeps, per cluster, what changed since the last read: requests per second, errors
(answers with a 5xx status) per second, retries per second, and the latency p50 and p99 of the
requests answered in that interval, estimated from the histogram's buckets as Prometheus's
`histogram_quantile` does. 90 samples: 15 minutes. The task that samples belongs to the
dashboard's sub-application: started with the gateway's app and cancelled by its cleanup.

Pages follow new samples on `/ui/data/metrics/stream` (server-sent events): no polling loop in
the browser. What a gateway shows is what went through that gateway; with several gateways
each has its own.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Final

import msgspec
from prometheus_client import CollectorRegistry
from prometheus_client.core import Metric

from runtime.env import Clock

INTERVAL_S: Final = 10.0
KEEP_S: Final = 900.0
REQUESTS: Final = "gpumesh_gateway_requests_total"
LATENCY: Final = "gpumesh_gateway_request_duration_seconds"
RETRIES: Final = "gpumesh_gateway_retries_total"
_QUANTILES: Final = (0.5, 0.99)


class ClusterRates(msgspec.Struct, frozen=True, array_like=True):
    """One cluster over one interval: [rps, errors/s, retries/s, p50 s, p99 s] on the wire
    (null latencies: nothing answered in the interval)."""

    rps: float
    errors: float
    retries: float
    p50: float | None
    p99: float | None


class Sample(msgspec.Struct, frozen=True):
    at_ns: int  # the end of the interval, wall clock
    seconds: float  # its length
    clusters: dict[str, ClusterRates]


class _Totals(msgspec.Struct):
    """Cumulative values read from the registry at one instant, per cluster."""

    requests: dict[str, float]
    errors: dict[str, float]
    retries: dict[str, float]
    buckets: dict[str, list[tuple[float, float]]]  # cluster -> [(le, cumulative count)]


class MetricsHistory:
    def __init__(
        self,
        registry: CollectorRegistry,
        clock: Clock,
        *,
        interval_s: float | None = None,
        keep_s: float | None = None,
    ) -> None:
        self._registry = registry
        self._clock = clock
        # The defaults read now, not at import: a test may shorten them for a gateway it starts.
        self.interval_s = interval_s or INTERVAL_S
        self.keep_s = keep_s or KEEP_S
        self.samples: deque[Sample] = deque(maxlen=max(1, round(self.keep_s / self.interval_s)))
        self._last: tuple[float, _Totals] | None = None
        self._changed = asyncio.Event()
        self.closed = False

    async def run(self) -> None:
        """Sample every `interval_s` until cancelled (the app's cleanup cancels it)."""
        self.sample()
        while True:
            await asyncio.sleep(self.interval_s)
            self.sample()

    def sample(self) -> Sample | None:
        """Read the registry now; the first read only sets where the next one counts from."""
        now = self._clock.monotonic()
        totals = _read(self._registry.collect())
        last, self._last = self._last, (now, totals)
        if last is None:
            return None
        then, before = last
        seconds = now - then
        if seconds <= 0:
            return None
        sample = Sample(self._clock.wall_ns(), round(seconds, 3), _rates(before, totals, seconds))
        self.samples.append(sample)
        # Wake every stream waiting, then arm the next wait.
        self._changed.set()
        self._changed = asyncio.Event()
        return sample

    def close(self) -> None:
        """The gateway is shutting down: every follow() ends, so the pages' streams end
        rather than hold the shutdown until its timeout."""
        self.closed = True
        self._changed.set()

    def snapshot(self) -> dict[str, object]:
        return {"interval_s": self.interval_s, "keep_s": self.keep_s, "samples": list(self.samples)}

    async def follow(self, *, check_s: float = 1.0) -> AsyncIterator[Sample | None]:
        """Each new sample as it is taken; None every `check_s` of quiet, so that a stream can
        look at its client."""
        seen = self.samples[-1].at_ns if self.samples else 0
        while not self.closed:
            # Looked at before each wait: a sample taken while the caller had the last one
            # set an event this loop had not yet picked up.
            fresh = [sample for sample in self.samples if sample.at_ns > seen]
            if fresh:
                seen = fresh[-1].at_ns
                for sample in fresh:
                    yield sample
                continue
            try:
                async with asyncio.timeout(check_s):
                    await self._changed.wait()
            except TimeoutError:
                yield None

    def window(self, lo_ns: int, hi_ns: int, clusters: Iterable[str]) -> list[Sample]:
        """The samples whose interval overlaps [lo_ns, hi_ns], narrowed to `clusters`."""
        wanted = set(clusters)
        return [
            Sample(
                s.at_ns,
                s.seconds,
                {name: rates for name, rates in s.clusters.items() if name in wanted},
            )
            for s in self.samples
            if s.at_ns >= lo_ns and s.at_ns - round(s.seconds * 1e9) <= hi_ns
        ]


def _read(metrics: Iterable[Metric]) -> _Totals:
    totals = _Totals({}, {}, {}, {})
    for metric in metrics:
        for s in metric.samples:
            cluster = s.labels.get("cluster")
            if cluster is None:
                continue
            if s.name == REQUESTS:
                totals.requests[cluster] = totals.requests.get(cluster, 0.0) + s.value
                if s.labels.get("status", "").startswith("5"):
                    totals.errors[cluster] = totals.errors.get(cluster, 0.0) + s.value
            elif s.name == RETRIES:
                totals.retries[cluster] = totals.retries.get(cluster, 0.0) + s.value
            elif s.name == f"{LATENCY}_bucket":
                le = float(s.labels["le"])
                totals.buckets.setdefault(cluster, []).append((le, s.value))
    for buckets in totals.buckets.values():
        buckets.sort()
    return totals


def _rates(before: _Totals, now: _Totals, seconds: float) -> dict[str, ClusterRates]:
    out = {}
    for cluster in sorted(now.requests.keys() | now.retries.keys()):

        def delta(field: str, name: str = cluster) -> float:
            was: dict[str, float] = getattr(before, field)
            got: dict[str, float] = getattr(now, field)
            # A counter that went down was reset (a new registry): count from zero.
            d = got.get(name, 0.0) - was.get(name, 0.0)
            return d if d >= 0 else got.get(name, 0.0)

        p50, p99 = _quantiles(before.buckets.get(cluster, []), now.buckets.get(cluster, []))
        out[cluster] = ClusterRates(
            rps=round(delta("requests") / seconds, 3),
            errors=round(delta("errors") / seconds, 3),
            retries=round(delta("retries") / seconds, 3),
            p50=p50,
            p99=p99,
        )
    return out


def _quantiles(
    before: list[tuple[float, float]], now: list[tuple[float, float]]
) -> tuple[float | None, float | None]:
    """p50 and p99 of what the histogram counted between two reads: linear within the bucket
    the rank falls in (from the bucket below's bound, 0 for the first), the highest finite
    bound for a rank in +Inf."""
    was = dict(before)
    counts = [(le, c - was.get(le, 0.0)) for le, c in now]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None, None
    found: list[float | None] = []
    for q in _QUANTILES:
        rank = q * total
        lower, below = 0.0, 0.0
        value: float | None = None
        for le, count in counts:
            if count >= rank:
                if math.isinf(le):
                    value = lower
                else:
                    inside = count - below
                    share = (rank - below) / inside if inside > 0 else 1.0
                    value = lower + (le - lower) * share
                break
            lower, below = (le if not math.isinf(le) else lower), count
        found.append(None if value is None else round(value, 4))
    return found[0], found[1]


__all__ = ["INTERVAL_S", "ClusterRates", "MetricsHistory", "Sample"]
