"""The event stream's heartbeats (gateway/control_routes.py, `heartbeats=1`): each node's latest,
at most once an interval, the other events at once and the ids only increasing; a resume with
Last-Event-ID loses nothing but heartbeats that newer ones of their node replaced.

Against a scripted controller that feeds the live subject through the Bus protocol's handler,
and (`handlers=False`) through iteration, as a bus without handlers is read."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from events.contract import subjects
from events.contract.subjects import POSITION_HEADER
from gateway.control_routes import control_app
from runtime.env import Msg, MsgHandler

HEARTBEAT = "node.heartbeat.v1"
SCALED = "cluster.scaled.v1"
LONG = 60.0  # an interval no test waits out: what arrives came before it


class Controller:
    """A Bus: `events.list` from `log`, the live subject fed by `commit(..., live=True)`."""

    def __init__(self, *, handlers: bool) -> None:
        self.handlers = handlers
        self.log: list[dict[str, Any]] = []
        self.queues: list[asyncio.Queue[Msg | None]] = []
        self.handled: list[MsgHandler] = []

    def heartbeat(self, node: str, *, live: bool = True) -> dict[str, Any]:
        return self.commit(HEARTBEAT, f"heartbeat/{node}", {"node_id": node}, live=live)

    def event(self, *, live: bool = True) -> dict[str, Any]:
        return self.commit(SCALED, "cluster/a", {"name": "a"}, live=live)

    def commit(
        self, type_: str, stream: str, payload: dict[str, Any], *, live: bool
    ) -> dict[str, Any]:
        position = len(self.log) + 1
        env = {
            "event_id": f"e-{position}",
            "stream": stream,
            "position": position,
            "type": type_,
            "payload": {"type": type_, "seq": position, **payload},
        }
        self.log.append(env)
        if live:
            msg = Msg(
                subject=subjects.event(stream),
                data=msgspec.json.encode(env),
                headers={POSITION_HEADER: str(position)},
            )
            for handler in self.handled:
                handler(msg)
            for queue in self.queues:
                queue.put_nowait(msg)
        return env

    async def publish(self, subject: str, data: bytes, **kw: Any) -> None:
        raise AssertionError("the REST app never publishes")

    async def request(self, subject: str, data: bytes, *, timeout: float, **kw: Any) -> Msg:
        assert subject == subjects.api("events.list")
        req = msgspec.json.decode(data)
        found, cursor = [], req["after"]
        for env in self.log[req["after"] :]:
            cursor = env["position"]
            if req["heartbeats"] or env["type"] != HEARTBEAT:
                found.append(env)
                if len(found) == req["limit"]:
                    break
        reply = {"ok": True, "data": {"events": found, "next": cursor, "head": len(self.log)}}
        return Msg(subject="reply", data=msgspec.json.encode(reply))


class HandlerBus(Controller):
    async def subscribe(
        self, subject: str, *, queue: str = "", handler: MsgHandler | None = None
    ) -> Any:
        assert subject == subjects.EVENTS_ALL and handler is not None
        self.handled.append(handler)
        ended = asyncio.Event()
        handled = self.handled

        class Sub:
            async def __aiter__(self) -> AsyncIterator[Msg]:
                await ended.wait()  # a handler's subscription yields nothing, until its end
                return
                yield

            async def unsubscribe(self) -> None:
                handled.remove(handler)
                ended.set()

        return Sub()


class IteratedBus(Controller):
    async def subscribe(self, subject: str, *, queue: str = "") -> Any:
        assert subject == subjects.EVENTS_ALL
        inbox: asyncio.Queue[Msg | None] = asyncio.Queue()
        self.queues.append(inbox)
        queues = self.queues

        class Sub:
            async def __aiter__(self) -> AsyncIterator[Msg]:
                while (msg := await inbox.get()) is not None:
                    yield msg

            async def unsubscribe(self) -> None:
                queues.remove(inbox)

        return Sub()


class Frames:
    """An SSE response read frame by frame: (id, event type, envelope, loop time it came)."""

    def __init__(self, resp: Any) -> None:
        self.resp = resp
        self.seen: list[int] = []

    async def next(self, count: int) -> list[tuple[int, str, dict[str, Any], float]]:
        got = []
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(10):
            while len(got) < count:
                frame = (await self.resp.content.readuntil(b"\n\n")).decode()
                fields = dict(
                    line.split(": ", 1) for line in frame.strip().split("\n") if ": " in line
                )
                if "id" not in fields:
                    continue  # retry:, keep-alive
                envelope = msgspec.json.decode(fields["data"])
                got.append((int(fields["id"]), fields["event"], envelope, loop.time()))
        self.seen += [frame[0] for frame in got]
        assert self.seen == sorted(set(self.seen)), f"ids must only increase: {self.seen}"
        return got

    async def ids(self, count: int) -> list[int]:
        return [frame[0] for frame in await self.next(count)]


@contextlib.asynccontextmanager
async def stream(
    bus: Controller, interval: float, query: str = "heartbeats=1", **headers: str
) -> AsyncIterator[Frames]:
    root = web.Application()
    root.add_subapp("/api/v1", control_app(bus, heartbeat_interval=interval))  # type: ignore[arg-type]
    async with (
        TestClient(TestServer(root, host="127.0.0.1")) as client,
        client.get(f"/api/v1/events/stream?{query}", headers=headers) as resp,
    ):
        assert resp.status == 200
        yield Frames(resp)


def controller(handlers: bool) -> Controller:
    return HandlerBus(handlers=True) if handlers else IteratedBus(handlers=False)


both = pytest.mark.parametrize("handlers", [True, False], ids=["handler", "iterated"])


@both
async def test_a_nodes_heartbeats_within_an_interval_arrive_as_its_latest(handlers: bool) -> None:
    bus = controller(handlers)
    bus.event(live=False)  # 1: the log's head when the stream starts
    async with stream(bus, interval=0.3, query="heartbeats=1&after=1") as frames:
        bus.heartbeat("a")  # 2: none sent for an interval: at once
        [(two, _, _, first_at)] = await frames.next(1)
        assert two == 2
        for node in ("a", "b", "a", "c", "b", "a"):  # 3..8
            bus.heartbeat(node)
        got = await frames.next(3)
        # One each, the latest, in position order: a's 8, b's 7, c's 6.
        assert [(p, env["payload"]["node_id"]) for p, _, env, _ in got] == [
            (6, "c"),
            (7, "b"),
            (8, "a"),
        ]
        assert {kind for _, kind, _, _ in got} == {HEARTBEAT}
        # Held for the interval since the last heartbeats went out, and sent together.
        assert got[0][3] - first_at >= 0.25
        assert got[-1][3] - got[0][3] < 0.2


@both
async def test_other_events_are_not_held_and_take_the_held_heartbeats_first(
    handlers: bool,
) -> None:
    bus = controller(handlers)
    async with stream(bus, interval=LONG) as frames:
        bus.heartbeat("a")  # 1: at once
        assert await frames.ids(1) == [1]
        bus.heartbeat("a")  # 2: held for a minute ...
        bus.heartbeat("b")  # 3
        bus.heartbeat("a")  # 4
        sent_at = asyncio.get_running_loop().time()
        bus.event()  # 5: ... but not behind this, which is not held at all
        got = await frames.next(3)
        assert [(p, kind) for p, kind, _, _ in got] == [
            (3, HEARTBEAT),
            (4, HEARTBEAT),
            (5, SCALED),
        ]
        # Not even until the stream's next look at its client (a second).
        assert got[-1][3] - sent_at < 0.9
        sent_at = asyncio.get_running_loop().time()
        bus.event()  # 6: nothing held, sent alone
        [(six, _, _, came_at)] = await frames.next(1)
        assert six == 6 and came_at - sent_at < 0.9


@both
async def test_a_stream_without_heartbeats_sends_none_and_holds_nothing(handlers: bool) -> None:
    bus = controller(handlers)
    async with stream(bus, interval=LONG, query="after=0") as frames:
        bus.heartbeat("a")
        bus.event()
        assert await frames.ids(1) == [2]
        bus.heartbeat("a")  # none of these wakes the stream ...
        bus.heartbeat("b")
        sent_at = asyncio.get_running_loop().time()
        bus.event()  # ... this does, at once
        [(five, _, _, came_at)] = await frames.next(1)
        assert five == 5 and came_at - sent_at < 0.9


@both
async def test_a_resume_from_last_event_id_leaves_no_gap(handlers: bool) -> None:
    bus = controller(handlers)
    bus.heartbeat("a", live=False)  # 1
    bus.event(live=False)  # 2
    bus.heartbeat("a", live=False)  # 3: replaced by 5 before it could go out
    bus.heartbeat("b", live=False)  # 4
    bus.heartbeat("a", live=False)  # 5
    async with stream(bus, interval=LONG, query="heartbeats=1&after=0") as frames:
        # From the log: 1 goes out with 2, then 3..5 are held (the interval has not passed).
        assert await frames.ids(2) == [1, 2]
        bus.event()  # 6: takes b's 4 and a's 5 with it
        assert await frames.ids(3) == [4, 5, 6]
        bus.heartbeat("c")  # 7: held when the client goes
        first = frames.seen
    bus.heartbeat("a")  # 8 and 9 while it is away
    bus.event()  # 9
    async with stream(bus, interval=LONG, query="heartbeats=1", **{"Last-Event-ID": "6"}) as again:
        assert await again.ids(3) == [7, 8, 9]
        bus.event()  # 10, live
        assert await again.ids(1) == [10]
        second = again.seen
    not_heartbeats = [env["position"] for env in bus.log if env["type"] != HEARTBEAT]
    assert [p for p in first + second if p in not_heartbeats] == not_heartbeats
    heartbeats = [env["position"] for env in bus.log if env["type"] == HEARTBEAT]
    assert sorted(set(heartbeats) - set(first + second)) == [3]  # a's, replaced by its 5
