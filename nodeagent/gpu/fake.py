"""Fake GPUs declared on the command line (`--fake-gpus RTX4090:24GiB:2`), with fault switches.

They let a laptop join a fleet and let chaos tests make a GPU overheat, lose its driver,
report ECC errors and XIDs by code, or hold its clocks down (through the agent's fault subject,
or the methods here) without any hardware.
"""

from __future__ import annotations

import math
import re
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from events.contract.messages import Fault
from events.node import GpuInfo, GpuMetrics
from runtime.env import RandomSource
from runtime.real_env import seeded_rng_factory

from .nvml import throttle_names
from .probe import CleanReadings, Inventory, ProbeError

_SIZE = re.compile(r"^(\d+(?:\.\d+)?)(TiB|TB|T|GiB|GB|G|MiB|MB|M)$", re.IGNORECASE)
_MIB_PER_UNIT = {"t": 1024 * 1024, "g": 1024, "m": 1}
_UUID_NAMESPACE = uuid.UUID("6f1b3c9e-4a55-4f7e-9d2a-1c0de5a9b001")  # gpumesh fake GPUs


@dataclass(frozen=True, slots=True)
class FakeGpuSpec:
    model: str
    vram_mib: int
    count: int


def parse_fake_gpus(spec: str) -> tuple[FakeGpuSpec, ...]:
    """`MODEL:VRAM[:COUNT],...` (VRAM like 24GiB, 80GB or 81920MiB; COUNT defaults to 1).

    Raises ValueError naming the part that is wrong.
    """
    if not spec.strip():
        raise ValueError("empty --fake-gpus spec: expected MODEL:VRAM:COUNT, e.g. RTX4090:24GiB:2")
    return tuple(_parse_entry(entry.strip()) for entry in spec.split(","))


def _parse_entry(entry: str) -> FakeGpuSpec:
    where = f"bad --fake-gpus entry {entry!r}"
    parts = entry.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(f"{where}: expected MODEL:VRAM:COUNT, e.g. RTX4090:24GiB:2")
    model, vram = parts[0].strip(), parts[1].strip()
    if not model:
        raise ValueError(f"{where}: the MODEL part is empty")
    match = _SIZE.match(vram)
    if match is None:
        raise ValueError(f"{where}: VRAM {vram!r} is not a size like 24GiB, 80GB or 81920MiB")
    vram_mib = round(float(match[1]) * _MIB_PER_UNIT[match[2][0].lower()])
    if vram_mib <= 0:
        raise ValueError(f"{where}: VRAM {vram!r} must be more than 0")
    count_text = parts[2].strip() if len(parts) == 3 else "1"
    if not count_text.isdigit() or int(count_text) < 1:
        raise ValueError(f"{where}: COUNT {count_text!r} is not a whole number of at least 1")
    return FakeGpuSpec(model=model, vram_mib=vram_mib, count=int(count_text))


class FakeGpuProbe:
    """Implements GpuProbe and FaultInjectable. Metrics are idle readings until a fault says
    otherwise; utilisation is drawn from the injected random source so runs repeat."""

    IDLE_TEMPERATURE_C = 35.0
    SLOWDOWN_TEMPERATURE_C = 87.0  # where real datacenter GPUs start thermal slowdown
    IDLE_POWER_W = 60.0

    def __init__(
        self,
        gpus: Sequence[GpuInfo],
        *,
        rng: RandomSource | None = None,
        driver_version: str = "fake-550.54",
        cuda_version: str = "12.4",
    ) -> None:
        self._gpus = tuple(gpus)
        self._rng: RandomSource = rng if rng is not None else seeded_rng_factory(0)("fake-gpu")
        self._driver_version = driver_version
        self._cuda_version = cuda_version
        self.clear()

    @classmethod
    def parse(
        cls, spec: str, *, rng: RandomSource | None = None, node_id: str = ""
    ) -> FakeGpuProbe:
        """GPUs from a `--fake-gpus` spec; their UUIDs are stable for a given `node_id`."""
        gpus: list[GpuInfo] = []
        for entry in parse_fake_gpus(spec):
            for _ in range(entry.count):
                index = len(gpus)
                stable = uuid.uuid5(_UUID_NAMESPACE, f"{node_id}/{index}/{entry.model}")
                gpus.append(
                    GpuInfo(
                        index=index,
                        uuid=f"GPU-{stable}",
                        model=entry.model,
                        vram_mib=entry.vram_mib,
                    )
                )
        return cls(gpus, rng=rng)

    @property
    def gpus(self) -> tuple[GpuInfo, ...]:
        return self._gpus

    async def inventory(self) -> Inventory:
        return Inventory(
            gpus=self._gpus, driver_version=self._driver_version, cuda_version=self._cuda_version
        )

    async def sample(self) -> tuple[GpuMetrics, ...]:
        if self._driver_error:
            raise ProbeError("NVML: Unknown Error (fake driver failure injected)")
        return tuple(self._metrics(gpu) for gpu in self._gpus)

    def _metrics(self, gpu: GpuInfo) -> GpuMetrics:
        temperature = self._temperature[gpu.index]
        utilization = round(self._rng.uniform(0.0, 3.0), 1)
        throttle = self._throttle[gpu.index]
        if temperature >= self.SLOWDOWN_TEMPERATURE_C and "sw_thermal_slowdown" not in throttle:
            throttle = (*throttle, "sw_thermal_slowdown")
        xids = self._xid[gpu.index]
        return GpuMetrics(
            index=gpu.index,
            temperature_c=temperature,
            utilization_pct=utilization,
            memory_used_mib=0,
            memory_total_mib=gpu.vram_mib,
            ecc_uncorrected=self._ecc[gpu.index],
            xid_errors=xids.total(),
            throttle_reasons=throttle,
            power_w=self.IDLE_POWER_W,
            xids=tuple(sorted(xids)),
            unthrottled_readings=self._clean.count(gpu.index, throttle),
        )

    # Fault switches.

    def set_temperature(self, celsius: float, gpu: int = -1) -> None:
        if not math.isfinite(celsius):
            raise ValueError(f"temperature must be a finite number, got {celsius}")
        for index in self._targets(gpu):
            self._temperature[index] = float(celsius)

    def set_driver_error(self, on: bool) -> None:
        self._driver_error = on

    def add_ecc(self, n: int = 1, gpu: int = -1) -> None:
        self._add(self._ecc, n, gpu, "ECC error count")

    def add_xid(self, code: int = 79, gpu: int = -1, times: int = 1) -> None:
        """The driver reports XID `code` (79: fallen off the bus) `times` times, as NVML's
        event set would: kept until `clear`, like the NVML probe keeps them."""
        if not 1 <= code <= 0xFFFF:
            raise ValueError(f"an XID code is a whole number from 1, got {code}")
        if times < 1:
            raise ValueError(f"XIDs to add must be at least 1, got {times}")
        for index in self._targets(gpu):
            self._xid[index][code] += times

    def set_throttle(self, reasons: int | Sequence[str], gpu: int = -1) -> None:
        """Hold the clocks down for `reasons` (NVML's names, or its bit mask: 0x8 is
        hw_slowdown) until `clear` or a call with none."""
        names = throttle_names(reasons) if isinstance(reasons, int) else tuple(reasons)
        known = throttle_names(-1)
        unknown = [name for name in names if name not in known]
        if unknown:
            raise ValueError(f"unknown throttle reason {unknown[0]!r} (known: {', '.join(known)})")
        for index in self._targets(gpu):
            self._throttle[index] = names

    def clear(self) -> None:
        """Back to healthy idle GPUs: temperatures, driver, ECC and XID counters and throttle
        reasons all reset (as after a GPU reset, which clears the volatile counters)."""
        count = len(self._gpus)
        self._temperature = [self.IDLE_TEMPERATURE_C] * count
        self._ecc = [0] * count
        self._xid: list[Counter[int]] = [Counter() for _ in range(count)]
        self._throttle: list[tuple[str, ...]] = [()] * count
        self._driver_error = False
        self._clean = CleanReadings()

    def apply_fault(self, fault: Fault) -> None:
        """`thermal` sets the temperature to `value`; `driver` makes sampling fail until
        `clear`; `ecc` adds `value` errors (1 if 0); `xid` reports XID `value` once (79 if
        0); `throttle` holds the clocks down for the reasons in `value`, NVML's bit mask (0:
        none); `gpu` -1 means every GPU."""
        match fault.kind:
            case "thermal":
                self.set_temperature(fault.value, fault.gpu)
            case "driver":
                self._targets(fault.gpu)  # still reject a GPU this node lacks
                self.set_driver_error(True)
            case "ecc":
                self.add_ecc(_count(fault.value), fault.gpu)
            case "xid":
                self.add_xid(_count(fault.value, default=79), fault.gpu)
            case "throttle":
                self.set_throttle(_count(fault.value, default=0), fault.gpu)
            case "clear":
                self.clear()

    def _add(self, counters: list[int], n: int, gpu: int, what: str) -> None:
        if n < 1:
            raise ValueError(f"{what} to add must be at least 1, got {n}")
        for index in self._targets(gpu):
            counters[index] += n

    def _targets(self, gpu: int) -> range:
        if gpu == -1:
            return range(len(self._gpus))
        if 0 <= gpu < len(self._gpus):
            return range(gpu, gpu + 1)
        if not self._gpus:
            raise ValueError(f"no GPU {gpu} on this node (it has none)")
        raise ValueError(
            f"no GPU {gpu} on this node (it has GPUs 0..{len(self._gpus) - 1}; -1 means all)"
        )


def _count(value: float, *, default: int = 1) -> int:
    if not math.isfinite(value) or value < 0 or value != int(value):
        raise ValueError(f"an error count must be a whole number, got {value:g}")
    return int(value) or default
