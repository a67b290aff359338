"""A canary end to end on virtual time: the real controller publishes the split, a gateway's
RoutingFeed installs it, and its dispatcher sends the canary's share of the cluster's requests
to the canary's cluster until the canary is aborted (tests/control/test_canary.py has the
controller's side alone)."""

from __future__ import annotations

import random
from collections import Counter

import structlog

from events.contract.messages import RouteEntry
from gateway.dispatch import Dispatcher
from gateway.feed import RoutingFeed
from gateway.retry import RetryPolicy
from gateway.router import Router
from sim import SimClock, run_simulation
from tests.control.harness import fleet

SPEC = {"name": "llama", "replicas": 2, "command": "gpumesh workload echo --port {port}"}
NEW = {**SPEC, "env": {"MODEL_REV": "2"}}


def test_the_gateway_follows_the_controller_s_split() -> None:
    async def main() -> None:
        async with fleet(3, seed=11) as f:
            clock = SimClock()
            router = Router(clock, random.Random(1))
            dispatcher = Dispatcher(router, RetryPolicy(), clock, random.Random(2))
            feed = RoutingFeed(f.bus, router, dispatcher, structlog.get_logger("test"))
            following = f.tasks.create_task(feed.run())

            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(router.routes("llama")) == 2, within=15, why="routed")
            assert {dispatcher.pick_cluster("llama") for _ in range(200)} == {"llama"}

            reply = await f.api("cluster.canary", {"name": "llama", "spec": NEW, "weight": 20})
            assert reply.ok, reply.error
            await f.until(
                lambda: router.split("llama") is not None, within=15, why="the split, routable"
            )
            share = Counter(dispatcher.pick_cluster("llama") for _ in range(5000))
            assert 850 <= share["llama-canary"] <= 1150, share  # 20% of 5000, +- 4 deviations

            async def answer(route: RouteEntry, first_byte_timeout: float) -> str:
                return route.replica_id

            served = dispatcher.pick_cluster("llama-canary")
            assert served == "llama-canary"
            route, replica = await dispatcher.run(served, answer)
            assert replica.startswith("llama-canary-")
            dispatcher.finished(served, route, "ok")

            assert (await f.api("cluster.abort", {"name": "llama", "reason": "test"})).ok
            await f.until(lambda: router.split("llama") is None, within=10, why="split gone")
            assert {dispatcher.pick_cluster("llama") for _ in range(500)} == {"llama"}
            await f.until(
                lambda: not router.known("llama-canary"), within=15, why="the canary deleted"
            )
            following.cancel()

    run_simulation(main())
