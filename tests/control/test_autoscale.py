"""The leader's autoscaler against the real controller, on virtual time: gateways' load reports
in, `cluster.scaled` events out, each with its cause and the figures it used; a request held at
zero replicas starts one at once; an idle cluster goes back to zero; a rebuild of the log
equals the live state."""

from __future__ import annotations

import asyncio

import msgspec

import projections
from events import ClusterScaled
from events.contract import subjects
from events.contract.messages import ClusterLoad, GatewayLoad, RoutingUpdate
from runtime.env import Msg
from sim import run_simulation
from tests.control.harness import Fleet, fleet

SPEC = {
    "name": "chat",
    "replicas": 0,
    "command": "gpumesh workload echo --port {port}",
    "autoscale": {
        "min": 0,
        "max": 3,
        "target_in_flight": 2,
        "up_window_s": 5,
        "down_window_s": 20,
        "scale_to_zero_after_s": 30,
        "cold_start_timeout_s": 45,
    },
}


def scaled(f: Fleet) -> list[ClusterScaled]:
    return [e.payload for e in f.store.read_all_now() if isinstance(e.payload, ClusterScaled)]


async def report(f: Fleet, gateway: str, **load: int) -> None:
    clusters = {"chat": ClusterLoad(**load)} if any(load.values()) else {}
    body = GatewayLoad(gateway_id=gateway, clusters=clusters)
    await f.bus.publish(subjects.LOAD, msgspec.json.encode(body))


async def keep_reporting(f: Fleet, loads: dict[str, dict[str, int]]) -> None:
    """Gateways reporting every second, what `loads` says now (the test changes it)."""
    while True:
        for gateway in sorted(loads):
            await report(f, gateway, **loads[gateway])
        await asyncio.sleep(1.0)


def test_a_held_request_starts_a_replica_at_once_and_idleness_returns_to_zero() -> None:
    async def main() -> None:
        async with fleet(3, seed=3) as f:
            tables: list[RoutingUpdate] = []

            def routing(msg: Msg) -> None:
                tables.append(msgspec.json.decode(msg.data, type=RoutingUpdate))

            await f.bus.subscribe(subjects.ROUTING, handler=routing)
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: bool(tables) and "chat" in tables[-1].cold_start, within=10)
            assert tables[-1].cold_start == {"chat": 45.0}

            loads: dict[str, dict[str, int]] = {"gw-a": {}, "gw-b": {}}
            reporting = asyncio.create_task(keep_reporting(f, loads))
            await asyncio.sleep(40)  # idle and at zero: nothing to decide
            assert scaled(f) == []

            loads["gw-a"] = {"held": 3}
            start = asyncio.get_running_loop().time()
            await report(f, "gw-a", held=3)  # the gateway's at-once report of a first hold
            took = await f.until(lambda: len(scaled(f)) == 1, within=5, why="a cold start")
            assert took < 0.5, took  # no tick waited for
            cold = scaled(f)[0]
            assert (cold.previous, cold.replicas) == (0, 2)
            assert "cold start" in cold.cause and cold.inputs is not None
            assert (cold.inputs.held, cold.inputs.gateways) == (3, 2)
            await f.until(lambda: len(f.ready("chat")) == 2, within=10, why="replicas ready")

            # Served: 5 in flight over both gateways wants 3, for the up window (5 s).
            loads["gw-a"], loads["gw-b"] = {"in_flight": 2}, {"in_flight": 3}
            await f.until(lambda: len(scaled(f)) == 2, within=15, why="scaled up")
            up = scaled(f)[1]
            assert (up.previous, up.replicas) == (2, 3) and up.inputs is not None
            assert up.inputs.in_flight == 5 and up.inputs.window_s >= 5

            # Idle: down to 1 after the down window, to 0 after 30 s without a request.
            loads["gw-a"] = loads["gw-b"] = {}
            idle_from = asyncio.get_running_loop().time()
            await f.until(lambda: scaled(f)[-1].replicas == 0, within=90, why="back to zero")
            assert asyncio.get_running_loop().time() - idle_from >= 30
            assert [s.replicas for s in scaled(f)] == [2, 3, 1, 0]
            assert "no request for" in scaled(f)[-1].cause
            await f.until(lambda: not f.ready("chat"), within=10, why="replicas stopped")
            assert asyncio.get_running_loop().time() - start > 0
            reporting.cancel()

            rebuilt = projections.rebuild(f.store.read_all_now())
            assert rebuilt == f.state

    run_simulation(main())


def test_a_spec_outside_its_bounds_is_brought_within_them_and_apply_keeps_the_count() -> None:
    async def main() -> None:
        async with fleet(3, seed=3) as f:
            spec = {**SPEC, "replicas": 1, "autoscale": {**SPEC["autoscale"], "min": 2}}  # type: ignore[dict-item]
            assert (await f.api("cluster.create", spec)).ok
            reporting = asyncio.create_task(keep_reporting(f, {"gw-a": {}}))
            await f.until(lambda: len(scaled(f)) == 1, within=5, why="min enforced")
            assert scaled(f)[0].replicas == 2 and "below autoscale.min" in scaled(f)[0].cause
            # A new revision with a different `replicas` keeps the autoscaler's count.
            applied = {**spec, "replicas": 1, "health_path": "/ready"}
            reply = await f.api("cluster.apply", applied)
            assert reply.ok, reply.error
            assert f.state.clusters.clusters["chat"].spec.replicas == 2
            reporting.cancel()

    run_simulation(main())
