"""The real GPU probe: NVML through nvidia-ml-py (`pynvml`), every call on a worker thread.

NVML calls block, sometimes for seconds when a GPU is wedged, so they run in asyncio.to_thread
behind a lock: the loop never blocks, and a hung driver holds one thread rather than one per
heartbeat (callers bound their wait; see Agent's probe timeout).

XID errors are not readable by polling: NVML delivers them only as events (nvmlEventSetCreate,
nvmlDeviceRegisterEvents with nvmlEventTypeXidCriticalError, then a blocking
nvmlEventSetWait_v2). This probe does not run that event-set thread yet, so it reports
xid_errors=0; uncorrected ECC counts, throttle reasons and the probe failing altogether are
the health signals it does give.
"""

from __future__ import annotations

import asyncio
from typing import Any

from events.node import GpuInfo, GpuMetrics

from .probe import Inventory, NoGpuError, ProbeError

_MIB = 1024 * 1024

# NVML's clock event (formerly "throttle") reason bits; stable across driver versions.
_THROTTLE_REASONS = (
    (0x1, "gpu_idle"),
    (0x2, "applications_clocks_setting"),
    (0x4, "sw_power_cap"),
    (0x8, "hw_slowdown"),
    (0x10, "sync_boost"),
    (0x20, "sw_thermal_slowdown"),
    (0x40, "hw_thermal_slowdown"),
    (0x80, "hw_power_brake_slowdown"),
    (0x100, "display_clock_setting"),
)

# NVML enum values, fixed by the C API (nvml.h), used so a test double needs no constants.
_NVML_TEMPERATURE_GPU = 0
_NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
_NVML_VOLATILE_ECC = 0


def _hint(reason: str) -> str:
    return (
        f"no NVIDIA GPU found (NVML: {reason}); "
        "declare fake GPUs with --fake-gpus MODEL:VRAM:COUNT for testing"
    )


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in _THROTTLE_REASONS if mask & bit)


class NvmlProbe:
    """Implements GpuProbe with NVML. Build it with `await NvmlProbe.open()`."""

    def __init__(self, nvml: Any, handles: tuple[Any, ...]) -> None:
        self._nvml = nvml
        self._handles = handles
        self._lock = asyncio.Lock()
        # Older GPUs and drivers lack some readings; those read as zero, not as a failure.
        self._unsupported: tuple[type[BaseException], ...] = tuple(
            getattr(nvml, name)
            for name in ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
            if hasattr(nvml, name)
        )

    @classmethod
    async def open(cls, *, nvml: Any = None) -> NvmlProbe:
        """Initialise NVML; NoGpuError (one clear line) when it cannot, or sees no GPU.

        `nvml` replaces the pynvml module (tests pass a double).
        """
        if nvml is None:
            try:
                import pynvml

                nvml = pynvml
            except ImportError as exc:
                raise NoGpuError(_hint(f"nvidia-ml-py is not installed: {exc}")) from None
        try:
            handles = await asyncio.to_thread(_open_handles, nvml)
        except nvml.NVMLError as exc:
            raise NoGpuError(_hint(str(exc) or type(exc).__name__)) from None
        if not handles:
            await asyncio.to_thread(_shutdown, nvml)
            raise NoGpuError(_hint("the driver reports 0 devices"))
        return cls(nvml, handles)

    async def close(self) -> None:
        async with self._lock:
            await asyncio.to_thread(_shutdown, self._nvml)

    async def inventory(self) -> Inventory:
        async with self._lock:
            return await asyncio.to_thread(self._read_inventory)

    async def sample(self) -> tuple[GpuMetrics, ...]:
        async with self._lock:
            return await asyncio.to_thread(self._read_metrics)

    def _read_inventory(self) -> Inventory:
        nv = self._nvml
        try:
            gpus = tuple(
                GpuInfo(
                    index=index,
                    uuid=_text(nv.nvmlDeviceGetUUID(handle)),
                    model=_text(nv.nvmlDeviceGetName(handle)),
                    vram_mib=int(nv.nvmlDeviceGetMemoryInfo(handle).total) // _MIB,
                )
                for index, handle in enumerate(self._handles)
            )
            driver = _text(nv.nvmlSystemGetDriverVersion())
        except nv.NVMLError as exc:
            raise ProbeError(f"NVML: {exc}") from exc
        cuda = self._optional(nv.nvmlSystemGetCudaDriverVersion, default=0)
        return Inventory(
            gpus=gpus,
            driver_version=driver,
            cuda_version=f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "",
        )

    def _read_metrics(self) -> tuple[GpuMetrics, ...]:
        return tuple(self._read_one(index, handle) for index, handle in enumerate(self._handles))

    def _read_one(self, index: int, handle: Any) -> GpuMetrics:
        nv = self._nvml
        clock_reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        try:
            temperature = nv.nvmlDeviceGetTemperature(handle, _NVML_TEMPERATURE_GPU)
            memory = self._memory(handle)
            utilization = self._optional(nv.nvmlDeviceGetUtilizationRates, handle, default=None)
            ecc = self._optional(
                nv.nvmlDeviceGetTotalEccErrors,
                handle,
                _NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                _NVML_VOLATILE_ECC,
                default=0,
            )
            reasons = self._optional(clock_reasons, handle, default=0) if clock_reasons else 0
            power_mw = self._optional(nv.nvmlDeviceGetPowerUsage, handle, default=0)
        except nv.NVMLError as exc:
            raise ProbeError(f"GPU {index}: NVML: {exc}", gpu_index=index) from exc
        return GpuMetrics(
            index=index,
            temperature_c=float(temperature),
            utilization_pct=float(utilization.gpu) if utilization is not None else 0.0,
            memory_used_mib=int(memory.used) // _MIB,
            memory_total_mib=int(memory.total) // _MIB,
            ecc_uncorrected=int(ecc),
            xid_errors=0,  # see the module docstring
            throttle_reasons=throttle_names(int(reasons)),
            power_w=float(power_mw) / 1000.0,
        )

    def _memory(self, handle: Any) -> Any:
        """Memory in use as nvidia-smi shows it. The first version of the call counts the
        memory the driver reserves as used too: on an H100 with driver 580 it read 1,454 MiB
        where nvidia-smi said 975 with nothing running (the device machine, 2026-11-26).
        The second excludes it; drivers before R510, or a binding without it, get the first."""
        nv = self._nvml
        v2 = getattr(nv, "nvmlMemory_v2", None)
        if v2 is not None:
            try:
                return nv.nvmlDeviceGetMemoryInfo(handle, version=v2)
            except (nv.NVMLError, TypeError):
                pass
        return nv.nvmlDeviceGetMemoryInfo(handle)

    def _optional(self, fn: Any, *args: Any, default: Any) -> Any:
        try:
            return fn(*args)
        except self._unsupported:
            return default


def _open_handles(nvml: Any) -> tuple[Any, ...]:
    nvml.nvmlInit()
    try:
        count = nvml.nvmlDeviceGetCount()
        return tuple(nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count))
    except BaseException:
        _shutdown(nvml)
        raise


def _shutdown(nvml: Any) -> None:
    try:
        nvml.nvmlShutdown()
    except nvml.NVMLError:
        pass  # already shut down, or the driver went away: nothing left to release


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value
