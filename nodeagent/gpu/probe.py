"""What the agent needs from a GPU reader, whatever reads it (NVML, a fake, the simulator)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from events.contract.messages import Fault
from events.node import GpuInfo, GpuMetrics
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
