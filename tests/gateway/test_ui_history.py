"""The clusters page's metrics history (gateway/ui/history.py): rates and latency quantiles per
cluster from the gateway's own registry, the ring, the stream, and the sampling task's life."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from events.contract.messages import RouteEntry, RoutingUpdate
from gateway.auth import KeyRing
from gateway.instruments import Instruments
from gateway.metrics import new_registry
from gateway.router import Router, RouterConfig
from gateway.ui import history as history_module, mount
from gateway.ui.history import MetricsHistory, _quantiles


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def wall_ns(self) -> int:
        return round(self.now * 1e9)


def _instruments() -> Instruments:
    router = Router(Clock(), random.Random(7), RouterConfig(eject_jitter=0.0))
    route = RouteEntry(replica_id="echo-1", node_id="node-1", address="10.0.0.1:8001", epoch=1)
    router.apply(RoutingUpdate(position=1, routes={"echo": (route,)}, clusters=("echo",)))
    return Instruments(new_registry(), router)


def test_rates_and_quantiles_per_cluster_over_each_interval() -> None:
    instruments = _instruments()
    clock = Clock()
    history = MetricsHistory(instruments.registry, clock, interval_s=10, keep_s=30)
    assert history.sample() is None  # where counting starts
    for i in range(90):
        instruments.request("echo", 200, 0.015 + i * 0.0001)  # in (0.01, 0.025]
    for _ in range(10):
        instruments.request("echo", 503, 3.0)  # in (2.5, 5]
    instruments.retry("echo", "connect_error")
    instruments.retry("echo", "reset")
    instruments.request("other", 200, 0.2)
    clock.now += 10
    sample = history.sample()
    assert sample is not None and sample.seconds == 10 and sample.at_ns == round(110 * 1e9)
    echo = sample.clusters["echo"]
    assert (echo.rps, echo.errors, echo.retries) == (10.0, 1.0, 0.2)
    assert echo.p50 is not None and 0.01 < echo.p50 <= 0.025
    assert echo.p99 is not None and 2.5 < echo.p99 <= 5.0
    assert sample.clusters["other"].rps == 0.1
    # A quiet interval: no rate, no latency (a gap in the chart, not a zero).
    clock.now += 10
    quiet = history.sample()
    assert quiet is not None and quiet.clusters["echo"].rps == 0.0
    assert quiet.clusters["echo"].p50 is None and quiet.clusters["echo"].p99 is None
    for _ in range(3):
        clock.now += 10
        history.sample()
    assert len(history.samples) == 3  # 30 s kept at 10 s
    wire = json.loads(json.dumps(history.snapshot(), default=lambda o: o.__struct_fields__))
    assert wire["interval_s"] == 10


def test_quantiles_interpolate_within_the_bucket_as_prometheus_does() -> None:
    buckets = [(0.1, 0.0), (0.2, 100.0), (0.4, 100.0), (float("inf"), 100.0)]
    assert _quantiles([], buckets) == (0.15, 0.199)
    # Everything in +Inf: the highest finite bound.
    assert _quantiles([], [(1.0, 0.0), (float("inf"), 4.0)]) == (1.0, 1.0)
    assert _quantiles(buckets, buckets) == (None, None)


async def test_follow_yields_each_new_sample() -> None:
    instruments = _instruments()
    clock = Clock()
    history = MetricsHistory(instruments.registry, clock, interval_s=10)
    history.sample()
    got: list[Any] = []

    async def reader() -> None:
        async for sample in history.follow(check_s=0.01):
            if sample is not None:
                got.append(sample)
                if len(got) == 2:
                    return

    task = asyncio.create_task(reader())
    await asyncio.sleep(0.02)
    for _ in range(2):
        clock.now += 10
        history.sample()
        await asyncio.sleep(0.02)
    await asyncio.wait_for(task, 1)
    assert [s.at_ns for s in got] == [round(110e9), round(120e9)]
    # Closed (the gateway shuts down): a follower ends at once, not at its next sample.
    follower = history.follow(check_s=10)
    pending = asyncio.ensure_future(anext(follower, "ended"))
    await asyncio.sleep(0.01)
    history.close()
    assert await asyncio.wait_for(pending, 1) == "ended"


async def test_the_gateway_app_samples_while_it_runs_and_streams_samples(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(history_module, "INTERVAL_S", 0.05)
    instruments = _instruments()
    root = web.Application()
    mount(root, None, KeyRing.open(insecure_api=True), registry=instruments.registry)  # type: ignore[arg-type]
    client: TestClient[Any, Any] = TestClient(TestServer(root, host="127.0.0.1"))
    await client.start_server()
    try:
        named = [t for t in asyncio.all_tasks() if t.get_name() == "ui-metrics-history"]
        assert len(named) == 1
        instruments.request("echo", 200, 0.01)
        resp = await client.get("/ui/data/metrics/stream")
        assert resp.headers["Content-Type"] == "text/event-stream"
        seen: list[str] = []
        async with asyncio.timeout(5):
            while not any(line.startswith("event: sample") for line in seen):
                seen.append((await resp.content.readline()).decode().strip())
        assert seen[1] == "event: snapshot"
        snapshot = json.loads(seen[2].removeprefix("data: "))
        assert snapshot["interval_s"] == 0.05
        resp.close()
        body = await (await client.get("/ui/data/metrics")).json()
        assert body["samples"] and body["samples"][-1]["clusters"]["echo"][0] >= 0
    finally:
        await client.close()
    # The app's cleanup cancelled it: no task left behind.
    await asyncio.sleep(0)
    assert not [t for t in asyncio.all_tasks() if t.get_name() == "ui-metrics-history"]


async def test_without_a_registry_there_are_no_charts() -> None:
    root = web.Application()
    mount(root, None, KeyRing.open(insecure_api=True))  # type: ignore[arg-type]
    client: TestClient[Any, Any] = TestClient(TestServer(root, host="127.0.0.1"))
    await client.start_server()
    try:
        body = await (await client.get("/ui/data/metrics")).json()
        assert body == {"interval_s": 0, "keep_s": 0, "samples": []}
        text = await (await client.get("/ui/data/metrics/stream")).text()
        assert "event: snapshot" in text
    finally:
        await client.close()


async def test_an_incident_shows_the_requests_that_failed_or_were_retried_while_it_lasted() -> None:
    from tests.gateway.test_ui_routes import ScriptedController

    controller = ScriptedController()
    start_ns = 1_700_000_000_000_000_000  # where the scripted log's clock starts

    def replica(type_: str, **payload: Any) -> None:
        controller.commit(type_, "replica/echo-0", replica_id="echo-0", **payload)

    replica("replica.placed.v1", cluster="echo", node_id="node-1", epoch=1)
    controller.commit(
        "node.health_changed.v1", "node/node-1", node_id="node-1", state="offline",
        reason="missed_heartbeats",
    )  # fmt: skip
    replica("replica.failed.v1", epoch=1, reason="node_offline")
    instruments = _instruments()
    clock = Clock()
    clock.now = start_ns / 1e9 - 5
    history = MetricsHistory(instruments.registry, clock, interval_s=10)
    history.sample()
    for _ in range(30):
        instruments.request("echo", 200, 0.01)
    for _ in range(4):
        instruments.request("echo", 503, 0.01)
    instruments.retry("echo", "connect_error")
    clock.now += 10
    history.sample()
    from gateway.ui.routes import ui_app

    app = ui_app(controller, KeyRing.open(insecure_api=True), history=history)  # type: ignore[arg-type]
    history.run = asyncio.Event().wait  # type: ignore[method-assign]  # sampled by hand here
    client: TestClient[Any, Any] = TestClient(TestServer(app, host="127.0.0.1"))
    await client.start_server()
    try:
        body = await (await client.get("/data/incidents")).json()
    finally:
        await client.close()
    assert body["count"] == 1
    assert "4 request(s) failed, 1 retried" in body["html"], body["html"]
