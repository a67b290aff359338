"""A controller that starts (or takes over) owes every node a grace, on virtual time.

While no controller took heartbeats in, agents still connected to NATS kept serving on their
last lease (nodeagent/agent.py). So a controller that begins to hear declares nobody it has not
heard from since suspect or offline, and places nothing on such a node, until a full lease plus
the offline window (HealthPolicy.grace_s) has passed; it records that grace as an event.
"""

from __future__ import annotations

import asyncio

import pytest

from actors.controller import ControllerConfig
from actors.health import HealthPolicy
from events import ControllerGrace, NodeHealthChanged, ReplicaPlaced
from sim import run_simulation
from tests.control.harness import ScriptedAgent, fleet

SPEC = {"name": "llama", "replicas": 2, "command": "gpumesh workload echo --port {port}"}
POLICY = HealthPolicy()  # 1 s heartbeats, suspect after 2, offline after 3: grace 5.4 s


def test_the_grace_is_a_lease_plus_the_offline_window() -> None:
    assert POLICY.lease_s == pytest.approx(2.4)
    assert POLICY.grace_s == pytest.approx(5.4)


def test_a_node_not_heard_from_after_a_restart_is_declared_offline_only_after_the_grace() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="2 ready")
            store, agents = f.store, f.agents
            holders = {r.node_id for r in f.state.replicas.replicas.values()}
        silent = sorted(holders)[0]  # died while no controller ran: it is never heard again
        async with fleet(0, store=store, config=ControllerConfig(health=POLICY)) as g:
            loop = asyncio.get_running_loop()
            began = g.controller.liveness.hearing_since
            for node_id, agent in sorted(agents.items()):
                if node_id != silent:
                    await g.start_agent(
                        ScriptedAgent(node_id, g.bus, g.commands, running=agent.running)
                    )
            await g.until(
                lambda: g.state.nodes.nodes[silent].health == "offline", within=20, why="offline"
            )
            took = loop.time() - began
            assert POLICY.grace_s <= took <= POLICY.grace_s + 0.5
            verdicts = [
                e.payload.state
                for e in store.read_all_now()
                if isinstance(e.payload, NodeHealthChanged) and e.payload.node_id == silent
            ]
            assert verdicts == ["offline"]  # never suspect during the grace
            # Its replica is replaced, on a node this controller heard from.
            await g.until(lambda: len(g.ready("llama")) == 2, within=20, why="replaced")
            (grace,) = [
                e.payload for e in store.read_all_now() if isinstance(e.payload, ControllerGrace)
            ][-1:]
            assert grace.reason == "started"
            assert (grace.grace_s, grace.lease_s) == (POLICY.grace_s, POLICY.lease_s)
            placed_after = [
                e.payload.node_id
                for e in store.read_all_now()
                if isinstance(e.payload, ReplicaPlaced) and e.payload.epoch > 1
            ]
            assert placed_after and silent not in placed_after

    run_simulation(main())


def test_a_node_heard_from_after_the_restart_follows_the_usual_rules() -> None:
    async def main() -> None:
        async with fleet(2) as f:
            store, agents = f.store, f.agents
        async with fleet(0, store=store, config=ControllerConfig(health=POLICY)) as g:
            for node_id in sorted(agents):
                await g.start_agent(ScriptedAgent(node_id, g.bus, g.commands))
            await g.until(lambda: "n0" in g.controller.liveness.last_heard, within=5, why="heard")
            loop = asyncio.get_running_loop()
            g.agents["n0"].heartbeating = False
            stopped = loop.time()
            await g.until(
                lambda: g.state.nodes.nodes["n0"].health == "offline", within=20, why="offline"
            )
            # From its last heartbeat, as always: three missed, not the grace again.
            assert loop.time() - stopped <= 3.5

    run_simulation(main())
