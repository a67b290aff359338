"""Every log line from inside an actor carries its name and spawn context."""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from typing import Any

import structlog
from structlog.contextvars import bind_contextvars, merge_contextvars

from runtime import Actor, ActorContext, ActorSystem, Env, SupervisionPolicy


class Chatty(Actor[str]):
    async def on_start(self, ctx: ActorContext[str]) -> None:
        ctx.log.info("chatty_started")
        ctx.create_task(self.background(ctx), name="bg")

    async def background(self, ctx: ActorContext[str]) -> None:
        ctx.log.info("background_tick")

    async def handle(self, ctx: ActorContext[str], msg: str) -> object:
        if msg == "crash":
            raise RuntimeError("bad message")
        ctx.log.info("handled", msg=msg)
        return None


async def test_actor_logs_carry_actor_name_and_spawn_context(env: Env) -> None:
    policy = SupervisionPolicy(backoff_initial=0.0)
    with structlog.testing.capture_logs(processors=[merge_contextvars]) as logs:
        bind_contextvars(request="test-only")  # the spawner's context must not leak in
        async with ActorSystem(env) as system:
            a = await system.spawn(
                Chatty, "a", context={"node": "n1", "cluster": "c1"}, policy=policy
            )
            b = await system.spawn(Chatty, "b", context={"node": "n2"})
            await a.ask("hello")
            await b.ask("hello")
            await a.tell("crash")
            await a.ask("after")
            env.log.info("outside")
        structlog.contextvars.clear_contextvars()
    by_event: dict[str, list[MutableMapping[str, Any]]] = {}
    for entry in logs:
        by_event.setdefault(str(entry["event"]), []).append(entry)

    handled = {(e["actor"], e["msg"]): e for e in by_event["handled"]}
    assert handled["a", "hello"]["node"] == "n1"
    assert handled["a", "hello"]["cluster"] == "c1"
    assert handled["a", "hello"]["incarnation"] == 0
    assert handled["a", "after"]["incarnation"] == 1
    assert handled["b", "hello"]["node"] == "n2"
    assert "cluster" not in handled["b", "hello"]  # no leak between actors
    for entry in by_event["handled"] + by_event["chatty_started"] + by_event["background_tick"]:
        assert "request" not in entry

    assert {e["actor"] for e in by_event["background_tick"]} == {"a", "b"}
    crash = by_event["actor_crashed"][0]
    assert (crash["actor"], crash["node"], crash["cluster"]) == ("a", "n1", "c1")
    assert crash["log_level"] == "error"
    assert crash["exc_info"] is True
    outside = by_event["outside"][0]
    assert "actor" not in outside
    assert outside["request"] == "test-only"


async def test_context_values_do_not_outlive_the_actor_task(env: Env) -> None:
    async with ActorSystem(env) as system:
        await system.spawn(Chatty, "a", context={"node": "n1"})
        await asyncio.sleep(0)
        assert structlog.contextvars.get_contextvars() == {}
