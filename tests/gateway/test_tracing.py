"""`--trace` (docs/tracing.md): a request's span through a real gateway and a node's fencing
front to a tiny upstream, the client's traceparent continued, the retries as span events.

Needs the extra `gpumesh[tracing]`; skipped without it. That tracing off imports nothing of
opentelemetry is tests/gateway/test_tracing_off.py, which needs no extra.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

pytest.importorskip(
    "opentelemetry.sdk", reason="tracing is the optional extra: pip install 'gpumesh[tracing]'"
)

from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind

from gateway.router import RouterConfig
from gateway.server import Gateway, GatewayConfig
from gateway.tracing import RequestTracer
from nodeagent.fencing_front import DirectFront, front_path
from sim.bus import MemoryBus
from tests.integration.gateway_kit import (
    RoutingSource,
    Upstream,
    free_port,
    route,
    running_gateway,
)
from wire.tracing import FrontTracer

CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def provider(spans: InMemorySpanExporter) -> TracerProvider:
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(spans))
    return tracer_provider


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    started = await Upstream("u0").start()
    try:
        yield started
    finally:
        await started.stop()


@contextlib.asynccontextmanager
async def traced_gateway(
    provider: TracerProvider, routes: dict[str, list[Any]], **config: Any
) -> AsyncIterator[tuple[Gateway, RoutingSource]]:
    bus = MemoryBus()
    async with RoutingSource(bus) as source:
        await source.publish(routes)
        settings = GatewayConfig(gateway_id="gw-trace", port=0, **config)
        async with running_gateway(bus, settings) as gateway:
            gateway.proxy.tracer = RequestTracer(provider)
            yield gateway, source


def server_spans(spans: InMemorySpanExporter, scope: str) -> list[ReadableSpan]:
    found = spans.get_finished_spans()
    return [s for s in found if s.instrumentation_scope and s.instrumentation_scope.name == scope]


def trace_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.trace_id:032x}"


def span_id(span: ReadableSpan) -> str:
    assert span.context is not None
    return f"{span.context.span_id:016x}"


async def test_a_request_gets_one_server_span_and_its_replica_the_traceparent(
    provider: TracerProvider, spans: InMemorySpanExporter, upstream: Upstream
) -> None:
    routes = {"llama": [route("u0", upstream.address)]}
    async with traced_gateway(provider, routes) as (gw, _), aiohttp.ClientSession() as http:
        url, headers = f"{gw.url}/v1/chat/completions", {"X-Request-Id": "req-1"}
        async with http.post(url, json=CHAT, headers=headers) as resp:
            assert resp.status == 200
    [span] = server_spans(spans, "gpumesh.gateway")
    assert span.kind == SpanKind.SERVER
    assert span.name == "POST /v1/chat/completions"
    assert span.parent is None  # the client sent no traceparent: a new trace
    attributes = dict(span.attributes or {})
    assert attributes == {
        "gpumesh.model": "llama",
        "gpumesh.request_id": "req-1",
        "http.request.method": "POST",
        "gpumesh.cluster": "llama",
        "gpumesh.attempts": 1,
        "http.response.status_code": 200,
        "gpumesh.replica": "u0",
        "gpumesh.node": "node-u0",
        "gpumesh.epoch": 1,
    }
    assert span.events == ()  # one attempt: the attributes say where it went
    # The replica's request names the gateway's span as its parent, in the same trace.
    [headers] = upstream.seen
    version, sent_trace, sent_parent, _flags = headers["traceparent"].split("-")
    assert (version, sent_trace, sent_parent) == ("00", trace_id(span), span_id(span))


async def test_the_client_s_traceparent_is_continued_not_passed_through(
    provider: TracerProvider, spans: InMemorySpanExporter, upstream: Upstream
) -> None:
    routes = {"llama": [route("u0", upstream.address)]}
    client = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"
    async with traced_gateway(provider, routes) as (gw, _), aiohttp.ClientSession() as http:
        headers = {"traceparent": client, "tracestate": "vendor=1"}
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT, headers=headers) as r:
            assert r.status == 200
    [span] = server_spans(spans, "gpumesh.gateway")
    assert trace_id(span) == CLIENT_TRACE
    assert span.parent is not None and f"{span.parent.span_id:016x}" == CLIENT_SPAN
    [seen] = upstream.seen
    assert seen.getall("traceparent") == [f"00-{CLIENT_TRACE}-{span_id(span)}-01"]
    assert seen.getall("tracestate") == ["vendor=1"]


async def test_a_retry_and_an_ejection_are_span_events(
    provider: TracerProvider, spans: InMemorySpanExporter, upstream: Upstream
) -> None:
    dead = route("dead", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    routes = {"llama": [dead, route("u0", upstream.address)]}
    async with (
        traced_gateway(provider, routes, router=RouterConfig(eject_after=1)) as (gw, _),
        aiohttp.ClientSession() as http,
    ):
        for _ in range(20):  # the balancer surely picks the dead one once (1 in 2 each)
            async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
            if gw.router.is_ejected("dead"):
                break
    retried = [
        s for s in server_spans(spans, "gpumesh.gateway") if s.attributes["gpumesh.attempts"] == 2
    ]
    assert len(retried) == 1, "ejected after its first failure: tried once only"
    [span] = retried
    events = {e.name: dict(e.attributes or {}) for e in span.events}
    assert [e.name for e in span.events] == [
        "ejection",  # the router's verdict on the failure, as it is counted
        "attempt_failed",
        "retry",
        "attempt",
    ]
    assert events["attempt_failed"]["replica"] == "dead"
    assert events["attempt_failed"]["outcome"] == "connect_error"
    assert events["ejection"]["reason"] == "connect_error"
    assert events["retry"]["next_attempt"] == 2
    assert events["attempt"] == {"attempt": 2, "replica": "u0", "node": "node-u0", "epoch": 1}
    assert span.attributes is not None and span.attributes["gpumesh.replica"] == "u0"


async def test_a_cluster_with_no_replica_shows_its_hold_and_the_refusal(
    provider: TracerProvider, spans: InMemorySpanExporter
) -> None:
    from gateway.retry import RetryPolicy

    async with (
        traced_gateway(provider, {}, retry=RetryPolicy(queue_timeout_s=0.2)) as (gw, source),
        aiohttp.ClientSession() as http,
    ):
        await source.publish({}, "llama")
        await asyncio.sleep(0.1)
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 503
    [span] = server_spans(spans, "gpumesh.gateway")
    assert [e.name for e in span.events] == ["hold", "hold_ended", "refused"]
    hold = dict(span.events[0].attributes or {})
    assert hold["reason"] == "no_ready_replica"
    assert hold["limit_s"] == pytest.approx(0.2, abs=0.05)
    assert span.attributes is not None
    assert span.attributes["error.type"] == "no_ready_replica"
    assert span.status.is_ok is False


async def test_the_fencing_front_s_span_is_a_child_in_the_same_trace(
    provider: TracerProvider, spans: InMemorySpanExporter, upstream: Upstream
) -> None:
    """One front passes r1@1 on to the workload; another, its lease lapsed, fences u1: each
    makes a child span of the gateway's, and the workload's parent is the front's span."""
    passing = DirectFront(
        "127.0.0.1",
        0,
        lambda r, e: upstream.address,
        lambda r, e: "",
        tracer=FrontTracer(provider),
    )
    fencing = DirectFront(
        "127.0.0.1",
        0,
        lambda r, e: upstream.address,
        lambda r, e: "lease lapsed",
        tracer=FrontTracer(provider),
    )
    async with asyncio.TaskGroup() as tasks:
        serving = [tasks.create_task(passing.run()), tasks.create_task(fencing.run())]
        await passing.listening.wait()
        await fencing.listening.wait()
        try:
            routes = {
                "llama": [
                    route("r1", f"http://127.0.0.1:{passing.port}{front_path('r1', 1)}"),
                    route("u1", f"http://127.0.0.1:{fencing.port}{front_path('u1', 3)}", epoch=3),
                ]
            }
            async with (
                traced_gateway(provider, routes, router=RouterConfig(eject_after=5)) as (gw, _),
                aiohttp.ClientSession() as http,
            ):
                for _ in range(20):
                    async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                        assert resp.status == 200
                    if fencing.fenced:
                        break
        finally:
            for task in serving:
                task.cancel()
    assert fencing.fenced == 1
    gateway_spans = server_spans(spans, "gpumesh.gateway")
    front_spans = server_spans(spans, "gpumesh.front")
    by_id = {span_id(s): s for s in gateway_spans}
    for front in front_spans:
        assert front.parent is not None
        parent = by_id[f"{front.parent.span_id:016x}"]
        assert trace_id(front) == trace_id(parent)
    passed = [f for f in front_spans if f.attributes and f.attributes["gpumesh.replica"] == "r1"]
    [fenced] = [f for f in front_spans if f.attributes and f.attributes["gpumesh.replica"] == "u1"]
    assert fenced.attributes is not None
    assert fenced.attributes["gpumesh.fenced"] is True
    assert fenced.attributes["gpumesh.epoch"] == 3
    assert fenced.attributes["http.response.status_code"] == 503
    assert [(e.name, dict(e.attributes or {})) for e in fenced.events] == [
        ("fenced", {"reason": "lease lapsed"})
    ]
    assert passed and all(f.attributes and f.attributes["gpumesh.fenced"] is False for f in passed)
    assert all(f.attributes and f.attributes["gpumesh.front.outcome"] == "passed" for f in passed)
    # The workload got the front's span as its parent, in the gateway's trace.
    front_ids = {span_id(f) for f in passed}
    for headers in upstream.seen:
        _v, sent_trace, sent_parent, _f = headers["traceparent"].split("-")
        assert sent_parent in front_ids
        assert sent_trace in {trace_id(s) for s in gateway_spans}
