"""spawn, tell, ask: readiness, ordering, replies, errors and timeouts."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import pytest

from runtime import (
    Actor,
    ActorContext,
    ActorStopped,
    ActorSystem,
    AskTimeout,
    DuplicateActor,
    Env,
    MailboxFull,
    SystemNotRunning,
)
from tests.two_loops import simulated


@dataclass
class Probe:
    """Shared between the test and every incarnation of an actor."""

    started: list[int] = field(default_factory=list)
    handled: list[object] = field(default_factory=list)
    stopped: list[int] = field(default_factory=list)
    release: asyncio.Event = field(default_factory=asyncio.Event)


class Recorder(Actor[object]):
    """Records messages; answers "get" with what it saw; fails on demand."""

    def __init__(self, probe: Probe) -> None:
        self.probe = probe

    async def on_start(self, ctx: ActorContext[object]) -> None:
        for _ in range(3):  # spawn must wait for all of on_start, suspensions included
            await asyncio.sleep(0)
        self.probe.started.append(ctx.incarnation)

    async def handle(self, ctx: ActorContext[object], msg: object) -> object:
        match msg:
            case "get":
                return list(self.probe.handled)
            case "fail":
                raise ValueError("handler refused")
            case "block":
                await self.probe.release.wait()
                return "released"
            case int(n):
                return n * 2
        self.probe.handled.append(msg)
        return None

    async def on_stop(self, ctx: ActorContext[object]) -> None:
        self.probe.stopped.append(ctx.incarnation)


class FailsToStart(Actor[object]):
    async def on_start(self, ctx: ActorContext[object]) -> None:
        await asyncio.sleep(0)
        raise RuntimeError("no GPU found")

    async def handle(self, ctx: ActorContext[object], msg: object) -> object:
        raise AssertionError("never started, never handles")


async def test_spawn_returns_only_once_on_start_has_completed(env: Env) -> None:
    probe = Probe()
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Recorder(probe), "rec")
        assert probe.started == [0]
        assert ref.name == "rec"
        assert system.names() == ["rec"]
        assert system.get("rec") is ref


async def test_spawn_raises_the_on_start_error_and_frees_the_name(env: Env) -> None:
    probe = Probe()
    async with ActorSystem(env) as system:
        with pytest.raises(RuntimeError, match="no GPU found"):
            await system.spawn(FailsToStart, "gpu")
        await asyncio.sleep(0)  # let the failed actor's teardown run
        assert system.get("gpu") is None
        ref = await system.spawn(lambda: Recorder(probe), "gpu")  # the name is free again
        assert await ref.ask(21) == 42


async def test_tell_delivers_in_order_and_ask_returns_the_result(env: Env) -> None:
    probe = Probe()
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Recorder(probe), "rec")
        for word in ("a", "b", "c"):
            await ref.tell(word)
        assert await ref.ask("get") == ["a", "b", "c"]
        assert await ref.ask(5, expect=int) == 10
    assert probe.stopped == [0]


async def test_ask_raises_the_handler_error_and_the_actor_lives_on(env: Env) -> None:
    probe = Probe()
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Recorder(probe), "rec")
        with pytest.raises(ValueError, match="handler refused"):
            await ref.ask("fail")
        assert await ref.ask(1) == 2
    assert probe.started == [0]  # no restart happened


async def test_ask_times_out_with_ask_timeout(env: Env) -> None:
    probe = Probe()
    timeout = 30.0 if simulated() else 0.05
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Recorder(probe), "rec")
        loop = asyncio.get_running_loop()
        began = loop.time()
        with pytest.raises(AskTimeout) as info:
            await ref.ask("block", timeout=timeout)
        assert isinstance(info.value, TimeoutError)
        assert (info.value.name, info.value.timeout) == ("rec", timeout)
        assert loop.time() - began >= timeout
        probe.release.set()
        assert await ref.ask(2) == 4  # the late reply to the timed-out ask went nowhere


async def test_ask_expect_checks_the_reply_type(env: Env) -> None:
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Recorder(Probe()), "rec")
        with pytest.raises(TypeError, match="answered int, expected str"):
            await ref.ask(1, expect=str)


async def test_a_stopped_actor_refuses_tell_and_ask(env: Env) -> None:
    probe = Probe()
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Recorder(probe), "rec")
        assert await system.stop(ref)
        assert ref.stopped
        with pytest.raises(ActorStopped):
            await ref.ask("get")
        with pytest.raises(ActorStopped):
            await ref.tell("x")
        with pytest.raises(ActorStopped):
            ref.try_tell("x")
    assert probe.stopped == [0]


async def test_try_tell_raises_mailbox_full_and_tell_waits_for_space(env: Env) -> None:
    probe = Probe()
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Recorder(probe), "rec", mailbox_size=2)
        ref.try_tell("block")  # occupies the handler...
        await asyncio.sleep(0)
        ref.try_tell("a")  # ...so these fill the mailbox
        ref.try_tell("b")
        with pytest.raises(MailboxFull):
            ref.try_tell("c")
        late = asyncio.create_task(ref.tell("c"))
        await asyncio.sleep(0)
        assert not late.done()
        assert ref.stats().waiting_senders == 1
        probe.release.set()
        await late
        assert await ref.ask("get") == ["a", "b", "c"]
        assert ref.stats().peak == 2


async def test_a_pending_ask_fails_with_actor_stopped_when_the_actor_is_cancelled(
    env: Env,
) -> None:
    probe = Probe()
    async with ActorSystem(env) as system:
        ref = await system.spawn(lambda: Recorder(probe), "rec")
        in_flight = asyncio.create_task(ref.ask("block", timeout=3600))
        queued = asyncio.create_task(ref.ask("get", timeout=3600))
        await asyncio.sleep(0)
        assert not await system.stop(ref, timeout=0)  # had to be cancelled
        with pytest.raises(ActorStopped):
            await in_flight
        with pytest.raises(ActorStopped):
            await queued
    assert probe.stopped == []  # cancellation skips on_stop


async def test_names_are_unique_among_running_actors(env: Env) -> None:
    async with ActorSystem(env) as system:
        await system.spawn(lambda: Recorder(Probe()), "rec")
        with pytest.raises(DuplicateActor):
            await system.spawn(lambda: Recorder(Probe()), "rec")


async def test_spawn_validates_its_arguments(env: Env) -> None:
    async with ActorSystem(env) as system:
        with pytest.raises(ValueError, match="non-empty"):
            await system.spawn(lambda: Recorder(Probe()), "")
        with pytest.raises(ValueError, match="set by the runtime"):
            await system.spawn(lambda: Recorder(Probe()), "x", context={"actor": "y"})


async def test_spawn_needs_a_running_system(env: Env) -> None:
    system = ActorSystem(env)
    with pytest.raises(SystemNotRunning):
        await system.spawn(lambda: Recorder(Probe()), "rec")
    async with system:
        pass
    with pytest.raises(SystemNotRunning):
        await system.spawn(lambda: Recorder(Probe()), "rec")


async def test_an_actor_can_spawn_and_ask_another(env: Env) -> None:
    class Parent(Actor[str]):
        async def handle(self, ctx: ActorContext[str], msg: str) -> object:
            child = await ctx.system.spawn(lambda: Recorder(Probe()), f"child-{msg}")
            return await child.ask(20)

    async with ActorSystem(env) as system:
        parent = await system.spawn(Parent, "parent")
        assert await parent.ask("1") == 40
        assert system.names() == ["parent", "child-1"]
