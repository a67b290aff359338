"""The node agent's Prometheus metrics (`gpumesh agent --metrics-listen HOST:PORT`).

Read at scrape time from the agent: each GPU's readings from the probe's last sample (what the
last heartbeat carried), the replicas it runs by state, the front's fenced refusals. The one
count the agent keeps for this is `AgentCounters`: workload restarts, from the reports it
sends anyway. The names are in docs/metrics.md.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from events.contract.messages import ReplicaState
from events.node import GpuMetrics
from wire.metrics_http import start_metrics

from .errors import AgentError
from .gpu.nvml import throttle_names

if TYPE_CHECKING:
    from .agent import Agent

THROTTLE_REASONS = throttle_names(0xFFFF)  # every reason NVML names, zero when inactive
RUN_STATES = ("starting", "ready", "failed", "stopped")
_MIB = 1024 * 1024


class AgentCounters:
    """Workload restarts in place, per replica (all its epochs), counted from the agent's
    reports: a restart reports `starting` with the detail "restart N after ..."."""

    def __init__(self) -> None:
        self.restarts: dict[str, int] = {}
        self._last: dict[str, tuple[int, int]] = {}  # replica id -> (epoch, N) last counted

    def reported(self, state: ReplicaState) -> None:
        if state.state != "starting" or not state.detail.startswith("restart "):
            return
        number = state.detail.split(" ", 2)[1]
        if not number.isdigit():
            return
        n = int(number)
        epoch, counted = self._last.get(state.replica_id, (state.epoch, 0))
        if epoch != state.epoch:
            counted = 0  # a new epoch's runner counts from 1 again
        if n > counted:
            self.restarts[state.replica_id] = self.restarts.get(state.replica_id, 0) + n - counted
            self._last[state.replica_id] = (state.epoch, n)


def gpu_families(
    node: str, gpus: Sequence[GpuMetrics], probe_error: str, sampled: bool
) -> Iterator[Metric]:
    """The GPUs' readings as families (`sampled`: a sample was taken at all)."""
    labels = ["node", "gpu"]

    def gauge(name: str, help: str, extra: Sequence[str] = ()) -> GaugeMetricFamily:
        return GaugeMetricFamily(name, help, labels=[*labels, *extra])

    temperature = gauge("gpumesh_agent_gpu_temperature_celsius", "GPU core temperature.")
    utilization = gauge(
        "gpumesh_agent_gpu_utilization_ratio", "Share of the last sample period the GPU was busy."
    )
    used = gauge("gpumesh_agent_gpu_memory_used_bytes", "GPU memory in use.")
    total = gauge("gpumesh_agent_gpu_memory_total_bytes", "GPU memory in all.")
    power = gauge("gpumesh_agent_gpu_power_watts", "GPU power draw.")
    ecc = gauge(
        "gpumesh_agent_gpu_ecc_uncorrected_errors",
        "Uncorrected ECC errors the driver counts (volatile: since the driver loaded).",
    )
    xid = gauge("gpumesh_agent_gpu_xid_errors", "XID errors the probe saw.")
    throttled = gauge(
        "gpumesh_agent_gpu_throttled",
        "1 for each reason NVML gives for holding the GPU's clocks down now, else 0.",
        ["reason"],
    )
    for gpu in gpus:
        at = [node, str(gpu.index)]
        temperature.add_metric(at, gpu.temperature_c)
        utilization.add_metric(at, gpu.utilization_pct / 100.0)
        used.add_metric(at, gpu.memory_used_mib * _MIB)
        total.add_metric(at, gpu.memory_total_mib * _MIB)
        power.add_metric(at, gpu.power_w)
        ecc.add_metric(at, gpu.ecc_uncorrected)
        xid.add_metric(at, gpu.xid_errors)
        active = set(gpu.throttle_reasons)
        for reason in (*THROTTLE_REASONS, *sorted(active - set(THROTTLE_REASONS))):
            throttled.add_metric([*at, reason], 1.0 if reason in active else 0.0)
    yield from (temperature, utilization, used, total, power, ecc, xid, throttled)
    probe = GaugeMetricFamily(
        "gpumesh_agent_gpu_probe_ok",
        "1 when the last GPU sample was read, 0 when the probe failed (the heartbeat says why).",
        labels=["node"],
    )
    if sampled:
        probe.add_metric([node], 0.0 if probe_error else 1.0)
    yield probe


class AgentCollector:
    """Every agent metric, read from the agent at scrape time."""

    def __init__(self, agent: Agent) -> None:
        self._agent = agent

    def collect(self) -> Iterator[Metric]:
        agent = self._agent
        node = agent.config.node_id
        gpus, error, sampled = agent.last_sample
        yield from gpu_families(node, gpus, error, sampled)
        replicas = GaugeMetricFamily(
            "gpumesh_agent_replicas",
            "Replicas this agent was told to run and not yet told to stop, by state.",
            labels=["node", "state"],
        )
        states: dict[str, int] = dict.fromkeys(RUN_STATES, 0)
        for held in agent.replicas():
            states[held.state] = states.get(held.state, 0) + 1
        for name, count in states.items():
            replicas.add_metric([node, name], count)
        yield replicas
        restarts = CounterMetricFamily(
            "gpumesh_agent_workload_restarts",
            "Workloads restarted in place after they ended, by replica (all its epochs).",
            labels=["node", "replica"],
        )
        for replica, count in sorted(agent.counters.restarts.items()):
            restarts.add_metric([node, replica], count)
        yield restarts
        fenced = CounterMetricFamily(
            "gpumesh_agent_front_fenced_requests",
            "Requests the node's front refused because the lease did not cover the replica.",
            labels=["node"],
        )
        if agent.front is not None:
            fenced.add_metric([node], agent.front.fenced)
        yield fenced
        registered = GaugeMetricFamily(
            "gpumesh_agent_registered", "1 once the controller accepted this node.", labels=["node"]
        )
        registered.add_metric([node], 1.0 if agent.registered else 0.0)
        yield registered


async def run_agent(agent: Agent, listen: str | None) -> None:
    """`agent.run()`, with its metrics served on `listen` while it runs (None: none)."""
    if listen is None:
        await agent.run()
        return
    disable_created_metrics()  # type: ignore[no-untyped-call]  # the library's, process-wide
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))
    try:
        runner = await start_metrics(registry, listen, name=f"agent {agent.config.node_id}")
    except ValueError as exc:
        raise AgentError(str(exc)) from None
    try:
        await agent.run()
    finally:
        await runner.cleanup()
