"""Holding requests for a cluster that scales from zero (RoutingUpdate.cold_start), and the
load the dispatcher counts for the autoscaler (gateway/dispatch.py, gateway/load.py).

On the simulator's virtual-time loop: a two-minute cold start costs no wall time."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from events.contract.messages import RoutingUpdate
from gateway.dispatch import (
    ColdStartTimeout,
    Dispatcher,
    HoldFull,
    NoReadyReplica,
)
from gateway.load import LoadMeter
from gateway.retry import RetryPolicy
from gateway.router import Router, RouterConfig
from sim import SimClock, run_simulation
from tests.gateway.test_dispatch import Upstream, entry

COLD_S = 120.0


def table(
    position: int,
    replicas: Sequence[str] = (),
    *,
    cold: dict[str, float] | None = None,
    clusters: Sequence[str] = ("llama",),
) -> RoutingUpdate:
    return RoutingUpdate(
        position=position,
        routes={"llama": tuple(entry(r) for r in replicas)} if replicas else {},
        clusters=tuple(clusters),
        cold_start={"llama": COLD_S} if cold is None else cold,
    )


@dataclass
class Holds:
    """A HoldObserver that keeps what it was told."""

    counts: list[tuple[str, int]] = field(default_factory=list)
    at_zero: list[tuple[str, float]] = field(default_factory=list)
    cold_starts: list[tuple[str, float]] = field(default_factory=list)

    def held(self, cluster: str, count: int) -> None:
        self.counts.append((cluster, count))

    def held_at_zero(self, cluster: str) -> None:
        self.at_zero.append((cluster, asyncio.get_running_loop().time()))

    def cold_start(self, cluster: str, seconds: float) -> None:
        self.cold_starts.append((cluster, seconds))


@dataclass
class Parts:
    router: Router
    dispatcher: Dispatcher
    meter: LoadMeter
    holds: Holds
    clusters: Sequence[str]

    def serve(self, position: int, *replicas: str, cold: dict[str, float] | None = None) -> None:
        """The controller's next table."""
        assert self.router.apply(table(position, replicas, cold=cold, clusters=self.clusters))
        self.dispatcher.notify()

    def load(self, cluster: str = "llama") -> tuple[int, int]:
        """(in flight, held) as the next report would say."""
        seen = self.meter.report("gw").clusters.get(cluster)
        return (seen.in_flight, seen.held) if seen else (0, 0)


def build(
    policy: RetryPolicy | None = None,
    *,
    replicas: Sequence[str] = (),
    cold: dict[str, float] | None = None,
    max_held: int = 256,
    clusters: Sequence[str] = ("llama",),
) -> Parts:
    clock = SimClock()
    router = Router(clock, random.Random(1), RouterConfig(eject_jitter=0.0))
    router.apply(table(1, replicas, cold=cold, clusters=clusters))
    meter = LoadMeter(clock)
    holds = Holds()
    dispatcher = Dispatcher(
        router,
        policy or RetryPolicy(queue_timeout_s=5.0),
        clock,
        random.Random(2),
        meter=meter,
        holds=holds,
        max_held=max_held,
    )
    return Parts(router, dispatcher, meter, holds, clusters)


def now() -> float:
    return asyncio.get_running_loop().time()


def test_a_cold_start_holds_the_request_past_the_queue_timeout_until_a_replica_is_ready() -> None:
    async def scenario() -> None:
        parts = build()
        request = asyncio.create_task(parts.dispatcher.run("llama", Upstream()))
        await asyncio.sleep(30.0)  # six queue timeouts
        assert not request.done()
        assert parts.dispatcher.held("llama") == 1
        assert parts.load() == (0, 1)
        parts.serve(2, "llama-0")
        route, _ = await request
        assert now() == 30.0
        assert parts.dispatcher.held("llama") == 0
        assert parts.load() == (1, 0)  # in flight until the caller says the answer ended
        parts.dispatcher.finished("llama", route, "ok")
        assert parts.load() == (0, 0)
        assert parts.holds.counts == [("llama", 1), ("llama", 0)]
        assert parts.holds.at_zero == [("llama", 0.0)]  # the autoscaler's signal, at arrival
        assert parts.holds.cold_starts == [("llama", 30.0)]

    run_simulation(scenario())


def test_a_cold_start_gives_up_after_its_own_time_not_the_queue_timeout() -> None:
    async def scenario() -> tuple[float, ColdStartTimeout, Parts]:
        # Shorter than the hold on purpose: the deadline does not run while held.
        parts = build(RetryPolicy(queue_timeout_s=5.0, deadline_s=15.0))
        with pytest.raises(ColdStartTimeout) as caught:
            await parts.dispatcher.run("llama", Upstream())
        return now(), caught.value, parts

    ended, error, parts = run_simulation(scenario())
    assert ended == COLD_S
    assert (error.status, error.code, error.cluster, error.limit_s) == (
        503,
        "cold_start_timeout",
        "llama",
        COLD_S,
    )
    assert error.message == (
        "no replica of cluster 'llama' became ready within 120 s (autoscale.cold_start_timeout_s)"
    )
    assert 1.0 <= error.retry_after_s <= 5.0
    assert parts.dispatcher.held("llama") == 0
    assert parts.meter.held("llama") == 0
    assert parts.holds.cold_starts == []


def test_the_time_held_does_not_count_against_the_request_timeout() -> None:
    policy = RetryPolicy(queue_timeout_s=5.0, deadline_s=15.0, first_byte_timeout_s=10.0)

    async def scenario() -> Upstream:
        parts = build(policy)
        upstream = Upstream()
        request = asyncio.create_task(parts.dispatcher.run("llama", upstream))
        await asyncio.sleep(60.0)  # four request timeouts
        parts.serve(2, "llama-0")
        await request
        return upstream

    upstream = run_simulation(scenario())
    # A whole first-byte timeout: the deadline counts from the end of the hold.
    assert [(rid, timeout) for rid, timeout, _ in upstream.calls] == [("llama-0", 10.0)]


def test_held_requests_are_bounded_per_cluster_and_the_next_is_refused_at_once() -> None:
    async def scenario() -> None:
        parts = build(
            max_held=3,
            cold={"llama": COLD_S, "qwen": COLD_S},
            clusters=("llama", "qwen"),
        )
        held = [asyncio.create_task(parts.dispatcher.run("llama", Upstream())) for _ in range(3)]
        await asyncio.sleep(1.0)
        with pytest.raises(HoldFull) as caught:
            await parts.dispatcher.run("llama", Upstream())
        assert now() == 1.0  # at once
        error = caught.value
        assert (error.status, error.code, error.max_held) == (503, "hold_full", 3)
        assert error.message == (
            "cluster 'llama' is starting from zero replicas and already holds 3 requests "
            "(gateway --max-held)"
        )
        assert 1.0 <= error.retry_after_s <= 5.0
        # Per cluster: another cluster's cold start has room of its own.
        other = asyncio.create_task(parts.dispatcher.run("qwen", Upstream()))
        await asyncio.sleep(1.0)
        assert not other.done() and parts.dispatcher.held("qwen") == 1
        assert parts.dispatcher.held("llama") == 3
        assert parts.load() == (0, 3)  # the refused one arrived, and was never held
        parts.serve(2, "llama-0", cold={"llama": COLD_S, "qwen": COLD_S})
        for task in held:
            route, _ = await task
            parts.dispatcher.finished("llama", route, "ok")
        assert parts.dispatcher.held("llama") == 0
        other.cancel()
        with pytest.raises(asyncio.CancelledError):
            await other
        assert parts.dispatcher.held("qwen") == 0
        assert parts.meter.held("qwen") == 0

    run_simulation(scenario())


def test_without_cold_start_the_queue_timeout_holds_and_nothing_is_bounded() -> None:
    async def scenario() -> float:
        parts = build(max_held=1, cold={})
        tasks = [asyncio.create_task(parts.dispatcher.run("llama", Upstream())) for _ in range(3)]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(type(r) is NoReadyReplica for r in results)
        assert parts.holds.cold_starts == []
        assert [c for _, c in parts.holds.counts] == [1, 2, 3, 2, 1, 0]
        return now()

    assert run_simulation(scenario()) == 5.0


def test_a_cold_start_that_is_called_off_goes_back_to_the_queue_timeout() -> None:
    async def scenario() -> tuple[float, NoReadyReplica]:
        parts = build()

        async def controller() -> None:
            await asyncio.sleep(30.0)
            parts.serve(2, cold={})  # the [autoscale] section was removed

        helper = asyncio.create_task(controller())
        with pytest.raises(NoReadyReplica) as caught:
            await parts.dispatcher.run("llama", Upstream())
        await helper
        return now(), caught.value

    ended, error = run_simulation(scenario())
    # The queue timeout counts from the end of the hold, as the deadline does.
    assert ended == 35.0
    assert type(error) is NoReadyReplica


def test_a_request_waiting_after_its_replica_died_counts_as_held_not_in_flight() -> None:
    async def scenario() -> None:
        parts = build(replicas=("llama-0",), cold={})
        request = asyncio.create_task(parts.dispatcher.run("llama", Upstream(["connect"])))
        await asyncio.sleep(1.0)  # waits for a replacement of the one that refused
        assert not request.done()
        assert parts.load() == (0, 1)  # once: the autoscaler adds the two up
        assert parts.holds.at_zero == []  # the cluster has a route: no cold start
        parts.router.apply(
            RoutingUpdate(
                position=2, routes={"llama": (entry("llama-0", epoch=2),)}, clusters=("llama",)
            )
        )
        parts.dispatcher.notify()
        route, _ = await request
        assert route.epoch == 2
        assert parts.load() == (1, 0)

    run_simulation(scenario())


@pytest.mark.parametrize("where", ["held", "in_flight"])
def test_a_request_cancelled_anywhere_leaves_no_load_behind(where: str) -> None:
    async def scenario() -> None:
        parts = build(replicas=("llama-0",) if where == "in_flight" else ())
        script = ["hang"] if where == "in_flight" else []
        request = asyncio.create_task(parts.dispatcher.run("llama", Upstream(script)))
        await asyncio.sleep(1.0)
        assert parts.load() == ((1, 0) if where == "in_flight" else (0, 1))
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        assert parts.load() == (0, 0)
        assert parts.dispatcher.held("llama") == 0

    run_simulation(scenario())


def test_an_answer_counts_its_time_to_first_byte_from_arrival() -> None:
    async def scenario() -> float:
        parts = build(replicas=("llama-0", "llama-1"), cold={})
        route, _ = await parts.dispatcher.run("llama", Upstream(["connect"]))
        parts.dispatcher.finished("llama", route, "ok")
        return parts.meter.report("gw").clusters["llama"].ttft_p50_ms

    ttft_ms = run_simulation(scenario())
    # The back-off between the two attempts: the first failed, the second answered at once.
    assert 0 < ttft_ms <= RetryPolicy().backoff_max_s * 1000


def test_a_table_that_changes_only_its_cold_start_wakes_the_held() -> None:
    async def scenario() -> tuple[float, str]:
        parts = build(cold={})
        request = asyncio.create_task(parts.dispatcher.run("llama", Upstream()))
        await asyncio.sleep(1.0)
        parts.serve(2, cold={"llama": 30.0})  # the router calls a cold_start alone a change
        assert parts.router.cold_start("llama") == 30.0
        await asyncio.sleep(20.0)  # past the queue timeout: held for the cold start now
        assert not request.done()
        parts.serve(3, "llama-0", cold={"llama": 30.0})
        route, _ = await request
        return now(), route.replica_id

    assert run_simulation(scenario()) == (21.0, "llama-0")


def test_the_router_keeps_cold_start_only_for_known_clusters() -> None:
    router = Router(SimClock(), random.Random(1))
    assert router.apply(table(1, cold={"llama": 60.0, "gone": 60.0}))
    assert router.cold_start("llama") == 60.0
    assert router.cold_start("gone") is None
    assert not router.apply(table(2, cold={"llama": 60.0}))  # the same table, re-sent
    assert router.apply(table(3, cold={}))
    assert router.cold_start("llama") is None


def test_max_held_must_allow_one() -> None:
    router = Router(SimClock(), random.Random(1))
    with pytest.raises(ValueError, match="max_held"):
        Dispatcher(router, RetryPolicy(), SimClock(), random.Random(2), max_held=0)
