"""GPU health signals end to end on virtual time: the fake probe's XIDs and slowdowns, through
heartbeats, to the controller's verdict (actors/health.py, docs/gpus.md)."""

from __future__ import annotations

from actors.health import HealthPolicy
from nodeagent.gpu import FakeGpuProbe
from sim import run_simulation
from tests.control.harness import Fleet, ScriptedAgent, fleet

SPEC = {"name": "llama", "replicas": 1, "command": "gpumesh workload echo --port {port}"}


async def with_probe(f: Fleet, node_id: str) -> FakeGpuProbe:
    """An agent whose heartbeats carry a fake probe's readings, its GPUs named as NVML does."""
    probe = FakeGpuProbe.parse("NVIDIA H100 80GB HBM3:80GiB:2", node_id=node_id)
    await f.start_agent(ScriptedAgent(node_id, f.bus, f.commands, probe=probe))
    return probe


def test_an_application_xid_leaves_the_node_healthy_and_xid_79_moves_its_replica() -> None:
    async def main() -> None:
        async with fleet(0) as f:
            probes = {n: await with_probe(f, n) for n in ("gpu-1", "gpu-2")}
            assert (await f.api("cluster.create", {**SPEC, "gpu": {"models": ["H100"]}})).ok
            await f.until(lambda: len(f.ready("llama")) == 1, within=10, why="ready")
            node = f.state.replicas.replicas["llama-0"].node_id
            probe = probes[node]
            probe.add_xid(13, gpu=0)  # the application's kernel faulted: not the GPU's fault
            await f.until(
                lambda: f.state.nodes.nodes[node].metrics[0].xid_errors > 0, within=5, why="seen"
            )
            assert f.state.nodes.nodes[node].metrics[0].xids == (13,)
            assert f.state.nodes.nodes[node].health == "healthy"
            probe.add_xid(79, gpu=1)
            await f.until(
                lambda: f.state.nodes.nodes[node].health == "unhealthy", within=5, why="xid 79"
            )
            view = f.state.nodes.nodes[node]
            assert (view.health_reason, view.health_detail) == (
                "xid",
                "XID 79 on GPU 1: GPU has fallen off the bus",
            )
            await f.until(
                lambda: any(
                    r.node_id != node and r.status == "ready"
                    for r in f.state.replicas.replicas.values()
                ),
                within=15,
                why="replaced on the other node",
            )

    run_simulation(main())


def test_a_slowdown_degrades_and_clears_only_after_n_clean_heartbeats() -> None:
    need = HealthPolicy().throttle_clear_after

    async def main() -> None:
        async with fleet(0) as f:
            probe = await with_probe(f, "gpu-1")
            probe.set_throttle(["hw_power_brake_slowdown"], gpu=1)
            await f.until(
                lambda: f.state.nodes.nodes["gpu-1"].health == "degraded", within=5, why="slowed"
            )
            assert f.state.nodes.nodes["gpu-1"].health_reason == "throttle"
            probe.set_throttle(())
            took = await f.until(
                lambda: f.state.nodes.nodes["gpu-1"].health == "healthy",
                within=need + 5,
                why="cleared",
            )
            # One heartbeat a second: not before `need` clean readings in a row.
            assert took >= need - 1.5

    run_simulation(main())
