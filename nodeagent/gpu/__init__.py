"""Reading GPUs: the probe protocol, the NVML probe for real GPUs and a fake one with faults."""

from .fake import FakeGpuProbe as FakeGpuProbe, parse_fake_gpus as parse_fake_gpus
from .nvml import NvmlProbe as NvmlProbe
from .probe import (
    FaultInjectable as FaultInjectable,
    GpuProbe as GpuProbe,
    Inventory as Inventory,
    NoGpuError as NoGpuError,
    ProbeError as ProbeError,
)
