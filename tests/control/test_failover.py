"""The controller end to end on virtual time: placement, detection, replacement, fencing."""

from __future__ import annotations

import msgspec

import projections
from sim import run_simulation
from tests.control.harness import ScriptedAgent, fleet

SPEC = {"name": "llama", "replicas": 2, "command": "gpumesh workload echo --port {port}"}


def test_placement_spreads_replicas_and_routes_them() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            reply = await f.api("cluster.create", SPEC)
            assert reply.ok, reply.error
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="2 ready")
            nodes = {f.state.replicas.replicas[r].node_id for r in f.ready("llama")}
            assert len(nodes) == 2
            routes = f.state.routing.routes["llama"]
            assert sorted(r.replica_id for r in routes) == ["llama-0", "llama-1"]
            placed = [e for e in f.store.read_all_now() if e.type == "replica.placed.v1"]
            assert all(e.payload.why for e in placed)  # type: ignore[union-attr]
            # Live state always equals a rebuild of the log.
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_power_loss_is_detected_and_replaced_elsewhere() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="2 ready")
            victim = f.state.replicas.replicas["llama-0"].node_id
            f.kill(victim)
            detect = await f.until(
                lambda: f.state.nodes.nodes[victim].health == "offline", within=10, why="offline"
            )
            assert detect <= 4.0  # 3 missed heartbeats, checked every quarter interval
            assert "llama-0" not in {r.replica_id for r in f.state.routing.routes.get("llama", ())}
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="replaced")
            moved = f.state.replicas.replicas["llama-0"]
            assert moved.node_id != victim and moved.epoch == 2
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_partitioned_node_returns_and_its_superseded_replica_is_stopped() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="2 ready")
            victim_node = f.state.replicas.replicas["llama-0"].node_id
            agent = f.agents[victim_node]
            agent.heartbeating = False  # SIGSTOP
            agent.obeying = False
            await f.until(
                lambda: (
                    f.state.replicas.replicas["llama-0"].epoch == 2
                    and f.state.replicas.replicas["llama-0"].status == "ready"
                ),
                within=15,
                why="replaced at epoch 2",
            )
            agent.heartbeating = True  # SIGCONT: it still runs llama-0 at epoch 1
            agent.obeying = True
            await f.until(
                lambda: ("llama-0", 1) in agent.stopped, within=10, why="old epoch stopped"
            )
            assert f.state.nodes.nodes[victim_node].health == "healthy"
            for route in f.state.routing.routes["llama"]:
                assert route.epoch == f.state.replicas.replicas[route.replica_id].epoch

    run_simulation(main())


def test_thermal_migration_replacement_ready_before_old_stops() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", {**SPEC, "replicas": 1})).ok
            await f.until(lambda: len(f.ready("llama")) == 1, within=10, why="ready")
            hot = f.state.replicas.replicas["llama-0"].node_id
            f.agents[hot].temperature = 92.0
            await f.until(
                lambda: f.state.nodes.nodes[hot].health == "degraded", within=5, why="degraded"
            )
            await f.until(
                lambda: f.state.replicas.replicas["llama-0"].status == "stopped",
                within=15,
                why="old stopped",
            )
            log = f.store.read_all_now()
            ready_new = next(
                e.position
                for e in log
                if e.type == "replica.ready.v1" and e.stream == "replica/llama-1"
            )
            stopping_old = next(
                e.position
                for e in log
                if e.type == "replica.stopping.v1" and e.stream == "replica/llama-0"
            )
            assert ready_new < stopping_old
            assert f.ready("llama") == ["llama-1"]
            f.agents[hot].temperature = 70.0  # cools below the low mark: back in the pool
            await f.until(
                lambda: f.state.nodes.nodes[hot].health == "healthy", within=5, why="recovered"
            )

    run_simulation(main())


def test_driver_crash_stops_and_replaces_workloads() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="2 ready")
            sick = f.state.replicas.replicas["llama-1"].node_id
            f.agents[sick].probe_error = "NVML_ERROR_GPU_IS_LOST"
            await f.until(
                lambda: f.state.nodes.nodes[sick].health == "unhealthy", within=5, why="unhealthy"
            )
            await f.until(
                lambda: (
                    len(f.ready("llama")) == 2
                    and f.state.replicas.replicas["llama-1"].node_id != sick
                ),
                within=10,
                why="replaced",
            )
            assert ("llama-1", 1) in f.agents[sick].stopped

    run_simulation(main())


def test_crash_loop_moves_the_replica_to_another_node() -> None:
    async def main() -> None:
        async with fleet(2) as f:
            f.agents["n0"].crash_on_start = True
            f.agents["n1"].crash_on_start = False
            assert (await f.api("cluster.create", {**SPEC, "replicas": 1})).ok
            await f.until(lambda: f.ready("llama") == ["llama-0"], within=15, why="ready")
            assert f.state.replicas.replicas["llama-0"].node_id == "n1"

    run_simulation(main())


def test_controller_restart_rebuilds_from_the_log_without_duplicates() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", {**SPEC, "replicas": 3})).ok
            await f.until(lambda: len(f.ready("llama")) >= 1, within=10, why="deploying")
            store = f.store
            agents = f.agents
        # The controller is gone mid-deploy; a new one starts on the same log and agents.
        async with fleet(0, store=store) as g:
            for agent in agents.values():
                fresh = ScriptedAgent(agent.node_id, g.bus, g.commands, running=agent.running)
                await g.start_agent(fresh)
            await g.until(lambda: len(g.ready("llama")) == 3, within=20, why="3 ready")
            ids = sorted(r.replica_id for r in g.state.replicas.replicas.values())
            assert ids == ["llama-0", "llama-1", "llama-2"]
            assert projections.rebuild(store.read_all_now()) == g.state

    run_simulation(main())


def test_bad_input_gets_clear_errors_and_changes_nothing() -> None:
    async def main() -> None:
        async with fleet(1) as f:
            before = len(f.store.read_all_now())
            bad = await f.api("cluster.create", {"name": "x", "replicas": -1, "command": "c"})
            assert not bad.ok and bad.error.startswith("replicas:")
            bad = await f.api("cluster.create", {"name": "x", "gpu": {"count": "two"}})
            assert not bad.ok and "gpu.count" in bad.error
            unknown = await f.api("cluster.scale", {"name": "nope", "replicas": 2})
            assert not unknown.ok and "unknown cluster 'nope'" in unknown.error
            await f.bus.publish("gpumesh.v1.node.n0.heartbeat", b"\x00garbage")
            await f.bus.publish(
                "gpumesh.v1.node.n0.heartbeat",
                msgspec.json.encode({"type": "heartbeat.v1", "node_id": "n9", "seq": 1}),
            )
            await f.until(
                lambda: (
                    f.controller.dropped["garbage"] == 1
                    and f.controller.dropped["impersonation"] == 1
                ),
                within=2,
                why="dropped",
            )
            after = [
                e
                for e in f.store.read_all_now()[before:]
                if not e.type.startswith("node.heartbeat")
            ]
            assert after == []
            assert (await f.api("cluster.list")).ok  # still serving

    run_simulation(main())


def test_an_agent_restart_that_lost_its_replica_gets_it_replaced() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", {**SPEC, "replicas": 1})).ok
            await f.until(lambda: f.ready("llama") == ["llama-0"], within=10, why="ready")
            node = f.state.replicas.replicas["llama-0"].node_id
            # The agent process restarts (the machine stays up) and knows nothing it ran.
            f.kill(node)
            await f.start_agent(ScriptedAgent(node, f.bus, f.commands))
            await f.until(
                lambda: (
                    f.state.replicas.replicas["llama-0"].epoch == 2
                    and f.state.replicas.replicas["llama-0"].status == "ready"
                ),
                within=10,
                why="replaced after the agent restart",
            )
            failed = [e for e in f.store.read_all_now() if e.type == "replica.failed.v1"]
            assert "after its agent re-registered" in failed[0].payload.detail  # type: ignore[union-attr]
            assert f.state.nodes.nodes[node].health == "healthy"  # the node itself is fine

    run_simulation(main())


def test_a_gateways_suspicion_is_recorded_for_the_current_epoch_only() -> None:
    from events.contract import subjects
    from events.contract.messages import ReplicaSuspicion

    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="2 ready")
            view = f.state.replicas.replicas["llama-0"]

            async def suspect(epoch: int) -> None:
                message = ReplicaSuspicion(
                    gateway_id="gw-1",
                    cluster="llama",
                    replica_id="llama-0",
                    node_id=view.node_id,
                    epoch=epoch,
                    reason="connect_error",
                    failures=3,
                    ejected_for_s=5.0,
                )
                await f.bus.publish(subjects.SUSPECT, msgspec.json.encode(message))

            def recorded() -> list[object]:
                return [e for e in f.store.read_all_now() if e.type == "replica.suspected.v1"]

            await suspect(view.epoch + 7)  # not an epoch the controller placed: dropped
            await f.bus.publish(subjects.SUSPECT, b"not json")  # garbage: dropped, no crash
            await suspect(view.epoch)
            await f.until(lambda: len(recorded()) == 1, within=5, why="suspicion recorded")
            event = recorded()[0]
            assert event.payload.epoch == view.epoch  # type: ignore[attr-defined]
            assert event.payload.gateway_id == "gw-1"  # type: ignore[attr-defined]
            assert f.controller.dropped["stale_suspicion"] == 1
            assert f.controller.dropped["garbage"] >= 1
            # Evidence only: the replica is still ready and routed.
            assert f.state.replicas.replicas["llama-0"].status == "ready"
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())
