"""The gateway's Prometheus metrics: one object the data path calls, so names live in one place."""

from __future__ import annotations

from collections.abc import Iterator

from .metrics import Registry, Sample
from .router import Router

# Seconds. LLM answers run from milliseconds (embeddings) to minutes (long generations).
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class Instruments:
    def __init__(self, registry: Registry, router: Router) -> None:
        self.registry = registry
        self._router = router
        self._requests = registry.counter(
            "gpumesh_gateway_requests_total",
            "Requests answered, by cluster and HTTP status (0: the client went away first).",
            ("cluster", "status"),
        )
        self._latency = registry.histogram(
            "gpumesh_gateway_request_duration_seconds",
            "From arrival to the last byte of the answer.",
            ("cluster",),
            buckets=LATENCY_BUCKETS,
        )
        self._first_byte = registry.histogram(
            "gpumesh_gateway_time_to_first_byte_seconds",
            "From arrival until the replica's answer began (the first token, for streams).",
            ("cluster",),
            buckets=LATENCY_BUCKETS,
        )
        self._retries = registry.counter(
            "gpumesh_gateway_retries_total",
            "Attempts beyond the first, by the failure that caused them.",
            ("cluster", "reason"),
        )
        self._ejections = registry.counter(
            "gpumesh_gateway_ejections_total",
            "Replicas taken out of this gateway's routing after consecutive failures.",
            ("cluster", "reason"),
        )
        self._stream_broken = registry.counter(
            "gpumesh_gateway_stream_errors_total",
            "Answers that broke off after the client got the first byte.",
            ("cluster",),
        )
        self._rate_limited = registry.counter(
            "gpumesh_gateway_rate_limited_total",
            "Requests refused with 429, by tenant.",
            ("tenant",),
        )
        registry.collector(self._replica_samples)

    def request(self, cluster: str, status: int, seconds: float) -> None:
        self._requests.inc(cluster, str(status))
        self._latency.observe(seconds, cluster)

    def first_byte(self, cluster: str, seconds: float) -> None:
        self._first_byte.observe(seconds, cluster)

    def retry(self, cluster: str, reason: str) -> None:
        self._retries.inc(cluster, reason)

    def ejection(self, cluster: str, reason: str) -> None:
        self._ejections.inc(cluster, reason)

    def stream_broken(self, cluster: str) -> None:
        self._stream_broken.inc(cluster)

    def rate_limited(self, tenant: str) -> None:
        self._rate_limited.inc(tenant)

    def _replica_samples(self) -> Iterator[Sample]:
        for route, stats in self._router.stats():
            labels = {"replica": route.replica_id, "node": route.node_id}
            yield Sample(
                "gpumesh_gateway_in_flight_requests",
                labels,
                stats.outstanding,
                help="Requests sent to a replica and not finished yet.",
            )
            yield Sample(
                "gpumesh_gateway_replica_ejected",
                labels,
                1.0 if self._router.is_ejected(route.replica_id) else 0.0,
                help="1 while this gateway keeps the replica out of its routing.",
            )
