"""NvmlProbe: a clear NoGpuError without GPUs, and its readings through an NVML double."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from nodeagent.gpu import NoGpuError, NvmlProbe, ProbeError

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


class FakeNvml:
    """Just enough of pynvml's surface, with its error classes."""

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):  # pynvml's name
        pass

    def __init__(self, count: int = 2, init_error: str = "") -> None:
        self.count = count
        self.init_error = init_error
        self.unsupported: set[str] = set()
        self.broken: set[str] = set()
        self.shutdowns = 0

    def _call(self, name: str) -> None:
        if name in self.unsupported:
            raise self.NVMLError_NotSupported("Not Supported")
        if name in self.broken:
            raise self.NVMLError("GPU is lost")

    def nvmlInit(self) -> None:
        if self.init_error:
            raise self.NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetName(self, handle: int) -> str:
        return "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-{handle:08d}".encode()  # older pynvml returns bytes

    nvmlMemory_v2 = 0x02000028  # pynvml's: a struct version, passed as `version=`
    memory_v2 = True  # False: a driver before R510, which refuses the second version

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> Any:
        mib = 1024 * 1024
        if version is None:  # the first version counts the driver's reserve as used
            return SimpleNamespace(total=81559 * mib, used=(1479 + handle) * mib, free=0)
        if not self.memory_v2:
            raise self.NVMLError("Function Not Found")
        assert version == self.nvmlMemory_v2
        return SimpleNamespace(
            total=81559 * mib, used=(1000 + handle) * mib, reserved=479 * mib, free=0
        )

    def nvmlSystemGetDriverVersion(self) -> str:
        return "550.54.15"

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return 12040

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> int:
        self._call("temperature")
        return 40 + handle

    def nvmlDeviceGetUtilizationRates(self, handle: int) -> Any:
        self._call("utilization")
        return SimpleNamespace(gpu=87, memory=50)

    def nvmlDeviceGetTotalEccErrors(self, handle: int, kind: int, counter: int) -> int:
        self._call("ecc")
        assert (kind, counter) == (1, 0)  # uncorrected, volatile
        return 2

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        self._call("clocks")
        return 0x1 | 0x40

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self._call("power")
        return 312_500  # mW


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
    assert first.xid_errors == 0  # not readable by polling (see nodeagent/gpu/nvml.py)
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
    nvml.unsupported |= {"ecc", "power", "clocks", "utilization"}
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


async def test_close_shuts_nvml_down() -> None:
    nvml = FakeNvml()
    probe = await NvmlProbe.open(nvml=nvml)
    await probe.close()
    assert nvml.shutdowns == 1
