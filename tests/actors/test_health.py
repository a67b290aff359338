from __future__ import annotations

from actors.health import HealthPolicy, Verdict, evaluate, missed_heartbeats
from events import GpuMetrics

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
