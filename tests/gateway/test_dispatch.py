"""The retry loop, on a real asyncio loop and on the simulator's virtual-time loop."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import pytest

from events.contract.messages import RouteEntry, RoutingUpdate
from gateway.dispatch import AttemptsExhausted, Dispatcher, NoReadyReplica, UnknownCluster
from gateway.retry import RetryPolicy
from gateway.router import Ejection, ReplicaStats, Router, RouterConfig
from gateway.transport.base import (
    ConnectFailed,
    FirstByteTimeout,
    ResetBeforeHead,
    StreamBroken,
    UpstreamError,
    UpstreamStatus,
)
from runtime.env import Clock
from runtime.real_env import LoopClock
from sim import SimClock, run_simulation

FAILURES: dict[str, type[UpstreamError]] = {
    "connect": ConnectFailed,
    "reset": ResetBeforeHead,
    "broken": StreamBroken,
    "fbt": FirstByteTimeout,
}


def entry(replica_id: str, epoch: int = 1) -> RouteEntry:
    return RouteEntry(replica_id=replica_id, node_id=f"node-{replica_id}", address="x", epoch=epoch)


def table(position: int, cluster: str = "llama", replicas: Sequence[str] = ()) -> RoutingUpdate:
    return RoutingUpdate(
        position=position,
        routes={cluster: tuple(entry(r) for r in replicas)} if replicas else {},
        clusters=(cluster,),
    )


@dataclass
class Upstream:
    """Scripted replicas: the n-th attempt overall does script[n] ("ok" once it runs out).

    "hang" ignores the timeout it is given, like a transport with a bug; the dispatcher's own
    guard must still end it.
    """

    script: list[str] = field(default_factory=list)
    calls: list[tuple[str, float, float]] = field(default_factory=list)  # replica, timeout, t

    async def __call__(self, route: RouteEntry, first_byte_timeout: float) -> str:
        loop_time = asyncio.get_running_loop().time()
        self.calls.append((route.replica_id, first_byte_timeout, loop_time))
        what = self.script.pop(0) if self.script else "ok"
        if what == "ok":
            return f"head from {route.replica_id}"
        if what == "hang":
            await asyncio.Event().wait()
        if what == "5xx":
            raise UpstreamStatus(route.replica_id, 503)
        if what == "bug":
            raise KeyError("a bug in the attempt")
        raise FAILURES[what](route.replica_id, "scripted")

    @property
    def replicas(self) -> list[str]:
        return [rid for rid, _, _ in self.calls]


def build(
    clock: Clock,
    replicas: Sequence[str] = ("llama-0", "llama-1", "llama-2"),
    *,
    policy: RetryPolicy | None = None,
    config: RouterConfig | None = None,
    seed: int = 1,
) -> tuple[Router, Dispatcher, list[Ejection]]:
    router = Router(clock, random.Random(seed), config or RouterConfig(eject_jitter=0.0))
    router.apply(table(1, replicas=replicas))
    ejections: list[Ejection] = []
    dispatcher = Dispatcher(
        router, policy or RetryPolicy(), clock, random.Random(seed + 1), ejections.append
    )
    return router, dispatcher, ejections


def stats(router: Router) -> dict[str, ReplicaStats]:
    return {e.replica_id: s for e, s in router.stats()}


# --- on a real asyncio loop -------------------------------------------------------------


async def test_success_returns_the_route_and_leaves_the_request_outstanding() -> None:
    router, dispatcher, _ = build(LoopClock())
    upstream = Upstream()
    route, head = await dispatcher.run("llama", upstream)
    assert head == f"head from {route.replica_id}"
    assert stats(router)[route.replica_id].outstanding == 1  # the body is still to come
    router.finished(route, "ok")
    assert stats(router)[route.replica_id].outstanding == 0
    assert upstream.calls[0][1] == RetryPolicy().first_byte_timeout_s


@pytest.mark.parametrize("seed", range(8))
async def test_retries_on_another_replica_after_connect_error(seed: int) -> None:
    router, dispatcher, ejections = build(LoopClock(), ("llama-0", "llama-1"), seed=seed)
    upstream = Upstream(["connect"])
    route, _ = await dispatcher.run("llama", upstream)
    first, second = upstream.replicas
    assert first != second == route.replica_id
    s = stats(router)
    assert (s[first].outstanding, s[first].failures, s[first].consecutive_failures) == (0, 1, 1)
    assert s[second].outstanding == 1
    assert ejections == []


async def test_5xx_and_reset_are_retried_until_attempts_run_out() -> None:
    router, dispatcher, _ = build(LoopClock(), ("llama-0", "llama-1"))
    upstream = Upstream(["5xx", "reset", "5xx", "ok"])
    with pytest.raises(AttemptsExhausted) as caught:
        await dispatcher.run("llama", upstream)
    assert caught.value.attempts == 3
    assert isinstance(caught.value.last, UpstreamStatus)
    assert caught.value.last.outcome == "status_5xx"
    # Both replicas before either a second time: all tried, so a retry may reuse one.
    assert len(set(upstream.replicas[:2])) == 2
    assert len(upstream.replicas) == 3
    assert all(s.outstanding == 0 for s in stats(router).values())


async def test_stream_broken_is_not_retried() -> None:
    router, dispatcher, _ = build(LoopClock())
    upstream = Upstream(["broken"])
    with pytest.raises(AttemptsExhausted) as caught:
        await dispatcher.run("llama", upstream)
    assert caught.value.attempts == 1
    assert isinstance(caught.value.last, StreamBroken)
    assert len(upstream.calls) == 1
    assert stats(router)[upstream.replicas[0]].failures == 1


@pytest.mark.parametrize("failure", ["5xx", "reset", "fbt"])
async def test_a_request_not_safe_to_repeat_is_not_retried_once_it_may_have_arrived(
    failure: str,
) -> None:
    router, dispatcher, _ = build(LoopClock(), policy=RetryPolicy(first_byte_timeout_s=0.05))
    upstream = Upstream([failure if failure != "fbt" else "hang"])
    with pytest.raises(AttemptsExhausted) as caught:
        await dispatcher.run("llama", upstream, repeatable=False)
    assert caught.value.attempts == 1 and len(upstream.calls) == 1
    assert stats(router)[upstream.replicas[0]].failures == 1  # still counted against it


async def test_a_request_not_safe_to_repeat_is_retried_when_it_surely_never_arrived() -> None:
    _, dispatcher, _ = build(LoopClock(), ("llama-0", "llama-1"))
    upstream = Upstream(["connect"])
    route, _ = await dispatcher.run("llama", upstream, repeatable=False)
    first, second = upstream.replicas
    assert first != second == route.replica_id


async def test_unknown_cluster_fails_at_once() -> None:
    _, dispatcher, _ = build(LoopClock())
    upstream = Upstream()
    with pytest.raises(UnknownCluster, match="unknown cluster mistral"):
        await dispatcher.run("mistral", upstream)
    assert upstream.calls == []


async def test_an_ejection_is_reported() -> None:
    router, dispatcher, ejections = build(
        LoopClock(), ("llama-0", "llama-1"), config=RouterConfig(eject_after=1, eject_jitter=0)
    )
    upstream = Upstream(["connect"])
    await dispatcher.run("llama", upstream)
    (ejection,) = ejections
    assert (ejection.replica_id, ejection.reason, ejection.duration_s) == (
        upstream.replicas[0],
        "connect_error",
        5.0,
    )
    assert router.is_ejected(upstream.replicas[0])


async def test_waits_for_notify_then_succeeds() -> None:
    router, dispatcher, _ = build(LoopClock(), ())
    upstream = Upstream()
    task = asyncio.create_task(dispatcher.run("llama", upstream))
    await asyncio.sleep(0.01)
    assert not task.done()
    assert router.apply(table(2, replicas=["llama-5"]))
    dispatcher.notify()
    route, _ = await asyncio.wait_for(task, 1.0)
    assert route.replica_id == "llama-5"


async def test_cancellation_marks_the_attempt_cancelled() -> None:
    router, dispatcher, _ = build(LoopClock(), ("llama-0",))
    upstream = Upstream(["hang"])
    task = asyncio.create_task(dispatcher.run("llama", upstream))
    await asyncio.sleep(0.01)
    assert upstream.calls
    assert stats(router)["llama-0"].outstanding == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert stats(router)["llama-0"] == ReplicaStats(requests=1)  # not a failure, not pending


async def test_a_bug_in_the_attempt_propagates_without_blaming_the_replica() -> None:
    router, dispatcher, _ = build(LoopClock(), ("llama-0",))
    with pytest.raises(KeyError):
        await dispatcher.run("llama", Upstream(["bug"]))
    assert stats(router)["llama-0"] == ReplicaStats(requests=1)


# --- on the simulator's virtual-time loop -----------------------------------------------


def test_no_ready_replica_after_queue_timeout_in_virtual_time() -> None:
    async def scenario() -> tuple[float, NoReadyReplica]:
        _, dispatcher, _ = build(SimClock(), (), policy=RetryPolicy(queue_timeout_s=10.0))
        with pytest.raises(NoReadyReplica) as caught:
            await dispatcher.run("llama", Upstream())
        return asyncio.get_running_loop().time(), caught.value

    began = time.perf_counter()
    ended, error = run_simulation(scenario())
    assert time.perf_counter() - began < 1.0
    assert ended == pytest.approx(10.0)
    assert 1.0 <= error.retry_after_s <= 5.0
    assert "no ready replica" in str(error)


def test_waits_in_virtual_time_until_a_replica_is_ready() -> None:
    async def scenario() -> tuple[float, str]:
        router, dispatcher, _ = build(SimClock(), ())

        async def controller() -> None:
            await asyncio.sleep(3.0)
            router.apply(table(2, replicas=["llama-0"]))
            dispatcher.notify()

        helper = asyncio.create_task(controller())
        route, _ = await dispatcher.run("llama", Upstream())
        await helper
        return asyncio.get_running_loop().time(), route.replica_id

    assert run_simulation(scenario()) == (3.0, "llama-0")


def test_an_unrelated_notify_does_not_end_the_wait() -> None:
    async def scenario() -> float:
        router, dispatcher, _ = build(SimClock(), (), policy=RetryPolicy(queue_timeout_s=4.0))

        async def controller() -> None:
            await asyncio.sleep(1.0)
            router.apply(table(2, replicas=()))  # the same empty table
            dispatcher.notify()

        helper = asyncio.create_task(controller())
        with pytest.raises(NoReadyReplica):
            await dispatcher.run("llama", Upstream())
        await helper
        return asyncio.get_running_loop().time()

    assert run_simulation(scenario()) == pytest.approx(4.0)


def test_a_cluster_deleted_while_waiting_is_unknown() -> None:
    async def scenario() -> float:
        router, dispatcher, _ = build(SimClock(), ())

        async def controller() -> None:
            await asyncio.sleep(2.0)
            router.apply(RoutingUpdate(position=2))
            dispatcher.notify()

        helper = asyncio.create_task(controller())
        with pytest.raises(UnknownCluster):
            await dispatcher.run("llama", Upstream())
        await helper
        return asyncio.get_running_loop().time()

    assert run_simulation(scenario()) == 2.0


def test_the_deadline_holds_against_a_transport_that_hangs() -> None:
    policy = RetryPolicy(max_attempts=10, deadline_s=5.0, first_byte_timeout_s=2.0)

    async def scenario() -> tuple[float, AttemptsExhausted, Upstream]:
        _, dispatcher, _ = build(SimClock(), policy=policy)
        upstream = Upstream(["hang"] * 10)
        with pytest.raises(AttemptsExhausted) as caught:
            await dispatcher.run("llama", upstream)
        return asyncio.get_running_loop().time(), caught.value, upstream

    ended, error, upstream = run_simulation(scenario())
    assert ended <= 5.0
    assert isinstance(error.last, FirstByteTimeout)
    assert error.attempts == len(upstream.calls) == 3
    timeouts = [t for _, t, _ in upstream.calls]
    assert timeouts[:2] == [2.0, 2.0]
    assert 0 < timeouts[2] < 1.0  # what was left of the deadline after two tries and backoffs
    for _, timeout, started in upstream.calls:
        assert started + timeout <= 5.0 + 1e-9
    # Backoff between attempts: positive and within the policy's bound.
    gaps = [b[2] - (a[2] + a[1]) for a, b in zip(upstream.calls, upstream.calls[1:], strict=False)]
    assert all(0 < g <= policy.backoff_max_s for g in gaps)


def test_no_retry_once_the_deadline_leaves_no_room() -> None:
    policy = RetryPolicy(deadline_s=3.0, first_byte_timeout_s=30.0)

    async def scenario() -> tuple[float, AttemptsExhausted]:
        _, dispatcher, _ = build(SimClock(), policy=policy)
        with pytest.raises(AttemptsExhausted) as caught:
            await dispatcher.run("llama", Upstream(["hang"]))
        return asyncio.get_running_loop().time(), caught.value

    ended, error = run_simulation(scenario())
    assert ended == pytest.approx(3.0)
    assert error.attempts == 1
    assert error.last.outcome == "first_byte_timeout"


def test_the_same_seed_replays_the_same_request_history() -> None:
    async def scenario() -> list[tuple[str, float, float]]:
        router, dispatcher, _ = build(SimClock(), [f"llama-{i}" for i in range(6)], seed=9)
        upstream = Upstream(["connect", "5xx", "ok", "reset"] * 5)
        for _ in range(10):
            try:
                route, _ = await dispatcher.run("llama", upstream)
                router.finished(route, "ok")
            except AttemptsExhausted:
                pass
        return upstream.calls

    first = run_simulation(scenario())
    assert run_simulation(scenario()) == first
    assert len({rid for rid, _, _ in first}) > 2


async def test_a_key_with_affinity_on_keeps_going_to_one_replica() -> None:
    config = RouterConfig(affinity="prefix", eject_jitter=0.0)
    router, dispatcher, _ = build(LoopClock(), [f"llama-{i}" for i in range(5)], config=config)
    chosen = set()
    for _ in range(10):
        route, _ = await dispatcher.run("llama", Upstream(), key="system-prompt-1")
        router.finished(route, "ok")
        chosen.add(route.replica_id)
    assert len(chosen) == 1


def test_when_every_replica_refuses_it_waits_for_the_replacement_not_a_retry_storm() -> None:
    """Found by the simulator (churn-storm): both replicas' nodes died; the request used to
    spend its three attempts on them within milliseconds and fail, while the controller was
    a second from routing their replacements (same ids, new epochs)."""

    async def scenario() -> tuple[float, list[str], int]:
        router, dispatcher, _ = build(SimClock(), ("llama-0", "llama-1"))
        upstream = Upstream(script=["connect", "connect"])

        async def controller() -> None:
            await asyncio.sleep(2.5)
            replaced = RoutingUpdate(
                position=2,
                routes={"llama": (entry("llama-0", epoch=2), entry("llama-1", epoch=2))},
                clusters=("llama",),
            )
            router.apply(replaced)
            dispatcher.notify()

        helper = asyncio.create_task(controller())
        route, _ = await dispatcher.run("llama", upstream)
        await helper
        return asyncio.get_running_loop().time(), upstream.replicas, route.epoch

    now, tried, epoch = run_simulation(scenario())
    assert sorted(tried[:2]) == ["llama-0", "llama-1"] and len(tried) == 3
    assert epoch == 2 and 2.5 <= now < 3.0


def test_a_replica_that_answered_5xx_is_tried_again_without_waiting() -> None:
    async def scenario() -> float:
        _, dispatcher, _ = build(SimClock(), ("llama-0",))
        await dispatcher.run("llama", Upstream(script=["5xx"]))
        return asyncio.get_running_loop().time()

    assert run_simulation(scenario()) < 0.5  # alive, so no wait for the table to change
