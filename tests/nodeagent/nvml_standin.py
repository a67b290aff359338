"""A stand-in for pynvml (nvidia-ml-py): the calls NvmlProbe makes, with pynvml's signatures
and its error classes, so the probe is tested here without a GPU.

Faithful where it matters to the probe (tests/nodeagent/test_nvml.py checks the names and
signatures against the installed pynvml):
- errors are NVMLError subclasses named as pynvml names them (NVMLError_NotSupported,
  NVMLError_Timeout, NVMLError_GpuIsLost), each with pynvml's `value` (the NVML_ERROR_* code);
- nvmlEventSetWait_v2 returns an event with pynvml's c_nvmlEventData_t fields (device,
  eventType, eventData: the XID, gpuInstanceId, computeInstanceId), or raises
  NVMLError_Timeout when no event is queued; it never blocks (the timeout is recorded);
- nvmlDeviceRegisterEvents raises NVMLError_NotSupported for a GPU that cannot report events,
  and only registered GPUs' events reach a set;
- clock event reasons are a bit mask (pynvml's nvmlClocksEventReason* values);
- retired pages and remapped rows raise NVMLError_NotSupported on a card without them (a
  consumer card has neither; an A100 or later remaps rows and does not retire pages).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

MIB = 1024 * 1024


class NVMLError(Exception):
    value = 999  # NVML_ERROR_UNKNOWN


class NVMLError_NotSupported(NVMLError):  # pynvml's names
    value = 3


class NVMLError_Timeout(NVMLError):
    value = 10


class NVMLError_GpuIsLost(NVMLError):
    value = 15


@dataclass
class EventSet:
    """What nvmlEventSetCreate returns: the events queued for the GPUs registered to it."""

    registered: dict[int, int] = field(default_factory=dict)  # handle -> event type mask
    queue: deque[SimpleNamespace] = field(default_factory=deque)
    freed: bool = False


@dataclass
class Card:
    """One GPU as the stand-in reports it."""

    name: str = "NVIDIA H100 80GB HBM3"
    clocks: int = 0x1 | 0x40  # gpu_idle, hw_thermal_slowdown
    events: bool = True  # can report XID events (nvmlDeviceGetSupportedEventTypes)
    # None: NotSupported. An H100 remaps rows and retires no pages; an RTX 4090 does neither.
    retired_pages: dict[int, list[int]] | None = None  # cause -> page addresses
    pages_pending: bool = False
    remapped_rows: tuple[int, int, int, int] | None = (0, 0, 0, 0)  # corr, unc, pending, failed


class FakeNvml:
    """Just enough of pynvml's surface, with its error classes."""

    NVMLError = NVMLError
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_Timeout = NVMLError_Timeout
    NVMLError_GpuIsLost = NVMLError_GpuIsLost

    nvmlEventTypeXidCriticalError = 0x0000000000000008  # pynvml's values
    nvmlEventTypeSingleBitEccError = 0x0000000000000001
    nvmlEventTypeDoubleBitEccError = 0x0000000000000002
    nvmlEventTypePState = 0x0000000000000004

    def __init__(self, count: int = 2, init_error: str = "") -> None:
        self.count = count
        self.init_error = init_error
        self.cards = [Card() for _ in range(count)]
        self.unsupported: set[str] = set()
        self.broken: set[str] = set()
        self.shutdowns = 0
        self.no_event_api = False  # a driver or binding without event sets
        self.sets: list[EventSet] = []
        self.waits: list[int] = []  # every nvmlEventSetWait_v2 timeout asked for, ms
        self.calls: list[str] = []

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.unsupported:
            raise NVMLError_NotSupported("Not Supported")
        if name in self.broken:
            raise NVMLError_GpuIsLost("GPU is lost")

    # What the test does to the cards.

    def xid(self, handle: int, code: int) -> None:
        """The driver reports XID `code` on GPU `handle`: queued in every set it is
        registered to for XID events, as NVML does."""
        for event_set in self.sets:
            if event_set.registered.get(handle, 0) & self.nvmlEventTypeXidCriticalError:
                event_set.queue.append(
                    SimpleNamespace(
                        device=handle,
                        eventType=self.nvmlEventTypeXidCriticalError,
                        eventData=code,
                        gpuInstanceId=0xFFFFFFFF,  # not a MIG instance
                        computeInstanceId=0xFFFFFFFF,
                    )
                )

    def pstate_change(self, handle: int) -> None:
        """An event of another type (the probe registers XIDs only; a set shared with another
        reader could carry more)."""
        for event_set in self.sets:
            event_set.queue.append(
                SimpleNamespace(device=handle, eventType=self.nvmlEventTypePState, eventData=0)
            )

    # pynvml's calls.

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.shutdowns += 1

    def nvmlDeviceGetCount(self) -> int:
        return self.count

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetName(self, handle: int) -> str:
        return self.cards[handle].name

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-{handle:08d}".encode()  # older pynvml returns bytes

    nvmlMemory_v2 = 0x02000028  # pynvml's: a struct version, passed as `version=`
    memory_v2 = True  # False: a driver before R510, which refuses the second version

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> Any:
        if version is None:  # the first version counts the driver's reserve as used
            return SimpleNamespace(total=81559 * MIB, used=(1479 + handle) * MIB, free=0)
        if not self.memory_v2:
            raise NVMLError("Function Not Found")
        assert version == self.nvmlMemory_v2
        return SimpleNamespace(
            total=81559 * MIB, used=(1000 + handle) * MIB, reserved=479 * MIB, free=0
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

    def nvmlDeviceGetTotalEccErrors(self, handle: int, errorType: int, counterType: int) -> int:
        self._call("ecc")
        assert (errorType, counterType) == (1, 0)  # uncorrected, volatile
        return 2

    def nvmlDeviceGetCurrentClocksEventReasons(self, handle: int) -> int:
        self._call("clocks")
        return self.cards[handle].clocks

    def nvmlDeviceGetPowerUsage(self, handle: int) -> int:
        self._call("power")
        return 312_500  # mW

    # Events.

    def nvmlEventSetCreate(self) -> EventSet:
        self._call("event_set")
        if self.no_event_api:
            raise NVMLError_NotSupported("Not Supported")
        event_set = EventSet()
        self.sets.append(event_set)
        return event_set

    def nvmlDeviceGetSupportedEventTypes(self, handle: int) -> int:
        self._call("event_types")
        if not self.cards[handle].events:
            return self.nvmlEventTypePState  # no XIDs from this one
        return (
            self.nvmlEventTypeSingleBitEccError
            | self.nvmlEventTypeDoubleBitEccError
            | self.nvmlEventTypePState
            | self.nvmlEventTypeXidCriticalError
        )

    def nvmlDeviceRegisterEvents(self, handle: int, eventTypes: int, eventSet: EventSet) -> None:
        self._call("register")
        if not self.cards[handle].events:
            raise NVMLError_NotSupported("Not Supported")
        eventSet.registered[handle] = eventSet.registered.get(handle, 0) | eventTypes

    def nvmlEventSetWait_v2(self, eventSet: EventSet, timeoutms: int) -> SimpleNamespace:
        self._call("wait")
        assert not eventSet.freed
        self.waits.append(timeoutms)
        if not eventSet.queue:
            raise NVMLError_Timeout("Timeout")
        return eventSet.queue.popleft()

    def nvmlEventSetFree(self, eventSet: EventSet) -> None:
        eventSet.freed = True

    # Retired pages, remapped rows.

    def nvmlDeviceGetRetiredPages(self, device: int, sourceFilter: int) -> list[int]:
        self._call("retired_pages")
        pages = self.cards[device].retired_pages
        if pages is None:
            raise NVMLError_NotSupported("Not Supported")
        return list(pages.get(sourceFilter, []))

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: int) -> int:
        self._call("pages_pending")
        if self.cards[device].retired_pages is None:
            raise NVMLError_NotSupported("Not Supported")
        return int(self.cards[device].pages_pending)

    def nvmlDeviceGetRemappedRows(self, device: int) -> tuple[int, int, int, int]:
        self._call("remapped_rows")
        rows = self.cards[device].remapped_rows
        if rows is None:
            raise NVMLError_NotSupported("Not Supported")
        return rows
