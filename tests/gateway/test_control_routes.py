"""gateway/control_routes.py without NATS: the pure helpers, and the event stream's gap filling
against a scripted controller (tests/integration/test_control_rest.py runs the real one)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from events.contract import subjects
from events.contract.subjects import POSITION_HEADER
from gateway.control_routes import (
    body_field,
    control_app,
    live_position,
    refused,
    sse_frame,
    unreachable,
)
from runtime.env import Msg, NoResponders, RequestTimeout

HEARTBEAT = "node.heartbeat.v1"


@pytest.mark.parametrize(
    ("message", "field"),
    [
        ("replicas: must be 0..1000, got 5000", "$.replicas"),
        ("gpu.count: Expected `int`, got `str`", "$.gpu.count"),
        ("bad request body: Expected `int`, got `str` - at `$.replicas`", "$.replicas"),
        ("Object missing required field `replicas`", "$.replicas"),
        ("unknown cluster 'mistral' (known: llama)", ""),
        ("cluster 'llama' already exists", ""),
    ],
)
def test_body_field_names_the_blamed_input(message: str, field: str) -> None:
    assert body_field(message) == field


def test_controller_failures_map_to_statuses() -> None:
    assert refused("unknown cluster 'x' (known: none)").status == 404
    assert refused("unknown node 'gpu-9'").status == 404
    assert refused("cluster 'x' already exists").status == 409
    spec = refused("name: use 1-128 of [A-Za-z0-9_-]")
    assert (spec.status, spec.field) == (400, "$.name")
    gone = unreachable(NoResponders("gpumesh.v1.api.cluster.list"))
    assert (gone.status, gone.headers) == (503, {"Retry-After": "2"})
    assert gone.message == "controller not reachable (no responder on gpumesh.v1.api.cluster.list)"
    assert unreachable(RequestTimeout("s", 10.0)).status == 504


def test_sse_frame_and_live_position() -> None:
    data = b'{"position":7,"type":"cluster.created.v1"}'
    assert sse_frame(7, "cluster.created.v1", data) == (
        b'id: 7\nevent: cluster.created.v1\ndata: {"position":7,"type":"cluster.created.v1"}\n\n'
    )
    assert sse_frame(1, "a\nb", b"{}").count(b"\n") == 4  # a tag cannot split the frame
    assert live_position(Msg(subject="s", data=data, headers={POSITION_HEADER: "9"})) == 9
    assert live_position(Msg(subject="s", data=data)) == 7
    assert live_position(Msg(subject="s", data=b"junk")) is None


# -- the stream against a scripted controller -------------------------------------------------


def envelope(position: int, type_: str = "cluster.scaled.v1") -> dict[str, Any]:
    return {"position": position, "type": type_, "payload": {"type": type_}}


class ScriptedController:
    """A Bus: `events.list` answered from `log`; the live subject fed by `publish_live`."""

    def __init__(self) -> None:
        self.log: list[dict[str, Any]] = []
        self.live: list[asyncio.Queue[Msg | None]] = []
        self.subscribed = asyncio.Event()
        self.fail_next = 0  # that many events.list requests find no responder

    def commit(self, *types: str) -> list[dict[str, Any]]:
        start = self.log[-1]["position"] if self.log else 0
        added = [envelope(start + i + 1, t) for i, t in enumerate(types)]
        self.log += added
        return added

    def publish_live(self, env: dict[str, Any]) -> None:
        msg = Msg(
            subject=subjects.event("cluster/a"),
            data=msgspec.json.encode(env),
            headers={POSITION_HEADER: str(env["position"])},
        )
        for queue in self.live:
            queue.put_nowait(msg)

    async def publish(self, subject: str, data: bytes, **kw: Any) -> None:
        raise AssertionError("the REST app never publishes")

    async def subscribe(self, subject: str, *, queue: str = "") -> Any:
        assert subject == subjects.EVENTS_ALL
        inbox: asyncio.Queue[Msg | None] = asyncio.Queue()
        self.live.append(inbox)
        self.subscribed.set()
        live = self.live

        class Sub:
            async def __aiter__(self) -> AsyncIterator[Msg]:
                while (msg := await inbox.get()) is not None:
                    yield msg

            async def unsubscribe(self) -> None:
                live.remove(inbox)

        return Sub()

    async def request(self, subject: str, data: bytes, *, timeout: float, **kw: Any) -> Msg:
        assert subject == subjects.api("events.list")
        if self.fail_next:
            self.fail_next -= 1
            raise NoResponders(subject)
        req = msgspec.json.decode(data)
        found, cursor = [], req["after"]
        for env in self.log:
            if env["position"] <= req["after"]:
                continue
            cursor = env["position"]
            if req["heartbeats"] or env["type"] != HEARTBEAT:
                found.append(env)
                if len(found) == req["limit"]:
                    break
        head = self.log[-1]["position"] if self.log else 0
        reply = {"ok": True, "data": {"events": found, "next": cursor, "head": head}}
        return Msg(subject="reply", data=msgspec.json.encode(reply))


async def ids(resp: Any, count: int) -> list[int]:
    got = []
    async with asyncio.timeout(5):
        while len(got) < count:
            frame = (await resp.content.readuntil(b"\n\n")).decode()
            if frame.startswith("id: "):
                got.append(int(frame.split("\n")[0].removeprefix("id: ")))
    return got


async def test_stream_fills_holes_skips_duplicates_and_heartbeats() -> None:
    ctl = ScriptedController()
    ctl.commit("cluster.created.v1", HEARTBEAT, "cluster.scaled.v1")  # 1, 2, 3
    root = web.Application()
    root.add_subapp("/api/v1", control_app(ctl, events_poll=0.05))
    async with (
        TestClient(TestServer(root, host="127.0.0.1")) as client,
        client.get("/api/v1/events/stream?after=0") as resp,
    ):
        assert resp.status == 200
        assert await ids(resp, 2) == [1, 3]  # from the log, the heartbeat left out

        # 4 and 5 are lost on the live subject: 6 arriving sends the stream to the log.
        _, five, six = ctl.commit("a", "b", "c")
        ctl.publish_live(six)
        assert await ids(resp, 3) == [4, 5, 6]

        # Duplicates and heartbeats are dropped; the controller away delays, not loses.
        ctl.publish_live(five)
        seven, eight, _ = ctl.commit("d", HEARTBEAT, "e")
        ctl.publish_live(seven)
        ctl.publish_live(eight)
        ctl.fail_next = 2
        _, eleven = ctl.commit("f", "g")
        ctl.publish_live(eleven)  # 9 and 10 missing, and the controller not answering
        assert await ids(resp, 4) == [7, 9, 10, 11]
        assert ctl.fail_next == 0
