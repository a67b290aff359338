"""Restarts with back-off, the mailbox surviving them, and escalation."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field, replace

import pytest
import structlog

from runtime import (
    Actor,
    ActorContext,
    ActorStopped,
    ActorSystem,
    CrashWindow,
    Env,
    SupervisionPolicy,
    SupervisorGaveUp,
)
from tests.two_loops import simulated


@dataclass
class Journal:
    instances: list[Fragile] = field(default_factory=list)  # every instance started
    seen: list[tuple[int, str]] = field(default_factory=list)  # (incarnation, message)
    cancelled: list[str] = field(default_factory=list)


class Fragile(Actor[str]):
    """Crashes on "boom" (when told), records everything else."""

    def __init__(self, journal: Journal) -> None:
        self.journal = journal

    async def on_start(self, ctx: ActorContext[str]) -> None:
        self.journal.instances.append(self)

    async def handle(self, ctx: ActorContext[str], msg: str) -> object:
        if msg == "boom":
            raise RuntimeError("GPU fell off the bus")
        if msg == "get":
            return list(self.journal.seen)
        self.journal.seen.append((ctx.incarnation, msg))
        return None


class Sleeper(Actor[str]):
    """Blocks in its handler until cancelled."""

    def __init__(self, journal: Journal, entered: asyncio.Event) -> None:
        self.journal = journal
        self.entered = entered

    async def handle(self, ctx: ActorContext[str], msg: str) -> object:
        self.entered.set()
        try:
            await asyncio.Event().wait()
        finally:
            self.journal.cancelled.append(ctx.name)
        return None


def backoff_seconds() -> float:
    """Minutes on the virtual loop (they must cost no wall time), milliseconds on the real one."""
    return 120.0 if simulated() else 0.02


async def test_a_crashed_actor_restarts_after_backoff_and_keeps_its_queued_messages(
    env: Env,
) -> None:
    journal = Journal()
    backoff = backoff_seconds()
    policy = SupervisionPolicy(backoff_initial=backoff, backoff_max=backoff, jitter=0.5)
    loop = asyncio.get_running_loop()
    wall_began = time.perf_counter()
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Fragile(journal), "fragile", policy=policy)
        began = loop.time()
        # Queued behind the crash: the restarted instance must still get them.
        for msg in ("boom", "a", "b"):
            await ref.tell(msg)
        assert await ref.ask("get", timeout=3600) == [(1, "a"), (1, "b")]
        waited = loop.time() - began
    first, second = journal.instances
    assert first is not second  # a fresh instance from the factory
    assert backoff * 0.5 <= waited
    if simulated():
        assert waited < backoff * 1.01
        assert time.perf_counter() - wall_began < 1.0  # two virtual minutes, no real wait


async def test_crash_is_logged_with_the_restart_delay(env: Env) -> None:
    journal = Journal()
    policy = SupervisionPolicy(
        backoff_initial=backoff_seconds(), backoff_max=backoff_seconds(), jitter=0.0
    )
    with structlog.testing.capture_logs() as logs:
        async with ActorSystem(env) as system:
            ref = await system.spawn(lambda: Fragile(journal), "fragile", policy=policy)
            await ref.tell("boom")
            await ref.ask("get", timeout=3600)
    crashes = [e for e in logs if e["event"] == "actor_crashed"]
    assert len(crashes) == 1
    assert crashes[0]["log_level"] == "error"
    assert crashes[0]["exc_info"] is True
    assert crashes[0]["restart_in"] == pytest.approx(backoff_seconds())
    assert crashes[0]["crashes"] == 1


async def test_backoff_grows_exponentially_with_jitter_from_the_actors_own_stream(
    env: Env,
) -> None:
    derived: list[str] = []

    def derive(component: str) -> random.Random:
        derived.append(component)
        return random.Random(component)

    recording_env = replace(env, derive_rng=derive)
    journal = Journal()
    base = backoff_seconds()
    policy = SupervisionPolicy(
        max_restarts=5, window=10 * 3600, backoff_initial=base, backoff_max=100 * base
    )
    with structlog.testing.capture_logs() as logs:
        async with ActorSystem(recording_env) as system:
            ref = await system.spawn(lambda: Fragile(journal), "fragile", policy=policy)
            for _ in range(3):
                await ref.tell("boom")
            await ref.ask("get", timeout=3600)
    delays = [e["restart_in"] for e in logs if e["event"] == "actor_crashed"]
    expected_rng = random.Random("supervisor:fragile")
    expected = [policy.backoff(n, expected_rng) for n in (1, 2, 3)]
    assert delays == pytest.approx(expected)
    assert derived == ["supervisor:fragile"]
    assert delays[0] < delays[1] < delays[2]


async def test_escalation_after_too_many_crashes_cancels_siblings(env: Env) -> None:
    journal = Journal()
    entered = asyncio.Event()
    policy = SupervisionPolicy(
        max_restarts=2,
        window=3600,
        backoff_initial=backoff_seconds(),
        backoff_max=backoff_seconds(),
        jitter=0.0,
    )
    with structlog.testing.capture_logs() as logs, pytest.raises(ExceptionGroup) as info:
        async with ActorSystem(env) as system:
            sibling = await system.spawn(lambda: Sleeper(journal, entered), "sibling")
            await sibling.tell("sleep")
            await entered.wait()
            fragile = await system.spawn(lambda: Fragile(journal), "fragile", policy=policy)
            for _ in range(3):
                await fragile.tell("boom")
            await asyncio.Event().wait()  # the failing group cancels the body too
    gave_up = info.value.subgroup(SupervisorGaveUp)
    assert gave_up is not None
    error = gave_up.exceptions[0]
    assert isinstance(error, SupervisorGaveUp)
    assert (error.name, error.crashes) == ("fragile", 3)
    assert isinstance(error.__cause__, RuntimeError)
    assert journal.cancelled == ["sibling"]
    assert len(journal.instances) == 3
    crashes = [e for e in logs if e["event"] == "actor_crashed"]
    assert [e.get("gave_up", False) for e in crashes] == [False, False, True]


@pytest.mark.asyncio(loop_factories=["sim"])
async def test_crashes_spread_beyond_the_window_never_escalate(env: Env) -> None:
    journal = Journal()
    policy = SupervisionPolicy(max_restarts=1, window=60, backoff_initial=1.0)
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Fragile(journal), "fragile", policy=policy)
        for _ in range(5):
            await ref.tell("boom")
            await ref.ask("get")  # waits out the restart
            await asyncio.sleep(120)  # two windows later the crash is forgotten
    assert len(journal.instances) == 6


async def test_a_failing_background_task_crashes_and_restarts_the_actor(env: Env) -> None:
    restarted = asyncio.Event()

    class Ticker(Actor[str]):
        async def on_start(self, ctx: ActorContext[str]) -> None:
            if ctx.incarnation == 0:
                ctx.create_task(self.fail_soon(), name="ticker")
            else:
                restarted.set()

        async def fail_soon(self) -> None:
            await asyncio.sleep(0)
            raise RuntimeError("probe died")

        async def handle(self, ctx: ActorContext[str], msg: str) -> object:
            return ctx.incarnation

    policy = SupervisionPolicy(backoff_initial=backoff_seconds(), backoff_max=backoff_seconds())
    with structlog.testing.capture_logs() as logs:
        async with ActorSystem(env) as system:
            ref = await system.spawn(Ticker, "ticker", policy=policy)
            await restarted.wait()
            assert await ref.ask("which", timeout=3600) == 1
    events = [e["event"] for e in logs]
    assert events.index("actor_task_failed") < events.index("actor_crashed")


async def test_background_tasks_are_cancelled_when_the_actor_stops(env: Env) -> None:
    ticks: list[float] = []
    cancelled = asyncio.Event()

    class Periodic(Actor[str]):
        async def on_start(self, ctx: ActorContext[str]) -> None:
            ctx.create_task(self.tick(), name="tick")

        async def tick(self) -> None:
            try:
                while True:
                    ticks.append(asyncio.get_running_loop().time())
                    await asyncio.sleep(3600)
            finally:
                cancelled.set()

        async def handle(self, ctx: ActorContext[str], msg: str) -> object:
            return None

    async with ActorSystem(env) as system:
        ref = await system.spawn(Periodic, "periodic")
        await asyncio.sleep(0)
        assert await system.stop(ref)
        await cancelled.wait()
    assert len(ticks) == 1


async def test_create_task_after_stop_is_refused(env: Env) -> None:
    saved: list[ActorContext[str]] = []

    class Saver(Actor[str]):
        async def on_start(self, ctx: ActorContext[str]) -> None:
            saved.append(ctx)

        async def handle(self, ctx: ActorContext[str], msg: str) -> object:
            return None

    async def nothing() -> None:
        return None

    async with ActorSystem(env) as system:
        await system.stop(await system.spawn(Saver, "saver"))
        with pytest.raises(ActorStopped):
            saved[0].create_task(nothing())


async def test_a_stop_during_backoff_ends_the_actor_without_restarting(env: Env) -> None:
    journal = Journal()
    policy = SupervisionPolicy(backoff_initial=3600, backoff_max=3600)
    loop = asyncio.get_running_loop()
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Fragile(journal), "fragile", policy=policy)
        await ref.tell("boom")
        pending = asyncio.create_task(ref.ask("get", timeout=7200))
        await asyncio.sleep(0)
        began = loop.time()
        await system.shutdown(timeout=10)
        assert loop.time() - began < 1  # no hour-long wait
        with pytest.raises(ActorStopped):
            await pending
    assert len(journal.instances) == 1


def test_policy_backoff_is_capped_and_jitter_only_shortens_it() -> None:
    policy = SupervisionPolicy(backoff_initial=1, backoff_max=10, backoff_factor=3, jitter=0.25)
    rng = random.Random(3)
    for crashes, cap in [(1, 1), (2, 3), (3, 9), (4, 10), (50, 10), (10_000, 10)]:
        delay = policy.backoff(crashes, rng)
        assert cap * 0.75 <= delay <= cap


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_restarts": -1},
        {"window": 0},
        {"backoff_initial": 2, "backoff_max": 1},
        {"backoff_factor": 0.5},
        {"jitter": 1.5},
    ],
)
def test_policy_rejects_nonsense(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        SupervisionPolicy(**kwargs)  # type: ignore[arg-type]


def test_crash_window_forgets_old_crashes() -> None:
    window = CrashWindow(60)
    assert [window.record(t) for t in (0, 10, 50)] == [1, 2, 3]
    assert window.record(65) == 3  # the crash at 0 fell out
    assert window.record(200) == 1
