"""The real GPU probe: NVML through nvidia-ml-py (`pynvml`), every call on a worker thread.

NVML calls block, sometimes for seconds when a GPU is wedged, so they run in asyncio.to_thread
behind a lock: the loop never blocks, and a hung driver holds one thread rather than one per
heartbeat (callers bound their wait; see Agent's probe timeout).

XID errors are not readable by polling: NVML delivers them only as events. `open` makes an
event set (nvmlEventSetCreate) and registers every GPU that supports it for
nvmlEventTypeXidCriticalError (nvmlDeviceRegisterEvents; the name notwithstanding, every XID
comes through it). Each reading then drains the set on the same worker thread, under the same
lock, with nvmlEventSetWait_v2 and a timeout of `xid_wait_ms` (0: never wait), until NVML
answers NVMLError_Timeout (no event left). A GPU's XIDs are kept from then on, as the driver
keeps its volatile ECC counts: `xid_errors` counts them, `xids` names their codes, and
actors/health.py decides which make the node unhealthy (docs/gpus.md). A GPU that cannot
register (NVMLError_NotSupported: some vGPU and WSL setups) is read without XIDs, and
`xid_watch` says so.

Retired pages (nvmlDeviceGetRetiredPages, nvmlDeviceGetRetiredPagesPendingStatus: cards
before the A100) and remapped rows (nvmlDeviceGetRemappedRows: the A100 and later) are read
where the card has them; NVMLError_NotSupported, the usual answer on consumer cards, reads as
none, and the call is not made again for that GPU.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterable
from typing import Any

import structlog

from events.node import GpuInfo, GpuMetrics

from .probe import CleanReadings, Inventory, NoGpuError, ProbeError

_log = structlog.get_logger("gpumesh.nodeagent.nvml")

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
_NVML_EVENT_TYPE_XID = 0x8  # nvmlEventTypeXidCriticalError
_NVML_ERROR_TIMEOUT = 10
_NVML_PAGE_RETIREMENT_CAUSES = (0, 1)  # multiple single-bit ECC errors, a double-bit one
# Events taken from the set in one reading at most: an XID storm must not hold the heartbeat.
_MAX_EVENTS_PER_READING = 256


def _hint(reason: str) -> str:
    return (
        f"no NVIDIA GPU found (NVML: {reason}); "
        "declare fake GPUs with --fake-gpus MODEL:VRAM:COUNT for testing"
    )


def throttle_names(mask: int) -> tuple[str, ...]:
    return tuple(name for bit, name in _THROTTLE_REASONS if mask & bit)


def throttle_mask(names: Iterable[str]) -> int:
    """NVML's bit mask for clock event reasons by name; ValueError naming an unknown one."""
    bits = {name: bit for bit, name in _THROTTLE_REASONS}
    mask = 0
    for name in names:
        if name not in bits:
            raise ValueError(f"unknown throttle reason {name!r} (known: {', '.join(bits)})")
        mask |= bits[name]
    return mask


class NvmlProbe:
    """Implements GpuProbe with NVML. Build it with `await NvmlProbe.open()`."""

    def __init__(
        self,
        nvml: Any,
        handles: tuple[Any, ...],
        *,
        event_set: Any = None,
        xid_gpus: tuple[int, ...] = (),
        xid_wait_ms: int = 0,
    ) -> None:
        self._nvml = nvml
        self._handles = handles
        self._lock = asyncio.Lock()
        # Older GPUs and drivers lack some readings; those read as zero, not as a failure.
        self._unsupported: tuple[type[BaseException], ...] = tuple(
            getattr(nvml, name)
            for name in ("NVMLError_NotSupported", "NVMLError_FunctionNotFound")
            if hasattr(nvml, name)
        )
        self._event_set = event_set
        self._xid_gpus = xid_gpus
        self._xid_wait_ms = xid_wait_ms
        self._xids = [Counter[int]() for _ in handles]
        self._clean = CleanReadings()
        self._lacks: set[tuple[str, int]] = set()  # (call, GPU) answered NotSupported once

    @property
    def xid_watch(self) -> str:
        """Which GPUs XIDs are read from, in a line (for the agent's log)."""
        if self._event_set is None:
            return "XID events unsupported here: XIDs are not read"
        missing = sorted(set(range(len(self._handles))) - set(self._xid_gpus))
        if missing:
            gpus = ",".join(map(str, missing))
            return f"XID events read from every GPU but {gpus} (unsupported there)"
        return "XID events read from every GPU"

    @classmethod
    async def open(cls, *, nvml: Any = None, xid_wait_ms: int = 0) -> NvmlProbe:
        """Initialise NVML and register for XID events; NoGpuError (one clear line) when NVML
        cannot start, or sees no GPU.

        `nvml` replaces the pynvml module (tests pass a double). `xid_wait_ms`: how long each
        reading waits for an XID event when none is queued (0: not at all).
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
        event_set, xid_gpus = await asyncio.to_thread(_watch_xids, nvml, handles)
        probe = cls(nvml, handles, event_set=event_set, xid_gpus=xid_gpus, xid_wait_ms=xid_wait_ms)
        _log.info("nvml_xid_watch", watch=probe.xid_watch)
        return probe

    async def close(self) -> None:
        async with self._lock:
            await asyncio.to_thread(self._close)

    def _close(self) -> None:
        if self._event_set is not None:
            try:
                self._nvml.nvmlEventSetFree(self._event_set)
            except self._nvml.NVMLError:
                pass  # the driver went away: nothing left to free
            self._event_set = None
        _shutdown(self._nvml)

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
        self._drain_xids()
        return tuple(self._read_one(index, handle) for index, handle in enumerate(self._handles))

    def _drain_xids(self) -> None:
        """Take every XID event queued since the last reading (never more than
        _MAX_EVENTS_PER_READING), waiting `xid_wait_ms` at most for one."""
        nv = self._nvml
        if self._event_set is None:
            return
        wait = getattr(nv, "nvmlEventSetWait_v2", None) or nv.nvmlEventSetWait
        for _ in range(_MAX_EVENTS_PER_READING):
            try:
                event = wait(self._event_set, self._xid_wait_ms)
            except nv.NVMLError as exc:
                if not _is_timeout(nv, exc):
                    # The set itself fails (the driver is going): the readings say the rest.
                    _log.warning("nvml_xid_wait_failed", error=str(exc))
                return
            if not int(event.eventType) & _NVML_EVENT_TYPE_XID:
                continue
            index = self._index_of(event.device)
            if index is not None:
                self._xids[index][int(event.eventData)] += 1

    def _index_of(self, device: Any) -> int | None:
        nv = self._nvml
        try:
            index = int(nv.nvmlDeviceGetIndex(device))
        except nv.NVMLError:
            index = -1
        if 0 <= index < len(self._handles):
            return index
        for i, handle in enumerate(self._handles):
            if handle == device:
                return i
        return None

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
            pages, pages_pending = self._retired_pages(index, handle)
            rows = self._once(index, "nvmlDeviceGetRemappedRows", handle, default=(0, 0, 0, 0))
        except nv.NVMLError as exc:
            raise ProbeError(f"GPU {index}: NVML: {exc}", gpu_index=index) from exc
        throttle = throttle_names(int(reasons))
        xids = self._xids[index]
        corrected_rows, uncorrected_rows, rows_pending, rows_failed = rows
        return GpuMetrics(
            index=index,
            temperature_c=float(temperature),
            utilization_pct=float(utilization.gpu) if utilization is not None else 0.0,
            memory_used_mib=int(memory.used) // _MIB,
            memory_total_mib=int(memory.total) // _MIB,
            ecc_uncorrected=int(ecc),
            xid_errors=xids.total(),
            throttle_reasons=throttle,
            power_w=float(power_mw) / 1000.0,
            xids=tuple(sorted(xids)),
            unthrottled_readings=self._clean.count(index, throttle),
            retired_pages=pages,
            retired_pages_pending=pages_pending,
            remapped_rows=int(corrected_rows) + int(uncorrected_rows),
            row_remap_pending=bool(rows_pending),
            row_remap_failed=bool(rows_failed),
        )

    def _retired_pages(self, index: int, handle: Any) -> tuple[int, bool]:
        """Pages retired for either cause, and whether one waits for a reset to be."""
        pages = sum(
            len(self._once(index, "nvmlDeviceGetRetiredPages", handle, cause, default=()))
            for cause in _NVML_PAGE_RETIREMENT_CAUSES
        )
        pending = self._once(index, "nvmlDeviceGetRetiredPagesPendingStatus", handle, default=0)
        return pages, bool(pending)

    def _once(self, index: int, call: str, *args: Any, default: Any) -> Any:
        """`call` on GPU `index`, `default` for good once it answers NotSupported (or the
        binding lacks it): a consumer card never has retired pages, no need to ask again."""
        fn = getattr(self._nvml, call, None)
        if fn is None or (call, index) in self._lacks:
            return default
        try:
            return fn(*args)
        except self._unsupported:
            self._lacks.add((call, index))
            return default

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


def _watch_xids(nvml: Any, handles: tuple[Any, ...]) -> tuple[Any, tuple[int, ...]]:
    """An event set with every GPU that can report XIDs registered for them, and those GPUs;
    (None, ()) when none can."""
    try:
        event_set = nvml.nvmlEventSetCreate()
    except nvml.NVMLError:
        return None, ()
    registered = []
    for index, handle in enumerate(handles):
        try:
            supported = nvml.nvmlDeviceGetSupportedEventTypes(handle)
            if int(supported) & _NVML_EVENT_TYPE_XID:
                nvml.nvmlDeviceRegisterEvents(handle, _NVML_EVENT_TYPE_XID, event_set)
                registered.append(index)
        except nvml.NVMLError:
            continue  # NotSupported (vGPU, WSL), or this GPU is lost: its readings will say
    if not registered:
        try:
            nvml.nvmlEventSetFree(event_set)
        except nvml.NVMLError:
            pass
        return None, ()
    return event_set, tuple(registered)


def _is_timeout(nvml: Any, exc: BaseException) -> bool:
    timeout = getattr(nvml, "NVMLError_Timeout", None)
    if timeout is not None and isinstance(exc, timeout):
        return True
    return getattr(exc, "value", None) == _NVML_ERROR_TIMEOUT


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
