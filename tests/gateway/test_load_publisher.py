"""gateway/load_publisher.py: a GatewayLoad every second, one at once for a cold start (at most
one per cluster per 0.25 s), and a NATS outage logged once, on the simulator's virtual time."""

from __future__ import annotations

import asyncio
import random

import msgspec
import pytest
import structlog

from events.contract import subjects
from events.contract.messages import GatewayLoad, RoutingUpdate
from gateway.dispatch import Dispatcher
from gateway.instruments import Instruments
from gateway.load import LoadMeter
from gateway.load_publisher import LoadPublisher
from gateway.metrics import new_registry, render
from gateway.retry import RetryPolicy
from gateway.router import Router
from runtime.env import BusError
from sim import MemoryBus, SimClock, run_simulation
from tests.gateway.test_dispatch import Upstream, entry


class Bus(MemoryBus):
    """Keeps what went out on the load subject (and when); fails while `down`."""

    def __init__(self) -> None:
        super().__init__()
        self.reports: list[tuple[float, GatewayLoad]] = []
        self.down = False

    async def publish(
        self, subject: str, data: bytes, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        if self.down:
            raise BusError("connection closed")
        assert subject == subjects.LOAD
        at = asyncio.get_running_loop().time()
        self.reports.append((at, msgspec.json.decode(data, type=GatewayLoad)))


def parts(bus: Bus) -> tuple[LoadPublisher, Dispatcher, Router, Instruments]:
    clock = SimClock()
    router = Router(clock, random.Random(1))
    router.apply(
        RoutingUpdate(
            position=1, clusters=("llama", "qwen"), cold_start={"llama": 60.0, "qwen": 60.0}
        )
    )
    meter = LoadMeter(clock)
    instruments = Instruments(new_registry(), router)
    publisher = LoadPublisher(bus, meter, clock, instruments, "gw-1", structlog.get_logger())
    dispatcher = Dispatcher(
        router, RetryPolicy(), clock, random.Random(2), meter=meter, holds=publisher
    )
    return publisher, dispatcher, router, instruments


def test_a_report_every_second_even_with_nothing_to_say() -> None:
    async def scenario() -> list[tuple[float, GatewayLoad]]:
        bus = Bus()
        publisher, *_ = parts(bus)
        task = asyncio.create_task(publisher.run())
        await asyncio.sleep(3.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return bus.reports

    reports = run_simulation(scenario())
    assert [at for at, _ in reports] == [1.0, 2.0, 3.0]
    assert all(r == GatewayLoad(gateway_id="gw-1", interval_s=1.0) for _, r in reports)


def test_a_request_held_at_zero_is_reported_at_once_and_a_burst_once() -> None:
    async def scenario() -> list[tuple[float, GatewayLoad]]:
        bus = Bus()
        publisher, dispatcher, *_ = parts(bus)
        task = asyncio.create_task(publisher.run())
        await asyncio.sleep(1.5)  # one tick went by
        held = [asyncio.create_task(dispatcher.run("llama", Upstream())) for _ in range(5)]
        await asyncio.sleep(0.1)  # the burst: one signal
        held.append(asyncio.create_task(dispatcher.run("qwen", Upstream())))  # another cluster
        await asyncio.sleep(0.1)
        held.append(asyncio.create_task(dispatcher.run("llama", Upstream())))  # within 0.25 s
        await asyncio.sleep(0.2)
        held.append(asyncio.create_task(dispatcher.run("llama", Upstream())))  # 0.3 s after
        await asyncio.sleep(0.01)
        for request in held:
            request.cancel()
        await asyncio.gather(*held, return_exceptions=True)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return bus.reports

    reports = run_simulation(scenario())
    seen = [(round(at, 3), {c: load.held for c, load in r.clusters.items()}) for at, r in reports]
    assert seen == [
        (1.0, {}),
        (1.5, {"llama": 5}),  # at once, not at the next tick
        (1.6, {"llama": 5, "qwen": 1}),
        # The 6th request of llama (0.2 s after its signal) made none; the 7th (0.4 s) did.
        (1.9, {"llama": 7, "qwen": 1}),
    ]


def test_holds_and_cold_starts_are_in_the_metrics() -> None:
    async def scenario() -> str:
        bus = Bus()
        _, dispatcher, router, instruments = parts(bus)
        request = asyncio.create_task(dispatcher.run("llama", Upstream()))
        await asyncio.sleep(12.0)
        during = render(instruments.registry).decode()
        router.apply(
            RoutingUpdate(
                position=2,
                routes={"llama": (entry("llama-0"),)},
                clusters=("llama", "qwen"),
                cold_start={"llama": 60.0},
            )
        )
        dispatcher.notify()
        route, _ = await request
        dispatcher.finished("llama", route, "ok")
        return during + render(instruments.registry).decode()

    text = run_simulation(scenario())
    assert 'gpumesh_gateway_held_requests{cluster="llama"} 1.0' in text
    assert 'gpumesh_gateway_held_requests{cluster="llama"} 0.0' in text
    assert 'gpumesh_gateway_cold_start_seconds_count{cluster="llama"} 1.0' in text
    assert 'gpumesh_gateway_cold_start_seconds_bucket{cluster="llama",le="10.0"} 0.0' in text
    assert 'gpumesh_gateway_cold_start_seconds_bucket{cluster="llama",le="20.0"} 1.0' in text


def test_a_nats_outage_is_logged_once_and_the_reports_go_on() -> None:
    async def scenario() -> list[float]:
        bus = Bus()
        publisher, *_ = parts(bus)
        task = asyncio.create_task(publisher.run())
        bus.down = True
        await asyncio.sleep(3.5)
        bus.down = False
        await asyncio.sleep(1.0)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return [at for at, _ in bus.reports]

    with structlog.testing.capture_logs() as logs:
        published = run_simulation(scenario())
    assert published == [4.0]
    assert [e["event"] for e in logs] == ["load_publish_failed", "load_publish_resumed"]
