"""NvmlProbe: a clear NoGpuError without GPUs, and its readings through an NVML double."""

from __future__ import annotations

import asyncio
import inspect
import threading
from dataclasses import dataclass

import pytest

from nodeagent.gpu import NoGpuError, NvmlProbe, ProbeError

from .nvml_standin import Card, FakeNvml

HINT = "declare fake GPUs with --fake-gpus MODEL:VRAM:COUNT for testing"


def _machine_has_a_gpu() -> bool:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception:
        return False
    pynvml.nvmlShutdown()
    return True


@pytest.mark.skipif(_machine_has_a_gpu(), reason="this machine has an NVIDIA GPU")
async def test_open_without_a_gpu_raises_no_gpu_error_with_one_clear_line() -> None:
    with pytest.raises(NoGpuError) as caught:
        await NvmlProbe.open()
    message = str(caught.value)
    assert message.startswith("no NVIDIA GPU found (NVML: ")
    assert message.endswith(HINT)
    assert "\n" not in message


async def test_inventory_reads_models_uuids_vram_and_versions() -> None:
    probe = await NvmlProbe.open(nvml=FakeNvml())
    inventory = await probe.inventory()
    assert [(g.index, g.uuid, g.model, g.vram_mib) for g in inventory.gpus] == [
        (0, "GPU-00000000", "NVIDIA H100 80GB HBM3", 81559),
        (1, "GPU-00000001", "NVIDIA H100 80GB HBM3", 81559),
    ]
    assert (inventory.driver_version, inventory.cuda_version) == ("550.54.15", "12.4")


async def test_sample_reads_every_metric() -> None:
    probe = await NvmlProbe.open(nvml=FakeNvml())
    first, second = await probe.sample()
    assert first.index == 0 and second.index == 1
    assert (first.temperature_c, second.temperature_c) == (40.0, 41.0)
    assert first.utilization_pct == 87.0
    assert (first.memory_used_mib, first.memory_total_mib) == (1000, 81559)
    assert first.ecc_uncorrected == 2
    assert (first.xid_errors, first.xids) == (0, ())  # no XID event queued
    assert first.throttle_reasons == ("gpu_idle", "hw_thermal_slowdown")
    assert first.power_w == pytest.approx(312.5)


async def test_memory_in_use_is_read_as_nvidia_smi_shows_it() -> None:
    """The second version of the memory call leaves out what the driver reserves (seen on
    an H100: 1,454 MiB by the first where nvidia-smi said 975); an old driver gets the
    first."""
    probe = await NvmlProbe.open(nvml=FakeNvml(count=1))
    (reading,) = await probe.sample()
    assert reading.memory_used_mib == 1000
    old = FakeNvml(count=1)
    old.memory_v2 = False
    (reading,) = await (await NvmlProbe.open(nvml=old)).sample()
    assert reading.memory_used_mib == 1479


async def test_readings_a_gpu_does_not_support_read_as_zero() -> None:
    nvml = FakeNvml(count=1)
    nvml.unsupported |= {"ecc", "power", "clocks", "utilization", "remapped_rows"}
    (metrics,) = await (await NvmlProbe.open(nvml=nvml)).sample()
    assert (metrics.ecc_uncorrected, metrics.power_w, metrics.throttle_reasons) == (0, 0.0, ())
    assert metrics.utilization_pct == 0.0
    assert metrics.temperature_c == 40.0


async def test_a_failing_gpu_raises_probe_error_naming_it() -> None:
    nvml = FakeNvml(count=1)
    probe = await NvmlProbe.open(nvml=nvml)
    nvml.broken.add("temperature")
    with pytest.raises(ProbeError, match="GPU 0: NVML: GPU is lost"):
        await probe.sample()


@dataclass
class Case:
    nvml: FakeNvml
    reason: str


@pytest.mark.parametrize(
    "case",
    [
        Case(FakeNvml(init_error="Driver Not Loaded"), "(NVML: Driver Not Loaded)"),
        Case(FakeNvml(count=0), "(NVML: the driver reports 0 devices)"),
    ],
)
async def test_open_fails_clearly_when_nvml_cannot_start_or_sees_no_gpu(case: Case) -> None:
    with pytest.raises(NoGpuError) as caught:
        await NvmlProbe.open(nvml=case.nvml)
    assert str(caught.value) == f"no NVIDIA GPU found {case.reason}; {HINT}"


async def test_close_frees_the_event_set_then_shuts_nvml_down() -> None:
    nvml = FakeNvml()
    probe = await NvmlProbe.open(nvml=nvml)
    await probe.close()
    assert nvml.shutdowns == 1
    assert [s.freed for s in nvml.sets] == [True]


# XIDs, through NVML's event API.


async def test_xids_are_read_from_the_event_set_and_kept() -> None:
    nvml = FakeNvml(count=2)
    probe = await NvmlProbe.open(nvml=nvml)
    (event_set,) = nvml.sets
    assert event_set.registered == {0: 0x8, 1: 0x8}  # nvmlEventTypeXidCriticalError only
    assert probe.xid_watch == "XID events read from every GPU"
    nvml.xid(1, 79)
    nvml.xid(1, 13)
    nvml.xid(1, 79)
    first, second = await probe.sample()
    assert (first.xid_errors, first.xids) == (0, ())
    assert (second.xid_errors, second.xids) == (3, (13, 79))
    # Kept from then on, as the driver keeps its volatile ECC counts: the next reading, with
    # no new event, still says so.
    _, again = await probe.sample()
    assert (again.xid_errors, again.xids) == (3, (13, 79))
    nvml.xid(0, 48)
    first, _ = await probe.sample()
    assert first.xids == (48,)


async def test_the_probe_never_waits_for_an_event_and_stops_at_nvmls_timeout() -> None:
    """Each reading drains the set with a timeout of 0 ms: NVMLError_Timeout means no event
    is left, and the reading goes on at once."""
    nvml = FakeNvml(count=1)
    probe = await NvmlProbe.open(nvml=nvml)
    await probe.sample()
    assert nvml.waits == [0]  # one wait, answered NVMLError_Timeout
    nvml.xid(0, 94)
    nvml.pstate_change(0)  # not an XID: skipped
    (reading,) = await probe.sample()
    assert nvml.waits == [0, 0, 0, 0]
    assert reading.xids == (94,)


async def test_nvml_calls_run_off_the_event_loop_thread() -> None:
    nvml = FakeNvml(count=1)
    seen: list[int] = []
    wait = nvml.nvmlEventSetWait_v2

    def recording_wait(event_set: object, timeout_ms: int) -> object:
        seen.append(threading.get_ident())
        return wait(event_set, timeout_ms)  # type: ignore[arg-type]

    nvml.nvmlEventSetWait_v2 = recording_wait  # type: ignore[method-assign]
    probe = await NvmlProbe.open(nvml=nvml)
    await asyncio.gather(probe.sample(), probe.sample())
    assert seen and threading.get_ident() not in seen


async def test_an_xid_storm_is_taken_over_several_readings() -> None:
    nvml = FakeNvml(count=1)
    probe = await NvmlProbe.open(nvml=nvml)
    for _ in range(300):
        nvml.xid(0, 43)
    (first,) = await probe.sample()
    (second,) = await probe.sample()
    assert (first.xid_errors, second.xid_errors) == (256, 300)


async def test_a_gpu_that_cannot_report_events_is_read_without_xids() -> None:
    nvml = FakeNvml(count=3)
    nvml.cards[1].events = False  # nvmlDeviceRegisterEvents: NVMLError_NotSupported
    probe = await NvmlProbe.open(nvml=nvml)
    assert probe.xid_watch == "XID events read from every GPU but 1 (unsupported there)"
    nvml.xid(1, 79)  # never reaches the set
    nvml.xid(2, 79)
    assert [r.xids for r in await probe.sample()] == [(), (), (79,)]


async def test_without_the_event_api_the_probe_reads_everything_else() -> None:
    nvml = FakeNvml(count=1)
    nvml.no_event_api = True  # nvmlEventSetCreate: NVMLError_NotSupported
    probe = await NvmlProbe.open(nvml=nvml)
    assert probe.xid_watch == "XID events unsupported here: XIDs are not read"
    (reading,) = await probe.sample()
    assert (reading.temperature_c, reading.xids, nvml.waits) == (40.0, (), [])
    await probe.close()
    assert nvml.shutdowns == 1


async def test_a_failing_event_wait_leaves_the_readings_alone() -> None:
    nvml = FakeNvml(count=1)
    probe = await NvmlProbe.open(nvml=nvml)
    nvml.broken.add("wait")  # NVMLError_GpuIsLost from nvmlEventSetWait_v2
    (reading,) = await probe.sample()
    assert reading.temperature_c == 40.0


# Clock event reasons, retired pages and remapped rows.


async def test_clean_readings_are_counted_and_a_slowdown_starts_the_count_over() -> None:
    nvml = FakeNvml(count=1)
    nvml.cards[0].clocks = 0x1 | 0x4  # gpu_idle, sw_power_cap: no slowdown
    probe = await NvmlProbe.open(nvml=nvml)
    counts = [(await probe.sample())[0].unthrottled_readings for _ in range(3)]
    assert counts == [1, 2, 3]
    nvml.cards[0].clocks = 0x8 | 0x80  # hw_slowdown, hw_power_brake_slowdown
    (slowed,) = await probe.sample()
    assert slowed.throttle_reasons == ("hw_slowdown", "hw_power_brake_slowdown")
    assert slowed.unthrottled_readings == 0
    nvml.cards[0].clocks = 0
    assert (await probe.sample())[0].unthrottled_readings == 1


async def test_retired_pages_and_remapped_rows_where_the_card_has_them() -> None:
    nvml = FakeNvml(count=3)
    # A V100 retires pages, and has no row remapper.
    nvml.cards[0] = Card(
        name="Tesla V100-SXM2-16GB",
        retired_pages={0: [0x1000, 0x2000], 1: [0x3000]},
        pages_pending=True,
        remapped_rows=None,
    )
    # An H100 remaps rows (corrected, uncorrected, pending, failed) and retires no pages.
    nvml.cards[1] = Card(remapped_rows=(2, 1, 1, 0))
    # An RTX 4090 does neither.
    nvml.cards[2] = Card(name="NVIDIA GeForce RTX 4090", retired_pages=None, remapped_rows=None)
    probe = await NvmlProbe.open(nvml=nvml)
    v100, h100, rtx = await probe.sample()
    assert (v100.retired_pages, v100.retired_pages_pending, v100.remapped_rows) == (3, True, 0)
    assert (h100.retired_pages, h100.remapped_rows, h100.row_remap_pending) == (0, 3, True)
    assert not h100.row_remap_failed
    assert (rtx.retired_pages, rtx.retired_pages_pending, rtx.remapped_rows) == (0, False, 0)
    # NotSupported once is NotSupported for good: not asked again on the next reading.
    asked = nvml.calls.count("retired_pages") + nvml.calls.count("remapped_rows")
    await probe.sample()
    again = nvml.calls.count("retired_pages") + nvml.calls.count("remapped_rows")
    assert again - asked == 2 + 1  # the V100's two causes, the H100's rows
    nvml.cards[1].remapped_rows = (2, 1, 0, 1)
    assert (await probe.sample())[1].row_remap_failed


# The stand-in against pynvml itself.


def test_the_stand_in_has_pynvmls_calls_errors_and_constants() -> None:
    pynvml = pytest.importorskip("pynvml")
    standin = FakeNvml()
    calls = [n for n in dir(standin) if n.startswith("nvml") and callable(getattr(standin, n))]
    assert "nvmlEventSetWait_v2" in calls and "nvmlDeviceRegisterEvents" in calls
    for name in calls:
        ours = list(inspect.signature(getattr(standin, name)).parameters)
        theirs = list(inspect.signature(getattr(pynvml, name)).parameters)
        assert ours == theirs, name
    for name in ("NVMLError_NotSupported", "NVMLError_Timeout", "NVMLError_GpuIsLost"):
        assert issubclass(getattr(pynvml, name), pynvml.NVMLError)
        assert getattr(standin, name).value == getattr(pynvml, name)(0).value, name
    for name in ("nvmlEventTypeXidCriticalError", "nvmlEventTypePState"):
        assert getattr(standin, name) == getattr(pynvml, name)
    fields = [f for f, _ in pynvml.c_nvmlEventData_t._fields_]
    assert fields == ["device", "eventType", "eventData", "gpuInstanceId", "computeInstanceId"]
    assert pynvml.nvmlClocksEventReasonHwSlowdown == 0x8
    assert pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown == 0x80
