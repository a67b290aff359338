"""Running replicas: the driver protocol and its adapters (process, docker, an in-memory fake).

The adapters are imported from their own modules (`workload.process`, `workload.docker`, ...)
so that `python -m nodeagent.workload.echo` starts without loading the others.
"""

from .base import (
    DriverUnavailable as DriverUnavailable,
    RunningWorkload as RunningWorkload,
    WorkloadDriver as WorkloadDriver,
    WorkloadEnded as WorkloadEnded,
    WorkloadStartError as WorkloadStartError,
)
