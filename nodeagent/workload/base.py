"""The contract between the agent and whatever runs a replica (a process, a container, a fake)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from events.cluster import ClusterSpec
from nodeagent.errors import AgentError

EndReason = Literal["exited", "readiness_timeout", "liveness_failed", "start_failed", "stopped"]


class WorkloadStartError(AgentError):
    """The workload could not be launched at all (bad command, missing image, no port)."""


class DriverUnavailable(AgentError):
    """The driver cannot run anything on this machine (e.g. no docker engine answers)."""


@dataclass(frozen=True, slots=True)
class WorkloadEnded:
    """Why a workload is no longer serving."""

    reason: EndReason
    exit_code: int | None = None
    detail: str = ""

    def describe(self) -> str:
        """For report details: `exit code 3`, `liveness_failed (GET ... -> 500)`."""
        if self.reason == "exited":
            return f"exit code {self.exit_code}"
        if self.reason == "start_failed":
            return f"start failed: {self.detail}"
        return f"{self.reason} ({self.detail})" if self.detail else self.reason


class RunningWorkload(Protocol):
    @property
    def port(self) -> int:
        """The host port it serves on, at the agent's address."""
        ...

    async def wait_ready(self) -> WorkloadEnded | None:
        """None once the readiness probe passes; how it ended if it ended first (it may still
        be running after a readiness timeout: stop it)."""
        ...

    async def wait_ended(self) -> WorkloadEnded:
        """Watch a ready workload: returns when it exits or fails its liveness probe."""
        ...

    async def stop(self, grace_s: float) -> WorkloadEnded:
        """SIGTERM (or the driver's equivalent), SIGKILL after `grace_s`; safe to call after it
        exited (it then only sweeps what is left). Cancelling it kills at once."""
        ...


class WorkloadDriver(Protocol):
    host: str
    """Where the workloads it starts listen, as the agent reaches them (loopback by default)."""

    async def start(
        self,
        replica_id: str,
        epoch: int,
        spec: ClusterSpec,
        gpu_indices: Sequence[int],
        port: int,
    ) -> RunningWorkload:
        """Launch, without waiting for readiness. `port` 0: the spec's port, else a free one.
        `spec.secret_env` holds values here, not references (the agent resolved them): they
        go into the workload's environment and nowhere else, never onto a command line or
        into a log. Raises WorkloadStartError when it cannot be launched."""
        ...


def render_args(
    args: Sequence[str], *, port: int, gpu_ids: str, model: str, model_cache: str = ""
) -> list[str]:
    """Substitute {port}, {gpu_ids}, {model} and {model_cache} (the node's model cache
    directory, `gpumesh agent --model-cache`) inside each argument.

    After splitting, not before, so a model name with spaces stays one argument; and by plain
    replacement rather than str.format, so other braces (JSON flags) pass through untouched.
    """
    values = {
        "{port}": str(port),
        "{gpu_ids}": gpu_ids,
        "{model}": model,
        "{model_cache}": model_cache,
    }
    rendered = []
    for arg in args:
        for placeholder, value in values.items():
            arg = arg.replace(placeholder, value)
        rendered.append(arg)
    return rendered


def no_model_cache(cluster: str) -> str:
    """Why a spec that uses `{model_cache}` cannot start on a node without one."""
    return (
        f"cluster {cluster!r} uses {{model_cache}}, and this node has no model cache "
        "(gpumesh agent --model-cache DIR)"
    )


def gpu_ids(gpu_indices: Sequence[int]) -> str:
    return ",".join(str(i) for i in gpu_indices)


def model_name(spec: ClusterSpec) -> str:
    return spec.model or spec.name
