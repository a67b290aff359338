"""What the agent needs from a GPU reader, whatever reads it (NVML, a fake, the simulator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from events.contract.messages import Fault
from events.node import GpuInfo, GpuMetrics


class ProbeError(Exception):
    """The GPUs or their driver could not be read this time (the heartbeat says so)."""


class NoGpuError(Exception):
    """No usable NVIDIA GPU on this machine: the agent cannot start with the real probe."""


@dataclass(frozen=True, slots=True)
class Inventory:
    """The static facts sent at registration."""

    gpus: tuple[GpuInfo, ...]
    driver_version: str = ""
    cuda_version: str = ""


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
