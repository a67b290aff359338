"""What the agent needs from a GPU reader, whatever reads it (NVML, a fake, the simulator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from events.contract.messages import Fault
from events.node import SLOWDOWN_REASONS, GpuInfo, GpuMetrics
from nodeagent.errors import AgentError


class ProbeError(AgentError):
    """The GPUs or their driver could not be read this time (the heartbeat says so). `gpu_index`
    names the GPU that failed, None when the driver itself did."""

    def __init__(self, reason: str, *, gpu_index: int | None = None) -> None:
        super().__init__(reason)
        self.gpu_index = gpu_index


class NoGpuError(AgentError):
    """No usable NVIDIA GPU on this machine: the agent cannot start with the real probe."""


@dataclass(frozen=True, slots=True)
class Inventory:
    """The static facts sent at registration."""

    gpus: tuple[GpuInfo, ...]
    driver_version: str = ""
    cuda_version: str = ""


class CleanReadings:
    """Per GPU, the readings in a row (this one included) with no slowdown among its clock
    event reasons: GpuMetrics.unthrottled_readings, from which the controller clears a
    throttle verdict only after enough of them (actors/health.py's hysteresis). Counted here,
    where every reading is taken: the controller sees only the heartbeats that could change
    its verdict. Capped, so a heartbeat does not carry an ever larger number."""

    CAP = 10_000

    def __init__(self) -> None:
        self._clean: dict[int, int] = {}

    def count(self, index: int, reasons: tuple[str, ...]) -> int:
        clean = 0 if SLOWDOWN_REASONS.intersection(reasons) else self._clean.get(index, 0) + 1
        self._clean[index] = min(clean, self.CAP)
        return self._clean[index]


class GpuProbe(Protocol):
    async def inventory(self) -> Inventory: ...

    async def sample(self) -> tuple[GpuMetrics, ...]:
        """Live readings of every GPU; raises ProbeError when they cannot be read."""
        ...


@runtime_checkable
class FaultInjectable(Protocol):
    """A probe that chaos tests can drive through the fault subject (fakes only)."""

    def apply_fault(self, fault: Fault) -> None:
        """Apply `fault`; ValueError (one line) when it names something this probe lacks."""
        ...
