"""A node that misses a few heartbeats is recorded suspect, on virtual time.

Suspect is a recorded health verdict (`node.health_changed.v1`, state `suspect`): operators see
it in `gpumesh nodes` and the event log; the scheduler gives the node no new replicas; the
replicas it runs keep serving and routing until it is declared offline, or it is heard again.
"""

from __future__ import annotations

import asyncio

import projections
from actors.cli import health_policy
from actors.controller import ControllerConfig
from actors.health import HealthPolicy
from events import NodeHealthChanged, ReplicaPlaced
from gpumesh.cli import build_parser
from sim import run_simulation
from tests.control.harness import Fleet, fleet

SPEC = {"name": "llama", "replicas": 2, "command": "gpumesh workload echo --port {port}"}


def health_events(f: Fleet, node_id: str) -> list[tuple[str, str]]:
    return [
        (e.payload.state, e.payload.reason)
        for e in f.store.read_all_now()
        if isinstance(e.payload, NodeHealthChanged) and e.payload.node_id == node_id
    ]


def routed(f: Fleet) -> set[str]:
    return {r.replica_id for r in f.state.routing.routes.get("llama", ())}


def test_a_silent_node_is_suspect_keeps_serving_and_takes_no_new_replicas() -> None:
    # Offline far away, so everything suspect means can be looked at before it escalates.
    config = ControllerConfig(health=HealthPolicy(suspect_after=2, offline_after=30))

    async def main() -> None:
        async with fleet(2, config=config) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="2 ready")
            victim = f.state.replicas.replicas["llama-0"].node_id
            other = next(n for n in f.agents if n != victim)
            f.agents[victim].heartbeating = False
            took = await f.until(
                lambda: f.state.nodes.nodes[victim].health == "suspect", within=10, why="suspect"
            )
            assert 1.0 <= took <= 3.0  # 2 missed 1 s heartbeats, from the last one heard
            view = f.state.nodes.nodes[victim]
            assert (view.health_reason, view.health_detail) == (
                "missed_heartbeats",
                "2 heartbeats missed",
            )
            assert health_events(f, victim) == [("suspect", "missed_heartbeats")]

            # Its replica keeps serving and routing: nothing failed, nothing moved.
            assert f.state.replicas.replicas["llama-0"].status == "ready"
            assert routed(f) == {"llama-0", "llama-1"}
            # ... but a new replica goes elsewhere, and the decision says why.
            assert (await f.api("cluster.scale", {"name": "llama", "replicas": 3})).ok
            await f.until(lambda: "llama-2" in f.state.replicas.replicas, within=5, why="placed")
            assert f.state.replicas.replicas["llama-2"].node_id == other
            (placed,) = [
                e.payload
                for e in f.store.read_all_now()
                if isinstance(e.payload, ReplicaPlaced) and e.payload.replica_id == "llama-2"
            ]
            rejected = {c.node_id: c.rejected for c in placed.candidates if c.rejected}
            assert rejected == {victim: "suspect (missed_heartbeats)"}
            await asyncio.sleep(3.0)  # well past suspect, far from offline
            assert f.state.replicas.replicas["llama-0"].epoch == 1
            assert "llama-0" in routed(f)

            # Heard again: the suspicion is cleared by a recorded verdict.
            f.agents[victim].heartbeating = True
            await f.until(
                lambda: f.state.nodes.nodes[victim].health == "healthy", within=5, why="cleared"
            )
            assert health_events(f, victim) == [
                ("suspect", "missed_heartbeats"),
                ("healthy", "recovered"),
            ]
            assert projections.rebuild(f.store.read_all_now()) == f.state

    run_simulation(main())


def test_suspect_then_offline_moves_the_replicas_once() -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="2 ready")
            victim = f.state.replicas.replicas["llama-0"].node_id
            f.kill(victim)
            await f.until(
                lambda: f.state.nodes.nodes[victim].health == "offline", within=10, why="offline"
            )
            assert health_events(f, victim) == [
                ("suspect", "missed_heartbeats"),
                ("offline", "missed_heartbeats"),
            ]
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="replaced")
            assert f.state.replicas.replicas["llama-0"].epoch == 2

    run_simulation(main())


def test_an_unhealthy_node_that_goes_silent_is_not_made_suspect() -> None:
    # Suspect routes; unhealthy does not. Silence must not turn a hardware verdict routable.
    async def main() -> None:
        async with fleet(2) as f:
            agent = f.agents["n0"]
            agent.probe_error = "NVML: driver not loaded"
            await f.until(
                lambda: f.state.nodes.nodes["n0"].health == "unhealthy", within=5, why="unhealthy"
            )
            agent.heartbeating = False
            await f.until(
                lambda: f.state.nodes.nodes["n0"].health == "offline", within=10, why="offline"
            )
            assert [s for s, _ in health_events(f, "n0")] == ["unhealthy", "offline"]

    run_simulation(main())


def test_non_default_suspect_and_offline_flags_take_effect() -> None:
    args = build_parser().parse_args(["controller", "--suspect-after", "4", "--offline-after", "6"])
    policy = health_policy(args)
    assert (policy.suspect_after, policy.offline_after) == (4, 6)

    async def main() -> None:
        async with fleet(1, config=ControllerConfig(health=policy)) as f:
            loop = asyncio.get_running_loop()
            f.agents["n0"].heartbeating = False
            silent_from = loop.time()
            await f.until(
                lambda: f.state.nodes.nodes["n0"].health == "suspect", within=10, why="suspect"
            )
            suspect_at = loop.time() - silent_from
            await f.until(
                lambda: f.state.nodes.nodes["n0"].health == "offline", within=10, why="offline"
            )
            offline_at = loop.time() - silent_from
            # The last heartbeat was up to 1 s before the silence began; defaults would give
            # about 2 s and 3 s.
            assert 3.0 <= suspect_at <= 4.1, suspect_at
            assert 5.0 <= offline_at <= 6.1, offline_at

    run_simulation(main())
