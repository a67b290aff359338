"""A World driven step by step (as tests/sim/test_stateful.py's machine drives it): deploy and
scale through the control API, inject a fault now and end it later, and the Checker's verdicts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from projections import FleetState
from sim import run_simulation
from sim.run import quiet_logger
from sim.scenario import Fleet, Scenario
from sim.world import World

SCENARIO = Scenario(
    name="steps",
    duration_s=1.0,
    settle_s=0.0,
    fleet=Fleet(nodes=4, gpus="RTX4090:24GiB:2"),
    rate_per_s=4.0,
)


def _ready(state: FleetState, cluster: str) -> dict[str, str]:
    """replica -> node, of the cluster's ready replicas."""
    return {
        r.replica_id: r.node_id
        for r in state.replicas.replicas.values()
        if r.cluster == cluster and r.status == "ready"
    }


def _drive(seed: int, steps: Callable[[World], Awaitable[None]]) -> World:
    world = World(SCENARIO, seed, log=quiet_logger())

    async def main() -> None:
        async with world.running():
            await asyncio.sleep(2.0)  # every agent registers
            await steps(world)

    run_simulation(main())
    return world


def test_deploy_scale_and_a_power_loss_step_by_step() -> None:
    async def steps(world: World) -> None:
        assert world.controller is not None
        live = world.controller.live
        reply = await world.create_cluster("llama", 2)
        assert reply.ok, reply.error
        traffic = world.start_traffic("llama")
        await asyncio.sleep(5.0)
        ready = _ready(live.state, "llama")
        assert len(ready) == 2 and len(set(ready.values())) == 2  # spread over two nodes

        assert (await world.scale("llama", 3)).ok
        await asyncio.sleep(5.0)
        assert len(set(_ready(live.state, "llama").values())) == 3

        victim = _ready(live.state, "llama")["llama-0"]
        end = world.fault("power_loss", victim)
        assert not world.nodes[victim].powered
        await asyncio.sleep(10.0)
        assert live.state.nodes.nodes[victim].health == "offline"
        moved = live.state.replicas.replicas["llama-0"]
        assert moved.node_id != victim and moved.epoch == 2
        assert len(_ready(live.state, "llama")) == 3

        end()
        await asyncio.sleep(10.0)
        assert world.nodes[victim].powered
        assert live.state.nodes.nodes[victim].health == "healthy"
        traffic.cancel()
        await world.checker.finish()

    world = _drive(3, steps)
    assert world.checker.violations == []
    assert world.checker.timings.detection["power_loss"]
    requests = world.requests["llama"]
    assert requests.sent > 50 and requests.ok == requests.sent - sum(requests.failed.values())
    assert [line.split(None, 1)[1] for line in world.timeline] == [
        "cluster llama created (2 replicas): True",
        "cluster llama scaled to 3: True",
        f"fault  power_loss {_victim(world)}",
        f"end    power_loss {_victim(world)}",
    ]


def _victim(world: World) -> str:
    return next(line.rsplit(" ", 1)[1] for line in world.timeline if "fault  power_loss" in line)


def test_a_fault_ended_before_anyone_could_notice_is_not_a_detection_failure() -> None:
    """World.fault's end tells the Checker how long the fault really lasted: a one-second
    power blip need not show in health, a ten-second hang must (and does)."""

    async def steps(world: World) -> None:
        end = world.fault("power_loss", "node-1")
        await asyncio.sleep(1.0)
        end()
        end = world.fault("hang", "node-2")
        await asyncio.sleep(10.0)
        end()
        await asyncio.sleep(10.0)
        await world.checker.finish()

    world = _drive(4, steps)
    assert world.checker.violations == []
    assert "power_loss" not in world.checker.timings.detection
    assert len(world.checker.timings.detection["hang"]) == 1


def test_a_lasting_fault_that_never_shows_in_health_is_a_violation() -> None:
    """The detection verdict can fail: told of a ten-second hang of node-3 that never
    happened, the Checker sees node-3 healthy throughout and says so."""

    async def steps(world: World) -> None:
        world.checker.fault("hang", world.nodes["node-3"], world.now(), 10.0)
        await asyncio.sleep(12.0)
        await world.checker.finish()

    world = _drive(5, steps)
    assert [v.invariant for v in world.checker.violations] == ["detection"]


def test_a_node_fault_during_a_controller_outage_is_not_a_detection_failure() -> None:
    async def steps(world: World) -> None:
        restart = world.fault("controller_crash")
        await asyncio.sleep(1.0)
        end = world.fault("power_loss", "node-1")
        await asyncio.sleep(10.0)
        end()
        await asyncio.sleep(2.0)
        restart()
        await asyncio.sleep(20.0)
        await world.checker.finish()

    world = _drive(6, steps)
    assert world.checker.violations == []


def test_a_fault_on_a_node_already_held_offline_is_not_a_detection_failure() -> None:
    """node-1 loses power and is declared offline; the controller goes down, node-1 comes back
    and loses power again before the controller returns. The restarted controller rebuilds
    node-1 as offline, so health never changes again: the fault is in health all along."""

    async def steps(world: World) -> None:
        end = world.fault("power_loss", "node-1")
        await asyncio.sleep(10.0)
        restart = world.fault("controller_crash")
        await asyncio.sleep(1.0)
        end()
        await asyncio.sleep(2.0)
        end = world.fault("power_loss", "node-1")
        await asyncio.sleep(1.0)
        restart()
        await asyncio.sleep(10.0)
        end()
        await asyncio.sleep(20.0)
        await world.checker.finish()

    world = _drive(7, steps)
    assert world.checker.violations == []


@pytest.mark.parametrize("ticks", [0, 1, 2])
def test_a_cancelled_routing_loop_stops(ticks: int) -> None:
    """A routing change and a cancellation in the same instant (virtual time makes such
    coincidences common; in production they are rare, not impossible)."""

    async def steps(world: World) -> None:
        assert world.controller is not None
        routing = next(t for t in asyncio.all_tasks() if t.get_name() == "routing")
        for signal in world.controller.live._signals:
            signal.set()
        for _ in range(ticks):
            await asyncio.sleep(0)
        routing.cancel()
        await asyncio.sleep(5.0)
        alive = not routing.done()
        routing.cancel()  # again, so that the world can end either way
        assert not alive, "the routing loop swallowed its cancellation"

    _drive(1, steps)
