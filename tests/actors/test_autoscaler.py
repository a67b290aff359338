"""The autoscaler's rule, pure: bounds, windows, scale to zero and the cold start, and the
invariants the simulator also checks (never outside min..max, no decision reversed within its
window) over arbitrary load, by hypothesis."""

from __future__ import annotations

import math

from hypothesis import given, settings, strategies as st

from actors.autoscaler import REPORT_FRESH_S, Decision, Load, LoadBoard, ScalingRule
from actors.spec import SpecError, parse_toml
from events import AutoscaleInputs, AutoscaleSpec, ClusterCreated, ClusterScaled
from events.codec import decode_payload, encode_payload
from events.contract.messages import ClusterLoad, GatewayLoad

POLICY = AutoscaleSpec(
    min_replicas=1,
    max_replicas=5,
    target_in_flight=2.0,
    up_window_s=10.0,
    down_window_s=60.0,
)
ZERO = AutoscaleSpec(
    min_replicas=0, max_replicas=3, up_window_s=5.0, down_window_s=30.0, scale_to_zero_after_s=20.0
)


def run(
    policy: AutoscaleSpec, replicas: int, loads: list[Load], *, start: float = 0.0
) -> list[tuple[float, Decision]]:
    """One evaluation a second; each decision is applied at once, as the controller does."""
    rule = ScalingRule(since=start, last_busy=start)
    made: list[tuple[float, Decision]] = []
    for i, load in enumerate(loads):
        now = start + i + 1.0
        decision = rule.evaluate(policy, replicas, load, now)
        if decision is not None:
            assert decision.previous == replicas
            made.append((now, decision))
            replicas = decision.replicas
    return made


def busy(in_flight: int, held: int = 0) -> Load:
    return Load(gateways=1, in_flight=in_flight, held=held, requests_per_s=float(in_flight))


IDLE = Load(gateways=1)


def test_grows_only_after_the_up_window_to_what_the_whole_window_wanted() -> None:
    # 9 in flight wants 5 replicas (capped), but the first 3 s wanted only 3.
    loads = [busy(5)] * 3 + [busy(9)] * 20
    made = run(POLICY, 1, loads)
    # The streak begins at the first evaluation (1 s) and lasts the window; the next one
    # counts from the change.
    assert [(t, d.replicas) for t, d in made] == [(11.0, 3), (22.0, 5)]
    first = made[0][1]
    assert first.cause.startswith("autoscale: ")
    assert first.inputs.in_flight == 9 and first.inputs.wanted == 3 and first.inputs.window_s == 10


def test_a_dip_inside_the_window_restarts_it() -> None:
    loads = [busy(6)] * 8 + [busy(1)] + [busy(6)] * 12
    made = run(POLICY, 1, loads)
    # The dip (9 s) wants what runs; the streak begins again at 10 s.
    assert [(t, d.replicas) for t, d in made] == [(20.0, 3)]


def test_shrinks_after_the_down_window_to_the_most_it_wanted() -> None:
    loads = [busy(3)] * 30 + [busy(1)] * 40
    made = run(POLICY, 4, loads)
    # 3 in flight wants 2, then 1 wants 1: one streak from 1 s, and the most it wanted is 2.
    assert [(t, d.replicas) for t, d in made] == [(61.0, 2)]


def test_never_leaves_the_bounds_and_corrects_a_count_outside_them_at_once() -> None:
    assert [d.replicas for _, d in run(POLICY, 9, [busy(100)])] == [5]
    assert [d.replicas for _, d in run(POLICY, 0, [IDLE])] == [1]
    assert "above autoscale.max" in run(POLICY, 9, [IDLE])[0][1].cause


def test_scales_to_zero_after_idling_and_a_held_request_starts_one_at_once() -> None:
    loads = [busy(1)] * 5 + [IDLE] * 60
    made = run(ZERO, 1, loads)
    # Idle from 6 s: zero at 26 s (20 s idle; the down window, 30 s from the start, also
    # passed by then? no: 26 < 30, so at 30 s).
    assert [(t, d.replicas) for t, d in made] == [(30.0, 0)]
    assert "no request for" in made[0][1].cause
    rule = ScalingRule(since=30.0, last_busy=5.0)
    cold = rule.evaluate(ZERO, 0, Load(gateways=1, held=3, requests_per_s=3.0), 30.5)
    assert cold is not None and cold.replicas == 2 and "cold start" in cold.cause
    assert cold.inputs.held == 3


def test_no_gateway_reporting_is_not_idleness() -> None:
    made = run(ZERO, 1, [Load(gateways=0)] * 120)
    assert made == []


def test_the_board_sums_current_reports_and_drops_stale_ones() -> None:
    board = LoadBoard()
    a = GatewayLoad(gateway_id="a", clusters={"x": ClusterLoad(in_flight=2, ttft_p50_ms=30.0)})
    b = GatewayLoad(gateway_id="b", clusters={"x": ClusterLoad(in_flight=3, held=1)})
    board.offer(a, 0.0)
    board.offer(b, 2.0)
    assert board.load("x", 2.5) == Load(gateways=2, in_flight=5, held=1, ttft_p50_ms=30.0)
    assert board.load("x", REPORT_FRESH_S + 1.0) == Load(gateways=1, in_flight=3, held=1)
    assert board.load("y", 2.5) == Load(gateways=2)


def test_the_spec_section_and_its_one_line_errors() -> None:
    base = 'name = "x"\ncommand = "run"\n[autoscale]\n'
    spec = parse_toml(base + "min = 0\nmax = 3\nscale_to_zero_after_s = 60\n")
    assert spec.autoscale == AutoscaleSpec(
        min_replicas=0, max_replicas=3, scale_to_zero_after_s=60.0
    )
    for body, field in [
        ("min = 4\nmax = 3\n", "autoscale.min: must not exceed autoscale.max (4 > 3)"),
        ("max = 0\n", "autoscale.max: must be 1..1000"),
        ("target_in_flight = 0\n", "autoscale.target_in_flight: must be > 0"),
        ("down_window_s = -1\n", "autoscale.down_window_s: must be 0..86400"),
        ("cold_start_timeout_s = 0\n", "autoscale.cold_start_timeout_s: must be > 0"),
    ]:
        try:
            parse_toml(base + body)
        except SpecError as exc:
            assert str(exc).startswith(field), str(exc)
            assert "\n" not in str(exc)
        else:
            raise AssertionError(f"accepted {body!r}")


# Load in phases, each held for a while: windows and idle spells of minutes must occur, which
# a load drawn anew every second almost never makes.
one_load = st.one_of(
    st.just(Load(gateways=1)),
    st.just(Load(gateways=0)),
    st.just(Load(gateways=1, held=2)),
    st.builds(
        Load,
        gateways=st.integers(1, 3),
        in_flight=st.integers(0, 40),
        held=st.integers(0, 5),
        requests_per_s=st.floats(0, 50),
    ),
)
loads = st.lists(st.tuples(one_load, st.integers(1, 150)), max_size=10).map(
    lambda phases: [load for load, seconds in phases for _ in range(seconds)]
)
policies = st.builds(
    AutoscaleSpec,
    min_replicas=st.integers(0, 3),
    max_replicas=st.integers(3, 8),
    target_in_flight=st.floats(0.5, 8),
    up_window_s=st.floats(0, 20),
    down_window_s=st.floats(0, 120),
    scale_to_zero_after_s=st.floats(1, 100),
)


@settings(max_examples=300, deadline=None)
@given(policy=policies, start=st.sampled_from([0, 0, 1, 2, 5, 9]), loads=loads)
def test_invariants_hold_for_any_load(policy: AutoscaleSpec, start: int, loads: list[Load]) -> None:
    made = run(policy, start, loads)
    previous: tuple[float, Decision] | None = None
    for at, d in made:
        outside = not policy.min_replicas <= d.previous <= policy.max_replicas
        assert policy.min_replicas <= d.replicas <= policy.max_replicas
        assert d.replicas != d.previous
        if previous is not None and not outside:
            before_at, before = previous
            went_up = before.replicas > before.previous
            now_up = d.replicas > d.previous
            if went_up and not now_up:
                assert at - before_at >= policy.down_window_s, (before, d)
            if not went_up and now_up and d.previous > 0:
                # Only a cold start (from zero, requests held) may follow a decrease at once.
                assert at - before_at >= policy.up_window_s, (before, d)
        if d.replicas == 0:
            assert d.inputs.idle_s >= policy.scale_to_zero_after_s
        previous = (at, d)


def test_cold_start_asks_for_what_the_held_requests_need() -> None:
    rule = ScalingRule(since=0.0, last_busy=0.0)
    d = rule.evaluate(ZERO, 0, Load(gateways=1, held=100), 1.0)
    assert d is not None and d.replicas == ZERO.max_replicas
    assert d.inputs.wanted == min(ZERO.max_replicas, math.ceil(100 / ZERO.target_in_flight))


def test_logs_written_before_autoscaling_still_fold() -> None:
    created = decode_payload(
        "cluster.created.v1", b'{"type":"cluster.created.v1","spec":{"name":"x","replicas":2}}'
    )
    assert isinstance(created, ClusterCreated) and created.spec.autoscale is None
    scaled = decode_payload(
        "cluster.scaled.v1", b'{"type":"cluster.scaled.v1","name":"x","replicas":3,"previous":2}'
    )
    assert isinstance(scaled, ClusterScaled)
    assert (scaled.cause, scaled.inputs) == ("", None)
    # And what is written now reads back whole.
    now = ClusterScaled(
        name="x", replicas=0, previous=1, cause="autoscale: idle", inputs=AutoscaleInputs(idle_s=9)
    )
    assert decode_payload("cluster.scaled.v1", encode_payload(now)) == now
