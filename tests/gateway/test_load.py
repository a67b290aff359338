"""gateway/load.py: what a gateway reports of each cluster's load (GatewayLoad), counted on the
injected clock."""

from __future__ import annotations

import msgspec

from events.contract.messages import ClusterLoad, GatewayLoad
from gateway.load import LoadMeter
from tests.factories import ManualClock


def test_a_report_counts_the_interval_since_the_last_one() -> None:
    clock = ManualClock()
    meter = LoadMeter(clock)
    for _ in range(3):
        meter.arrived("llama")
    assert meter.hold_began("llama") == 1
    assert meter.hold_began("llama") == 2
    meter.hold_ended("llama")
    meter.sent("llama")
    meter.sent("llama")
    meter.done("llama")
    for seconds in (0.1, 0.3, 0.2):
        meter.first_byte("llama", seconds)
    clock.now += 2.0

    report = meter.report("gw-1")
    assert report == GatewayLoad(
        gateway_id="gw-1",
        interval_s=2.0,
        clusters={"llama": ClusterLoad(in_flight=1, held=1, requests_per_s=1.5, ttft_p50_ms=200.0)},
    )
    assert meter.held("llama") == 1

    # The next interval: arrivals and first bytes start again; in flight and held carry on.
    clock.now += 1.0
    assert meter.report("gw-1").clusters == {"llama": ClusterLoad(in_flight=1, held=1)}


def test_a_cluster_with_nothing_to_say_is_left_out_and_forgotten() -> None:
    clock = ManualClock()
    meter = LoadMeter(clock)
    meter.arrived("llama")
    meter.sent("llama")
    meter.first_byte("llama", 0.05)
    meter.done("llama")
    meter.arrived("qwen")
    meter.hold_began("qwen")
    clock.now += 1.0
    first = meter.report("gw-1")
    assert set(first.clusters) == {"llama", "qwen"}  # llama had an arrival in the interval

    clock.now += 1.0
    second = meter.report("gw-1")
    assert second.clusters == {"qwen": ClusterLoad(held=1)}
    assert meter.held("llama") == 0
    assert meter.held("unknown") == 0


def test_an_empty_report_still_says_the_gateway_is_there() -> None:
    clock = ManualClock()
    meter = LoadMeter(clock)
    clock.now += 1.0
    report = meter.report("gw-1")
    assert report == GatewayLoad(gateway_id="gw-1", interval_s=1.0)
    wire = msgspec.json.decode(msgspec.json.encode(report))
    assert (wire["type"], wire["gateway_id"], "clusters" in wire) == (
        "gateway_load.v1",
        "gw-1",
        False,
    )


def test_first_byte_samples_are_bounded_per_interval() -> None:
    clock = ManualClock()
    meter = LoadMeter(clock)
    meter.arrived("llama")
    for _ in range(4096):
        meter.first_byte("llama", 1.0)
    for _ in range(6000):
        meter.first_byte("llama", 0.001)  # past the bound: not kept, memory stays bounded
    clock.now += 1.0
    assert meter.report("gw-1").clusters["llama"].ttft_p50_ms == 1000.0


def test_a_report_moments_after_an_arrival_does_not_read_as_a_flood() -> None:
    clock = ManualClock()
    meter = LoadMeter(clock)
    meter.arrived("llama")
    meter.hold_began("llama")
    clock.now += 0.000115  # the at-once report of a hold
    assert meter.report("gw-1").clusters["llama"].requests_per_s == 1.0
