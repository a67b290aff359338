"""The dispatcher's `settle` step: what must succeed after a head before the answer is passed
on (the proxy reads a non-streaming body whole), inside the one retry loop."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from events.contract.messages import RouteEntry
from gateway.dispatch import AttemptsExhausted, DispatchError
from gateway.retry import RetryPolicy
from gateway.router import RouterConfig
from gateway.transport.base import BrokenWhileHeld, StreamBroken
from runtime.real_env import LoopClock
from sim import SimClock, run_simulation
from tests.gateway.test_dispatch import Upstream, build, stats


class Refused(DispatchError):
    outcome = "first_byte_timeout"

    def __init__(self) -> None:
        super().__init__(504, "timeout", "too slow")


def held(script: list[str]) -> tuple[list[str], Callable[[RouteEntry, str], Awaitable[None]]]:
    """A settle step doing, per answer, what `script` says: "ok", "broken" (a held-back body
    that broke), "late" (a body past its own timeout), or "slow" (5 s, then ok)."""
    settled: list[str] = []

    async def settle(route: RouteEntry, head: str) -> None:
        settled.append(route.replica_id)
        what = script.pop(0) if script else "ok"
        if what == "broken":
            raise BrokenWhileHeld(route.replica_id, "cut")
        if what == "late":
            raise Refused()
        if what == "slow":
            await asyncio.sleep(5.0)

    return settled, settle


async def test_a_body_that_broke_while_held_is_retried_on_another_replica() -> None:
    router, dispatcher, _ = build(LoopClock(), ("llama-0", "llama-1"))
    settled, settle = held(["broken"])
    upstream = Upstream()
    route, _ = await dispatcher.run("llama", upstream, settle=settle)
    first, second = settled
    assert first != second == route.replica_id
    s = stats(router)
    assert (s[first].failures, s[first].outstanding) == (1, 0)  # counted against it
    assert s[second].outstanding == 1  # the caller finishes the one that answered


async def test_held_bodies_share_the_attempts_of_the_one_loop() -> None:
    _, dispatcher, _ = build(LoopClock(), ("llama-0", "llama-1", "llama-2"))
    settled, settle = held(["broken"] * 5)
    with pytest.raises(AttemptsExhausted) as caught:
        await dispatcher.run("llama", Upstream(), settle=settle)
    assert caught.value.attempts == len(settled) == 3
    assert len(set(settled)) == 3  # each on a replica not tried yet
    assert isinstance(caught.value.last, BrokenWhileHeld)
    assert (caught.value.status, caught.value.code) == (502, "reset")


async def test_a_request_not_safe_to_repeat_is_not_read_again_elsewhere() -> None:
    _, dispatcher, _ = build(LoopClock(), ("llama-0", "llama-1"))
    settled, settle = held(["broken"])
    with pytest.raises(AttemptsExhausted) as caught:
        await dispatcher.run(
            "llama",
            Upstream(),
            repeatable=False,
            settle=settle,
        )
    assert len(settled) == 1 and caught.value.not_repeated


async def test_a_refusal_from_settle_ends_the_request_counted_as_it_says() -> None:
    router, dispatcher, ejections = build(
        LoopClock(), ("llama-0", "llama-1"), config=RouterConfig(eject_after=1, eject_jitter=0)
    )
    settled, settle = held(["late"])
    with pytest.raises(Refused):
        await dispatcher.run("llama", Upstream(), settle=settle)
    (replica,) = settled
    assert stats(router)[replica].failures == 1 and stats(router)[replica].outstanding == 0
    assert [(e.replica_id, e.reason) for e in ejections] == [(replica, "first_byte_timeout")]


def test_settle_is_not_bound_by_the_first_byte_timeout() -> None:
    policy = RetryPolicy(first_byte_timeout_s=1.0)

    async def scenario() -> float:
        _, dispatcher, _ = build(SimClock(), policy=policy)
        _, settle = held(["slow"])
        await dispatcher.run("llama", Upstream(), settle=settle)
        return asyncio.get_running_loop().time()

    assert run_simulation(scenario()) == pytest.approx(5.0)


def test_only_a_held_body_that_broke_is_retried_after_the_head() -> None:
    policy = RetryPolicy()
    assert policy.retryable(BrokenWhileHeld("r", "cut"))
    assert not policy.retryable(BrokenWhileHeld("r", "cut"), repeatable=False)
    assert not policy.retryable(StreamBroken("r", "cut"))  # the client already had bytes
    assert BrokenWhileHeld("r", "cut").outcome == "stream_broken"  # how the replica is counted
