"""A node that misses a few heartbeats is recorded suspect, on virtual time.

Suspect is a recorded health verdict (`node.health_changed.v1`, state `suspect`): operators see
it in `gpumesh nodes` and the event log; the scheduler gives the node no new replicas; the
replicas it runs keep serving and routing until it is declared offline, or it is heard again.
"""

from __future__ import annotations

import asyncio
from typing import Any
from unittest.mock import patch

from structlog.testing import capture_logs

import projections
from actors.cli import health_policy
from actors.controller import ControllerConfig
from actors.health import HealthPolicy
from actors.node_actor import NodeActor
from events import NodeHealthChanged, ReplicaPlaced
from gpumesh.cli import build_parser
from sim import run_simulation
from sim.clock import SIM_EPOCH_NS
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


def health_times(f: Fleet, node_id: str) -> list[tuple[str, float]]:
    """(state, virtual seconds) of each recorded health change of `node_id`."""
    return [
        (e.payload.state, (e.recorded_at - SIM_EPOCH_NS) / 1e9)
        for e in f.store.read_all_now()
        if isinstance(e.payload, NodeHealthChanged) and e.payload.node_id == node_id
    ]


def test_suspect_and_offline_are_recorded_at_their_thresholds_from_the_last_heartbeat() -> None:
    async def main() -> None:
        async with fleet(2) as f:
            await asyncio.sleep(3.3)  # heartbeats every second, at no particular phase
            f.agents["n0"].heartbeating = False
            await asyncio.sleep(0.01)
            last = f.controller.liveness.last_heard["n0"]
            await f.until(
                lambda: f.state.nodes.nodes["n0"].health == "offline", within=10, why="offline"
            )
            (suspect, at_suspect), (offline, at_offline) = health_times(f, "n0")
            assert (suspect, offline) == ("suspect", "offline")
            # 2 and 3 missed intervals after the last heartbeat heard: no tick to wait for
            # (the look comes at the deadline itself, or 1/64 interval after if the float
            # arithmetic left it a hair short).
            assert 2.0 - 1e-6 <= at_suspect - last <= 2.0 + 1 / 64 + 1e-6, at_suspect - last
            assert 3.0 - 1e-6 <= at_offline - last <= 3.0 + 1 / 64 + 1e-6, at_offline - last
            assert health_times(f, "n1") == []  # the one still heartbeating: nothing

    run_simulation(main())


def test_a_failing_silence_look_crashes_the_node_actor_which_restarts_and_still_watches() -> None:
    failed: list[str] = []
    look = NodeActor._look

    def failing_once(self: NodeActor, ctx: Any, now: float) -> float | None:
        if self.node_id == "n0" and not failed:
            failed.append(self.node_id)
            raise RuntimeError("a bug in the look")
        return look(self, ctx, now)

    async def main() -> None:
        with capture_logs() as logs:
            async with fleet(2) as f:
                await asyncio.sleep(2.0)
                assert failed == ["n0"]
                f.agents["n0"].heartbeating = False
                await f.until(
                    lambda: f.state.nodes.nodes["n0"].health == "offline", within=10, why="offline"
                )
        # One crash (n0's actor: the only look that failed), then a restart that watches again.
        crashes = [(e["incarnation"], e["crashes"]) for e in logs if e["event"] == "actor_crashed"]
        assert crashes == [(0, 1)]

    with patch.object(NodeActor, "_look", failing_once):
        run_simulation(main())


def test_while_the_controller_is_cut_off_nobody_goes_offline_then_silence_counts_anew() -> None:
    async def main() -> None:
        with capture_logs() as logs:
            async with fleet(2) as f:
                loop = asyncio.get_running_loop()
                await asyncio.sleep(2.0)
                f.bus.is_connected = False
                for agent in f.agents.values():
                    agent.heartbeating = False
                await asyncio.sleep(10.0)  # far past offline, had the controller heard anyone
                assert {n.health for n in f.state.nodes.nodes.values()} == {"healthy"}
                back = loop.time()
                f.bus.is_connected = True  # type: ignore[attr-defined]
                await f.until(
                    lambda: f.state.nodes.nodes["n0"].health == "offline", within=10, why="offline"
                )
                (_, at_suspect), (_, at_offline) = health_times(f, "n0")
        cut = [e for e in logs if e["event"] == "controller_cut_off"]
        assert len(cut) == 2  # once per node, not once per look
        # The return is noticed at the next look (a quarter interval at most), and silence
        # counts from there: suspect 2 intervals later, offline 3.
        assert 2.0 <= at_suspect - back <= 2.0 + 0.25 + 1 / 64 + 1e-6, at_suspect - back
        assert 3.0 <= at_offline - back <= 3.0 + 0.25 + 1 / 64 + 1e-6, at_offline - back

    run_simulation(main())
