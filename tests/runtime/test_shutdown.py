"""Two-phase shutdown: drain in reverse spawn order, then cancel what is left."""

from __future__ import annotations

import asyncio

import pytest
import structlog

from runtime import Actor, ActorContext, ActorRef, ActorStopped, ActorSystem, Env
from tests.two_loops import simulated


class Worker(Actor[str]):
    """Appends `name:msg` for each message and `name:stopped` in on_stop; "hang" blocks."""

    def __init__(self, log: list[str], notify: ActorRef[str] | None = None) -> None:
        self.log = log
        self.notify = notify

    async def handle(self, ctx: ActorContext[str], msg: str) -> object:
        if msg == "hang":
            await asyncio.Event().wait()
        await asyncio.sleep(0)
        self.log.append(f"{ctx.name}:{msg}")
        return None

    async def on_stop(self, ctx: ActorContext[str]) -> None:
        if self.notify is not None:
            # Actors spawned earlier stop later, so they still take messages here.
            await self.notify.tell(f"bye from {ctx.name}")
        self.log.append(f"{ctx.name}:stopped")


async def test_phase_one_drains_each_mailbox_and_stops_in_reverse_spawn_order(env: Env) -> None:
    log: list[str] = []
    async with ActorSystem(env) as system:
        first = await system.spawn(lambda: Worker(log), "first")
        second = await system.spawn(lambda: Worker(log, notify=first), "second")
        third = await system.spawn(lambda: Worker(log), "third")
        for ref in (first, second, third):
            for i in range(3):
                ref.try_tell(str(i))
        await system.shutdown(timeout=60)
        assert all(ref.stopped for ref in (first, second, third))
        assert system.names() == []
        with pytest.raises(ActorStopped):
            await first.tell("late")
    stops = [entry.split(":")[0] for entry in log if entry.endswith(":stopped")]
    assert stops == ["third", "second", "first"]
    for name in ("first", "second", "third"):
        mine = [entry for entry in log if entry.startswith(f"{name}:")]
        assert mine[:3] == [f"{name}:0", f"{name}:1", f"{name}:2"]  # drained before on_stop
        assert mine[-1] == f"{name}:stopped"
    assert log.index("first:bye from second") < log.index("first:stopped")


async def test_phase_two_cancels_a_stuck_actor_after_the_timeout(env: Env) -> None:
    log: list[str] = []
    timeout = 300.0 if simulated() else 0.05
    loop = asyncio.get_running_loop()
    with structlog.testing.capture_logs() as logs:
        async with ActorSystem(env) as system:
            # Spawned first, so stopped last: the stuck one uses up phase 1 after it.
            stuck = await system.spawn(lambda: Worker(log), "stuck")
            healthy = await system.spawn(lambda: Worker(log), "healthy")
            healthy.try_tell("work")
            stuck.try_tell("hang")
            answer = asyncio.create_task(stuck.ask("after-hang", timeout=10 * timeout))
            await asyncio.sleep(0)
            began = loop.time()
            await system.shutdown(timeout=timeout)
            took = loop.time() - began
            with pytest.raises(ActorStopped):
                await answer  # queued behind the hang: failed, not lost silently
    assert log == ["healthy:work", "healthy:stopped"]  # no on_stop for the cancelled one
    assert timeout <= took < 2 * timeout + (0 if simulated() else 1)
    forced = [e for e in logs if e["event"] == "shutdown_forced"]
    assert forced and forced[0]["actors"] == ["stuck"]
    outcomes = {e["actor"]: e["outcome"] for e in logs if e["event"] == "actor_stopped"}
    assert outcomes == {"healthy": "stopped", "stuck": "cancelled"}


async def test_leaving_the_block_shuts_down_gracefully(env: Env) -> None:
    log: list[str] = []
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Worker(log), "w")
        ref.try_tell("last words")
    assert log == ["w:last words", "w:stopped"]


async def test_an_error_in_the_body_cancels_the_actors_and_propagates_as_is(env: Env) -> None:
    log: list[str] = []
    with pytest.raises(KeyError, match="body failed"):
        async with ActorSystem(env) as system:
            ref = await system.spawn(lambda: Worker(log), "w")
            ref.try_tell("hang")
            await asyncio.sleep(0)
            raise KeyError("body failed")
    assert ref.stopped
    assert log == []


async def test_force_stop_cuts_phase_one_short(env: Env) -> None:
    log: list[str] = []
    loop = asyncio.get_running_loop()
    async with ActorSystem(env) as system:
        stuck = await system.spawn(lambda: Worker(log), "stuck")
        stuck.try_tell("hang")
        began = loop.time()
        async with asyncio.TaskGroup() as tg:
            graceful = tg.create_task(system.shutdown(timeout=3600))
            await asyncio.sleep(0)
            assert not graceful.done()
            system.force_stop()  # what a second SIGTERM does
        assert loop.time() - began < 1
    assert log == []


async def test_concurrent_shutdowns_wait_for_the_first(env: Env) -> None:
    log: list[str] = []
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Worker(log), "w")
        ref.try_tell("x")
        async with asyncio.TaskGroup() as tg:
            tg.create_task(system.shutdown())
            tg.create_task(system.shutdown())
        assert log == ["w:x", "w:stopped"]


async def test_request_shutdown_from_inside_an_actor(env: Env) -> None:
    stopped = asyncio.Event()

    class Quitter(Actor[str]):
        async def handle(self, ctx: ActorContext[str], msg: str) -> object:
            ctx.system.request_shutdown()
            return None

        async def on_stop(self, ctx: ActorContext[str]) -> None:
            stopped.set()

    async with ActorSystem(env) as system:
        quitter = await system.spawn(Quitter, "quitter")
        await quitter.tell("quit")
        await stopped.wait()
        assert quitter.stopped


async def test_ctx_stop_finishes_the_queue_then_stops(env: Env) -> None:
    log: list[str] = []
    stopped = asyncio.Event()

    class SelfStopper(Actor[str]):
        async def handle(self, ctx: ActorContext[str], msg: str) -> object:
            if msg == "stop":
                ctx.stop()
            log.append(msg)
            return None

        async def on_stop(self, ctx: ActorContext[str]) -> None:
            stopped.set()

    async with ActorSystem(env) as system:
        ref = await system.spawn(SelfStopper, "s")
        for msg in ("a", "stop", "b"):
            ref.try_tell(msg)
        await stopped.wait()
        with pytest.raises(ActorStopped):
            await ref.tell("late")
    assert log == ["a", "stop", "b"]
