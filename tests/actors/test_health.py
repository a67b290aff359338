from __future__ import annotations

import msgspec
from hypothesis import given, strategies as st

from actors.health import (
    CRITICAL_XIDS,
    HEALTHY,
    SLOWDOWNS,
    HealthPolicy,
    Verdict,
    evaluate,
    missed_heartbeats,
)
from events import GpuMetrics
from events.node import HealthState

POLICY = HealthPolicy()


def gpu(temp: float = 50.0, ecc: int = 0, xid: int = 0, index: int = 0) -> GpuMetrics:
    return GpuMetrics(index=index, temperature_c=temp, ecc_uncorrected=ecc, xid_errors=xid)


def test_cool_gpus_are_healthy() -> None:
    assert evaluate((gpu(), gpu(index=1)), "", "healthy", "registered", POLICY).state == "healthy"


def test_thermal_degrades_with_hysteresis() -> None:
    hot = evaluate((gpu(), gpu(90, index=1)), "", "healthy", "registered", POLICY)
    assert (hot.state, hot.reason) == ("degraded", "thermal")
    assert "90 C" in hot.detail
    # Between the marks: the verdict depends on where it came from.
    assert evaluate((gpu(80),), "", "degraded", "thermal", POLICY).state == "degraded"
    assert evaluate((gpu(80),), "", "healthy", "recovered", POLICY).state == "healthy"
    assert evaluate((gpu(75),), "", "degraded", "thermal", POLICY) == Verdict(
        "healthy", "recovered"
    )


def test_hardware_faults_make_a_node_unhealthy_and_outrank_heat() -> None:
    driver = evaluate((), "NVML_ERROR_GPU_IS_LOST", "healthy", "registered", POLICY)
    assert (driver.state, driver.reason) == ("unhealthy", "driver")
    ecc = evaluate((gpu(95, ecc=2),), "", "healthy", "registered", POLICY)
    assert (ecc.state, ecc.reason) == ("unhealthy", "ecc")
    xid = evaluate((gpu(xid=1, index=3),), "", "degraded", "thermal", POLICY)
    assert (xid.state, xid.reason, xid.detail) == ("unhealthy", "xid", "XID errors on GPU 3")


def test_missed_heartbeats_count_whole_intervals() -> None:
    assert missed_heartbeats(10.0, 9.5, POLICY) == 0
    assert missed_heartbeats(12.1, 10.0, POLICY) == 2
    assert missed_heartbeats(13.0, 10.0, POLICY) == 3


# XIDs, slowdowns and memory repairs (docs/gpus.md).


def test_a_critical_xid_makes_the_node_unhealthy_and_names_it() -> None:
    for xid in (48, 64, 74, 79, 92, 94, 95, 119, 120):
        reading = GpuMetrics(index=1, xid_errors=1, xids=(xid,))
        verdict = evaluate((gpu(), reading), "", "healthy", "registered", POLICY)
        assert (verdict.state, verdict.reason) == ("unhealthy", "xid"), xid
    fell = evaluate((GpuMetrics(index=0, xid_errors=3, xids=(13, 79)),), "", "healthy", "", POLICY)
    assert fell.detail == "XID 79 on GPU 0: GPU has fallen off the bus"
    both = (GpuMetrics(index=0, xids=(48,)), GpuMetrics(index=2, xids=(79,)))
    assert evaluate(both, "", "healthy", "", POLICY).detail.endswith("(+1 more)")


def test_application_xids_and_unknown_ones_leave_the_node_healthy() -> None:
    for xids in ((13,), (31,), (43,), (45,), (13, 31, 43, 45), (8,), (63,)):
        reading = GpuMetrics(index=0, xid_errors=len(xids), xids=xids)
        assert evaluate((reading,), "", "healthy", "registered", POLICY) == HEALTHY, xids


def slowed(*reasons: str, clean: int = 0, index: int = 0) -> GpuMetrics:
    return GpuMetrics(index=index, throttle_reasons=reasons, unthrottled_readings=clean)


def test_a_hardware_slowdown_degrades_at_once() -> None:
    for reason in SLOWDOWNS:
        verdict = evaluate((gpu(), slowed(reason, index=1)), "", "healthy", "", POLICY)
        assert verdict == Verdict("degraded", "throttle", f"{reason} on GPU 1")
    # A power cap, idling, application clocks: normal, not a fault.
    calm = slowed("gpu_idle", "sw_power_cap", "applications_clocks_setting", clean=40)
    assert evaluate((calm,), "", "healthy", "registered", POLICY) == HEALTHY


def test_a_slowdown_clears_after_n_clean_readings_in_a_row() -> None:
    need = POLICY.throttle_clear_after
    held = [
        evaluate((slowed(clean=n), slowed(clean=50, index=1)), "", "degraded", "throttle", POLICY)
        for n in range(1, need + 1)
    ]
    assert [v.state for v in held] == ["degraded"] * (need - 1) + ["healthy"]
    assert held[0].detail == f"clocks free for 1 of {need} readings"
    # Back in the middle: degraded again, and the count starts over at the agent.
    assert evaluate((slowed("hw_slowdown"),), "", "degraded", "throttle", POLICY).state == (
        "degraded"
    )
    # Clean readings hold only a throttle verdict: a node healthy before stays healthy.
    assert evaluate((slowed(clean=1),), "", "healthy", "recovered", POLICY) == HEALTHY
    # An agent that does not count (0): clears at the first clean reading, as before.
    assert evaluate((slowed(clean=0),), "", "degraded", "throttle", POLICY) == HEALTHY


def test_heat_outranks_a_slowdown_and_faults_outrank_both() -> None:
    hot = GpuMetrics(index=0, temperature_c=95, throttle_reasons=("hw_thermal_slowdown",))
    assert evaluate((hot,), "", "healthy", "", POLICY).reason == "thermal"
    broken = GpuMetrics(index=0, xids=(79,), throttle_reasons=("hw_slowdown",))
    assert evaluate((broken,), "", "degraded", "throttle", POLICY).state == "unhealthy"


def test_a_failed_row_remap_is_unhealthy_and_a_repair_waiting_for_a_reset_is_not() -> None:
    """NVIDIA: with a remap pending, work goes on and new work may start until the reset."""
    pages = GpuMetrics(index=0, retired_pages=3, retired_pages_pending=True)
    rows = GpuMetrics(index=1, remapped_rows=1, row_remap_pending=True, xids=(63,))
    assert evaluate((pages, rows), "", "healthy", "", POLICY) == HEALTHY
    failed = GpuMetrics(index=2, row_remap_failed=True)
    assert evaluate((pages, failed), "", "healthy", "", POLICY) == Verdict(
        "unhealthy", "ecc", "row remapping failed on GPU 2"
    )


@given(
    st.lists(
        st.builds(
            GpuMetrics,
            index=st.integers(0, 7),
            temperature_c=st.floats(0, 120),
            xids=st.lists(st.sampled_from([13, 31, 43, 45, 8, 48, 79, 94]), max_size=3).map(
                lambda xs: tuple(sorted(set(xs)))
            ),
            throttle_reasons=st.lists(
                st.sampled_from(["gpu_idle", "sw_power_cap", *sorted(SLOWDOWNS)]), max_size=2
            ).map(tuple),
            unthrottled_readings=st.integers(0, 20),
        ),
        max_size=4,
    ),
    st.sampled_from(["healthy", "degraded"]),
    st.sampled_from(["recovered", "thermal", "throttle", "ecc"]),
)
def test_critical_xids_always_win_and_application_ones_never_count(
    gpus: list[GpuMetrics], current: HealthState, reason: str
) -> None:
    verdict = evaluate(tuple(gpus), "", current, reason, POLICY)
    critical = any(x in CRITICAL_XIDS for g in gpus for x in g.xids)
    assert (verdict.state == "unhealthy") == critical
    without = tuple(msgspec.structs.replace(g, xids=()) for g in gpus)
    if not critical:
        assert evaluate(without, "", current, reason, POLICY) == verdict
