"""nodeagent/metrics.py: the agent's collector and its restart count."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from events.contract.messages import ReplicaState
from events.node import GpuMetrics
from nodeagent.metrics import AgentCollector, AgentCounters


@dataclass
class FakeConfig:
    node_id: str = "node-1"


@dataclass
class FakeFront:
    fenced: int = 0


@dataclass
class FakeAgent:
    gpus: tuple[GpuMetrics, ...] = ()
    error: str = ""
    sampled: bool = True
    states: tuple[ReplicaState, ...] = ()
    config: FakeConfig = field(default_factory=FakeConfig)
    counters: AgentCounters = field(default_factory=AgentCounters)
    front: FakeFront | None = field(default_factory=FakeFront)
    registered: bool = True

    @property
    def last_sample(self) -> tuple[tuple[GpuMetrics, ...], str, bool]:
        return self.gpus, self.error, self.sampled

    def replicas(self) -> tuple[ReplicaState, ...]:
        return self.states


def _scrape(agent: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(AgentCollector(agent))
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _state(replica: str, epoch: int, state: Any, detail: str = "") -> ReplicaState:
    return ReplicaState(replica_id=replica, epoch=epoch, state=state, detail=detail)


def test_gpus_replicas_and_restarts_from_the_agent() -> None:
    hot = GpuMetrics(
        index=1,
        temperature_c=91.0,
        utilization_pct=75.0,
        memory_used_mib=1024,
        memory_total_mib=24576,
        ecc_uncorrected=2,
        throttle_reasons=("sw_thermal_slowdown",),
        power_w=300.0,
    )
    agent = FakeAgent(
        gpus=(GpuMetrics(index=0, temperature_c=35.0, memory_total_mib=24576), hot),
        states=(_state("echo-0", 1, "ready"), _state("echo-1", 2, "starting")),
        front=FakeFront(fenced=4),
    )
    for state in (
        _state("echo-1", 1, "starting", "restart 1 after exit 1"),
        _state("echo-1", 1, "starting", "restart 1 after exit 1"),  # the relaunch, again
        _state("echo-1", 1, "starting", "restart 2 after exit 1"),
        _state("echo-1", 2, "starting", "restart 1 after exit 3"),  # a new epoch counts anew
        _state("echo-1", 2, "ready"),
    ):
        agent.counters.reported(state)

    s = _scrape(agent)
    gpu1 = (("gpu", "1"), ("node", "node-1"))
    assert s["gpumesh_agent_gpu_temperature_celsius", (("gpu", "0"), ("node", "node-1"))] == 35
    assert s["gpumesh_agent_gpu_temperature_celsius", gpu1] == 91
    assert s["gpumesh_agent_gpu_utilization_ratio", gpu1] == 0.75
    assert s["gpumesh_agent_gpu_memory_used_bytes", gpu1] == 1024 * 2**20
    assert s["gpumesh_agent_gpu_memory_total_bytes", gpu1] == 24576 * 2**20
    assert s["gpumesh_agent_gpu_ecc_uncorrected_errors", gpu1] == 2
    assert s["gpumesh_agent_gpu_power_watts", gpu1] == 300
    assert s["gpumesh_agent_gpu_throttled", (*gpu1, ("reason", "sw_thermal_slowdown"))] == 1
    assert s["gpumesh_agent_gpu_throttled", (*gpu1, ("reason", "hw_slowdown"))] == 0
    assert s["gpumesh_agent_gpu_probe_ok", (("node", "node-1"),)] == 1
    node = (("node", "node-1"),)
    assert s["gpumesh_agent_replicas", (*node, ("state", "ready"))] == 1
    assert s["gpumesh_agent_replicas", (*node, ("state", "starting"))] == 1
    assert s["gpumesh_agent_replicas", (*node, ("state", "failed"))] == 0
    assert s["gpumesh_agent_workload_restarts_total", (*node, ("replica", "echo-1"))] == 3
    assert s["gpumesh_agent_front_fenced_requests_total", node] == 4
    assert s["gpumesh_agent_registered", node] == 1


def test_a_failing_probe_and_no_sample_yet() -> None:
    failing = _scrape(FakeAgent(error="NVML: Unknown Error"))
    assert failing["gpumesh_agent_gpu_probe_ok", (("node", "node-1"),)] == 0
    assert not any(name == "gpumesh_agent_gpu_temperature_celsius" for name, _ in failing)
    unsampled = _scrape(FakeAgent(sampled=False, front=None, registered=False))
    assert not any(name == "gpumesh_agent_gpu_probe_ok" for name, _ in unsampled)
    assert unsampled["gpumesh_agent_registered", (("node", "node-1"),)] == 0
