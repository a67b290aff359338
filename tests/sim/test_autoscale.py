"""Autoscaling in the simulator: the shipped scenarios drive it with traffic shapes (a spike
absorbed and scaled back down; cold starts from zero and back), the checker's autoscale
invariants catch what they must, and the traffic shapes and `[clusters.autoscale]` parse, or
fail with one line."""

from __future__ import annotations

from typing import Any

import pytest

from events import (
    AutoscaleSpec,
    ClusterCreated,
    ClusterScaled,
    ClusterSpec,
    DomainEvent,
    Envelope,
    stream_of,
)
from sim.clock import SIM_EPOCH_NS
from sim.invariants import Checker
from sim.run import SCENARIOS, run_scenario
from sim.scenario import ScenarioError, TrafficShape, from_mapping, load


def autoscaled(timeline: list[str]) -> list[str]:
    return [
        line.split("autoscaled ")[1].split(" (")[0] for line in timeline if "autoscaled" in line
    ]


def test_a_spike_is_absorbed_and_the_cluster_scaled_back_down() -> None:
    result, _ = run_scenario(load(SCENARIOS / "autoscale-spike.toml"), seed=1)
    assert result.violations == []
    steps = autoscaled(result.timeline)
    counts = [int(step.split(" -> ")[1]) for step in steps]
    assert max(counts) == 5 and counts[-1] == 1, steps  # grew to its max, back to its min
    assert result.availability["chat"]["availability"] == 1.0


def test_scale_to_zero_holds_the_first_requests_and_goes_back_to_zero() -> None:
    result, _ = run_scenario(load(SCENARIOS / "scale-to-zero.toml"), seed=2)
    assert result.violations == []
    assert autoscaled(result.timeline) == ["0 -> 1", "1 -> 0"]
    # Every request, the ones held through the cold start included, was answered.
    chat = result.availability["chat"]
    assert chat["sent"] > 0 and chat["failed"] == {}
    cold = [line for line in result.timeline if "cold start" in line]
    assert len(cold) == 1


class _World:
    def __init__(self) -> None:
        self.notes: list[str] = []

    def note(self, text: str) -> None:
        self.notes.append(text)


def _envelope(payload: DomainEvent, at_s: float, position: int, version: int) -> Envelope:
    return Envelope(
        event_id=f"e{position}",
        stream=stream_of(payload),
        version=version,
        position=position,
        type=type(payload).__struct_config__.tag,  # type: ignore[arg-type]
        recorded_at=SIM_EPOCH_NS + int(at_s * 1e9),
        payload=payload,
    )


POLICY = AutoscaleSpec(min_replicas=1, max_replicas=4, up_window_s=10, down_window_s=60)


def _check(*steps: tuple[float, int, int, str]) -> list[str]:
    checker = Checker(_World())  # type: ignore[arg-type]
    spec = ClusterSpec(name="chat", command="x", autoscale=POLICY)
    checker.check_event(_envelope(ClusterCreated(spec=spec), 0.0, 1, 1))
    for i, (at, previous, replicas, cause) in enumerate(steps):
        scaled = ClusterScaled(name="chat", replicas=replicas, previous=previous, cause=cause)
        checker.check_event(_envelope(scaled, at, i + 2, i + 2))
    return [v.invariant for v in checker.violations]


def test_the_checker_catches_flapping_and_leaving_the_bounds() -> None:
    assert _check((10, 1, 3, "autoscale: up"), (70, 3, 2, "autoscale: down")) == []
    assert _check((10, 1, 3, "autoscale: up"), (30, 3, 2, "autoscale: down")) == [
        "autoscale_no_flapping"
    ]
    assert _check((10, 3, 2, "autoscale: down"), (15, 2, 3, "autoscale: up")) == [
        "autoscale_no_flapping"
    ]
    assert _check((10, 1, 5, "autoscale: up")) == ["autoscale_bounds"]
    # A hand-made scale is no decision of the autoscaler's; bringing it back is not flapping.
    assert _check((10, 1, 3, "autoscale: up"), (11, 3, 9, ""), (12, 9, 4, "autoscale: max")) == []


def test_traffic_shapes() -> None:
    spike = TrafficShape(kind="spike", rate_per_s=2, peak_per_s=40, at_s=10, for_s=5)
    assert [spike.rate(t) for t in (9.9, 10, 14.9, 15)] == [2, 40, 40, 2]
    ramp = TrafficShape(kind="ramp", rate_per_s=0, peak_per_s=10, at_s=10, for_s=10)
    assert [ramp.rate(t) for t in (5, 15, 20, 99)] == [0, 5, 10, 10]
    day = TrafficShape(kind="diurnal", rate_per_s=1, peak_per_s=9, period_s=100)
    assert (day.rate(0), round(day.rate(50), 9), round(day.rate(100), 9)) == (1, 9, 1)
    assert day.peak() == 9 and TrafficShape(rate_per_s=3).peak() == 3


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"traffic": {"rate_per_s": 1, "shape": "wave"}}, "traffic.shape: must be one of"),
        ({"traffic": {"rate_per_s": 1, "surge": 2}}, "traffic.surge: unknown field"),
        (
            {"clusters": [{"name": "a", "autoscale": {"min": 3, "max": 2}}]},
            "clusters[0].autoscale.min: must not exceed autoscale.max (3 > 2)",
        ),
        (
            {"clusters": [{"name": "a", "autoscale": {"mni": 1}}]},
            "clusters[0].autoscale.mni: unknown field",
        ),
    ],
)
def test_bad_shapes_and_policies_are_one_line(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(ScenarioError) as caught:
        from_mapping(raw)
    assert str(caught.value).startswith(message), str(caught.value)
    assert "\n" not in str(caught.value)
