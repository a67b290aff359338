"""gateway/metrics.py and gateway/instruments.py: the gateway's metrics on prometheus_client."""

from __future__ import annotations

import random

from prometheus_client import Counter
from prometheus_client.parser import text_string_to_metric_families

from events.contract.messages import RouteEntry, RoutingUpdate
from gateway.instruments import LATENCY_BUCKETS, Instruments
from gateway.metrics import CONTENT_TYPE, Children, new_registry, render
from gateway.router import Router, RouterConfig


class FakeClock:
    def monotonic(self) -> float:
        return 100.0

    def wall_ns(self) -> int:
        return 100 * 10**9


def _router() -> Router:
    router = Router(FakeClock(), random.Random(7), RouterConfig(eject_jitter=0.0))
    route = RouteEntry(replica_id="echo-1", node_id="node-1", address="10.0.0.1:8001", epoch=1)
    router.apply(RoutingUpdate(position=1, routes={"echo": (route,)}, clusters=("echo",)))
    return router


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_instruments_write_every_gateway_metric() -> None:
    registry = new_registry()
    router = _router()
    instruments = Instruments(registry, router)
    instruments.request("echo", 200, 0.003)
    instruments.request("echo", 200, 0.2)
    instruments.request("echo", 503, 40.0)
    instruments.first_byte("echo", 0.002)
    instruments.retry("echo", "connect_error")
    instruments.ejection("echo", "connect_error")
    instruments.stream_broken("echo")
    instruments.rate_limited("alice")
    route = router.stats()[0][0]
    router.started(route)

    text = render(registry).decode()
    samples = _samples(text)
    assert samples["gpumesh_gateway_requests_total", (("cluster", "echo"), ("status", "200"))] == 2
    assert samples["gpumesh_gateway_requests_total", (("cluster", "echo"), ("status", "503"))] == 1
    count = samples["gpumesh_gateway_request_duration_seconds_count", (("cluster", "echo"),)]
    assert count == 3
    le_5ms = (("cluster", "echo"), ("le", "0.005"))
    assert samples["gpumesh_gateway_request_duration_seconds_bucket", le_5ms] == 1
    le_60 = (("cluster", "echo"), ("le", "60.0"))
    assert samples["gpumesh_gateway_request_duration_seconds_bucket", le_60] == 3
    assert samples["gpumesh_gateway_time_to_first_byte_seconds_count", (("cluster", "echo"),)] == 1
    retry = (("cluster", "echo"), ("reason", "connect_error"))
    assert samples["gpumesh_gateway_retries_total", retry] == 1
    assert samples["gpumesh_gateway_ejections_total", retry] == 1
    assert samples["gpumesh_gateway_stream_errors_total", (("cluster", "echo"),)] == 1
    assert samples["gpumesh_gateway_rate_limited_total", (("tenant", "alice"),)] == 1
    replica = (("node", "node-1"), ("replica", "echo-1"))
    assert samples["gpumesh_gateway_in_flight_requests", replica] == 1
    assert samples["gpumesh_gateway_replica_ejected", replica] == 0
    assert "_created" not in text  # new_registry turns those off
    assert "# TYPE gpumesh_gateway_requests_total counter" in text
    assert CONTENT_TYPE.startswith("text/plain; version=0.0.4")


def test_latency_buckets_span_llm_latencies() -> None:
    assert LATENCY_BUCKETS[0] <= 0.005
    assert LATENCY_BUCKETS[-1] >= 120
    assert list(LATENCY_BUCKETS) == sorted(set(LATENCY_BUCKETS))


def test_children_are_found_once_and_kept() -> None:
    registry = new_registry()
    family = Counter("c", "A counter.", ("a", "b"), registry=registry)
    children = Children(family)
    first = children("x", "y")
    assert children("x", "y") is first
    assert first is family.labels("x", "y")
    first.inc()
    assert list(children.values()) == [("x", "y")]
    assert 'c_total{a="x",b="y"} 1.0' in render(registry).decode()
