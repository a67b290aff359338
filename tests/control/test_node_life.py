"""The life of a node, on virtual time: drained and undrained, removed by the operator once it is
offline, and removed on its own after the retention; each a recorded event that says why, and
a rebuild of the log equals the live state after each."""

from __future__ import annotations

import asyncio

import projections
from actors.controller import ControllerConfig
from actors.health import HealthPolicy
from events import NodeDrained, NodeRemoved, NodeUndrained
from sim import run_simulation
from tests.control.harness import Fleet, fleet

SPEC = {"name": "llama", "replicas": 1, "command": "gpumesh workload echo --port {port}"}


def node_events(f: Fleet, node_id: str) -> list[tuple[str, str]]:
    kinds = (NodeDrained, NodeUndrained, NodeRemoved)
    return [
        (e.type, e.payload.reason)
        for e in f.store.read_all_now()
        if isinstance(e.payload, kinds) and e.payload.node_id == node_id
    ]


def test_a_drained_node_is_undrained_and_takes_replicas_again() -> None:
    async def main() -> None:
        async with fleet(1) as f:
            refused = await f.api("node.undrain", {"node_id": "n0"})
            assert not refused.ok and refused.error == "node 'n0' is not drained"
            assert (await f.api("node.drain", {"node_id": "n0"})).ok
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(
                lambda: (
                    "llama" in f.state.clusters.clusters
                    and f.state.clusters.clusters["llama"].unschedulable != ""
                ),
                within=5,
                why="nowhere to place on a drained fleet",
            )
            reply = await f.api("node.undrain", {"node_id": "n0"})
            assert reply.ok and reply.data == {"node_id": "n0", "drained": False}
            assert f.state.nodes.nodes["n0"].drained is False
            await f.until(lambda: len(f.ready("llama")) == 1, within=10, why="placed on n0")
            assert node_events(f, "n0") == [
                ("node.drained.v1", "drained by operator"),
                ("node.undrained.v1", "undrained by operator"),
            ]
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_only_an_offline_node_is_removed_and_registering_brings_it_back() -> None:
    async def main() -> None:
        async with fleet(2) as f:
            refused = await f.api("node.remove", {"node_id": "n1"})
            assert not refused.ok and "is healthy, not offline" in refused.error
            unknown = await f.api("node.remove", {"node_id": "nope"})
            assert not unknown.ok and unknown.error == "unknown node 'nope'"
            agent = f.agents["n1"]
            f.kill("n1")
            await f.until(
                lambda: f.state.nodes.nodes["n1"].health == "offline", within=10, why="offline"
            )
            reply = await f.api("node.remove", {"node_id": "n1"})
            assert reply.ok and reply.data == {"node_id": "n1", "removed": True}
            assert "n1" not in f.state.nodes.nodes
            assert node_events(f, "n1") == [("node.removed.v1", "removed by operator")]
            assert projections.rebuild(f.store.read_all_now()) == f.state
            await f.start_agent(agent)  # the same node's agent, back
            assert f.state.nodes.nodes["n1"].health == "healthy"

    run_simulation(main())


def test_a_node_offline_past_the_retention_is_removed_with_the_reason() -> None:
    policy = HealthPolicy(remove_offline_after_s=60.0)

    async def main() -> None:
        async with fleet(2, config=ControllerConfig(health=policy)) as f:
            f.kill("n1")
            await f.until(
                lambda: f.state.nodes.nodes["n1"].health == "offline", within=10, why="offline"
            )
            took = await f.until(lambda: "n1" not in f.state.nodes.nodes, within=120, why="removed")
            assert 50.0 <= took <= 62.0, took  # 60 s of silence, counted from the last beat
            assert node_events(f, "n1") == [
                ("node.removed.v1", "offline for over 60 s (--remove-offline-after)")
            ]
            assert "n0" in f.state.nodes.nodes  # a live node stays

    run_simulation(main())


def test_no_retention_keeps_an_offline_node_listed() -> None:
    policy = HealthPolicy(remove_offline_after_s=0.0)

    async def main() -> None:
        async with fleet(1, config=ControllerConfig(health=policy)) as f:
            f.kill("n0")
            await f.until(
                lambda: f.state.nodes.nodes["n0"].health == "offline", within=10, why="offline"
            )
            await asyncio.sleep(600.0)  # virtual time
            assert f.state.nodes.nodes["n0"].health == "offline"
            assert node_events(f, "n0") == []

    run_simulation(main())
