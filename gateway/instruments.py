"""The gateway's Prometheus metrics: one object the data path calls, so names live in one place."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric

from .metrics import DEFAULT_BUCKETS, Children
from .router import Router

# Seconds. LLM answers run from milliseconds (embeddings) to minutes (long generations).
LATENCY_BUCKETS = DEFAULT_BUCKETS
# Seconds. A cold start is a replica placed, its model loaded and its readiness probe passed:
# seconds for a small model on a warm node, many minutes for a large one pulled first.
COLD_START_BUCKETS: tuple[float, ...] = (
    0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0, 1200.0,
)  # fmt: skip

_IN_FLIGHT = "gpumesh_gateway_in_flight_requests"
_EJECTED = "gpumesh_gateway_replica_ejected"


class Instruments:
    def __init__(self, registry: CollectorRegistry, router: Router) -> None:
        self.registry = registry
        self._router = router
        self._requests = Children(
            Counter(
                "gpumesh_gateway_requests_total",
                "Requests answered, by cluster and HTTP status (0: the client went away first).",
                ("cluster", "status"),
                registry=registry,
            )
        )
        self._latency = Children(
            Histogram(
                "gpumesh_gateway_request_duration_seconds",
                "From arrival to the last byte of the answer.",
                ("cluster",),
                buckets=LATENCY_BUCKETS,
                registry=registry,
            )
        )
        self._first_byte = Children(
            Histogram(
                "gpumesh_gateway_time_to_first_byte_seconds",
                "From arrival until the replica's answer began (the first token, for streams).",
                ("cluster",),
                buckets=LATENCY_BUCKETS,
                registry=registry,
            )
        )
        self._retries = Children(
            Counter(
                "gpumesh_gateway_retries_total",
                "Attempts beyond the first, by the failure that caused them.",
                ("cluster", "reason"),
                registry=registry,
            )
        )
        self._ejections = Children(
            Counter(
                "gpumesh_gateway_ejections_total",
                "Replicas taken out of this gateway's routing after consecutive failures.",
                ("cluster", "reason"),
                registry=registry,
            )
        )
        self._stream_broken = Children(
            Counter(
                "gpumesh_gateway_stream_errors_total",
                "Answers that broke off after the client got the first byte.",
                ("cluster",),
                registry=registry,
            )
        )
        self._rate_limited = Children(
            Counter(
                "gpumesh_gateway_rate_limited_total",
                "Requests refused with 429, by tenant.",
                ("tenant",),
                registry=registry,
            )
        )
        self._held = Children(
            Gauge(
                "gpumesh_gateway_held_requests",
                "Requests waiting for a replica of the cluster (none ready: a cold start from "
                "zero replicas, or a replacement).",
                ("cluster",),
                registry=registry,
            )
        )
        self._cold_start = Children(
            Histogram(
                "gpumesh_gateway_cold_start_seconds",
                "For a request held while its cluster started from zero replicas: from the "
                "start of its hold until the replica's first byte.",
                ("cluster",),
                buckets=COLD_START_BUCKETS,
                registry=registry,
            )
        )
        # Statuses as label text, made once: str(int) per request is measurable here.
        self._status_text: dict[int, str] = {}
        registry.register(_ReplicaCollector(router))

    def request(self, cluster: str, status: int, seconds: float) -> None:
        text = self._status_text.get(status)
        if text is None:
            text = self._status_text[status] = str(status)
        self._requests(cluster, text).inc()
        self._latency(cluster).observe(seconds)

    def first_byte(self, cluster: str, seconds: float) -> None:
        self._first_byte(cluster).observe(seconds)

    def retry(self, cluster: str, reason: str) -> None:
        self._retries(cluster, reason).inc()

    def ejection(self, cluster: str, reason: str) -> None:
        self._ejections(cluster, reason).inc()

    def stream_broken(self, cluster: str) -> None:
        self._stream_broken(cluster).inc()

    def rate_limited(self, tenant: str) -> None:
        self._rate_limited(tenant).inc()

    def held(self, cluster: str, count: int) -> None:
        self._held(cluster).set(count)

    def cold_start(self, cluster: str, seconds: float) -> None:
        self._cold_start(cluster).observe(seconds)


class _ReplicaCollector:
    """Per replica, at scrape time, from the router: nothing on the data path."""

    def __init__(self, router: Router) -> None:
        self._router = router

    def describe(self) -> list[Metric]:
        return list(self._families())

    def collect(self) -> Iterator[Metric]:
        in_flight, ejected = self._families()
        for route, stats in self._router.stats():
            labels = [route.replica_id, route.node_id]
            in_flight.add_metric(labels, stats.outstanding)
            ejected.add_metric(labels, 1.0 if self._router.is_ejected(route.replica_id) else 0.0)
        yield in_flight
        yield ejected

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, GaugeMetricFamily]:
        labels = ("replica", "node")
        return (
            GaugeMetricFamily(
                _IN_FLIGHT, "Requests sent to a replica and not finished yet.", labels=labels
            ),
            GaugeMetricFamily(
                _EJECTED,
                "1 while this gateway keeps the replica out of its routing.",
                labels=labels,
            ),
        )
