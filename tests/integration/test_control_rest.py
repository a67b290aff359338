"""The control REST API (gateway/control_routes.py) against a real controller over a real
nats-server: the controller runs in this process (actors, JetStream command queue, outbox for
the live events), the REST app is a separate NATS client, as a gateway is."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
import pytest
from aiohttp import ClientResponse, web
from aiohttp.test_utils import TestClient, TestServer

from actors.controller import Controller
from actors.outbox import OutboxPublisher
from events import GpuInfo, MemoryEventStore
from events.contract import subjects
from events.contract.messages import Register, RegisterReply
from gateway.control_routes import control_app
from runtime.env import Msg
from runtime.real_env import real_env
from wire.nats_bus import NatsBus
from wire.nats_commands import JetStreamCommandQueue

pytestmark = pytest.mark.integration

Connect = Callable[[str], Awaitable[NatsBus]]
CREATED = "cluster.created.v1"


def spec(name: str, replicas: int = 1) -> dict[str, Any]:
    return {"name": name, "replicas": replicas, "command": "serve --port {port}"}


class WatchedBus:
    """The REST app's bus, counting the subscriptions it holds."""

    def __init__(self, bus: NatsBus) -> None:
        self.bus = bus
        self.held = 0
        self.released = asyncio.Event()

    async def publish(self, subject: str, data: bytes, **kw: Any) -> None:
        await self.bus.publish(subject, data, **kw)

    async def request(self, subject: str, data: bytes, *, timeout: float, **kw: Any) -> Msg:
        return await self.bus.request(subject, data, timeout=timeout, **kw)

    async def subscribe(self, subject: str, *, queue: str = "") -> Any:
        sub = await self.bus.subscribe(subject, queue=queue)
        self.held += 1
        watcher = self

        class Watched:
            def __aiter__(self) -> Any:
                return sub.__aiter__()

            async def unsubscribe(self) -> None:
                await sub.unsubscribe()
                watcher.held -= 1
                watcher.released.set()

        return Watched()


@contextlib.asynccontextmanager
async def serve(app: web.Application) -> AsyncIterator[TestClient[Any, Any]]:
    root = web.Application()
    root.add_subapp("/api/v1", app)
    async with TestClient(TestServer(root, host="127.0.0.1")) as client:
        yield client


@pytest.fixture
async def controller(connect: Connect) -> AsyncIterator[Controller]:
    bus = await connect("controller")
    store = MemoryEventStore()
    env = real_env(store, bus=bus, seed=7)
    ctl = Controller(env, await JetStreamCommandQueue.create(bus))
    outbox = OutboxPublisher(store, bus)
    task = asyncio.create_task(ctl.run(extra=[outbox.run]))
    ready = asyncio.create_task(ctl.ready.wait())
    try:
        done, _ = await asyncio.wait({task, ready}, timeout=10, return_when="FIRST_COMPLETED")
        assert ready in done, f"controller did not start: {task}"
        yield ctl
    finally:
        ready.cancel()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


@pytest.fixture
async def rest(controller: Controller, connect: Connect) -> AsyncIterator[TestClient[Any, Any]]:
    async with serve(control_app(await connect("gateway"), events_poll=0.25)) as client:
        yield client


async def body(resp: ClientResponse) -> Any:
    assert resp.content_type == "application/json", await resp.text()
    return await resp.json()


async def error(resp: ClientResponse, status: int) -> dict[str, Any]:
    assert resp.status == status, await resp.text()
    found: dict[str, Any] = (await body(resp))["error"]
    assert "\n" not in found["message"]
    return found


# -- clusters ------------------------------------------------------------------------------


async def test_cluster_lifecycle_and_errors(rest: TestClient[Any, Any]) -> None:
    resp = await rest.post("/api/v1/clusters", json=spec("llama", 2))
    assert resp.status == 201, await resp.text()
    created = await body(resp)
    assert created["name"] == "llama" and created["desired"] == 2
    assert resp.headers["Location"] == "/api/v1/clusters/llama"

    assert [c["name"] for c in await body(await rest.get("/api/v1/clusters"))] == ["llama"]
    shown = await body(await rest.get("/api/v1/clusters/llama"))
    assert shown["spec"]["command"] == "serve --port {port}"

    # A second create of the same name is a conflict.
    conflict = await error(await rest.post("/api/v1/clusters", json=spec("llama")), 409)
    assert conflict["type"] == "conflict"

    # The controller validates the spec; the field it blames comes back as a path.
    bad = await error(await rest.post("/api/v1/clusters", json=spec("big", 5000)), 400)
    assert bad["message"].startswith("replicas: must be 0..1000") and bad["field"] == "$.replicas"
    bad = await error(
        await rest.post("/api/v1/clusters", json={**spec("x"), "gpu": {"count": "two"}}), 400
    )
    assert bad["field"] == "$.gpu.count" and "Expected `int`, got `str`" in bad["message"]
    bad = await error(await rest.post("/api/v1/clusters", data=b"{nope"), 400)
    assert bad["message"].startswith("body: not valid JSON")
    bad = await error(await rest.post("/api/v1/clusters", json=[spec("x")]), 400)
    assert bad["message"] == "body: Expected `object`, got `array`"

    # Scale: the body is checked here, the range by the controller.
    bad = await error(await rest.patch("/api/v1/clusters/llama", json={"replicas": "3"}), 400)
    assert bad == {
        "message": "replicas: Expected `int`, got `str`",
        "type": "invalid_request",
        "field": "$.replicas",
    }
    bad = await error(await rest.patch("/api/v1/clusters/llama", json={}), 400)
    assert bad["field"] == "$.replicas"
    bad = await error(await rest.patch("/api/v1/clusters/llama", json={"replicas": -1}), 400)
    assert bad["field"] == "$.replicas"
    scaled = await body(await rest.patch("/api/v1/clusters/llama", json={"replicas": 3}))
    assert scaled["desired"] == 3

    for method in ("GET", "PATCH", "DELETE"):
        missing = await error(
            await rest.request(method, "/api/v1/clusters/mistral", json={"replicas": 1}), 404
        )
        assert missing["type"] == "not_found" and "unknown cluster 'mistral'" in missing["message"]

    deleted = await body(await rest.delete("/api/v1/clusters/llama"))
    assert deleted == {"name": "llama", "deleted": True}
    await error(await rest.get("/api/v1/clusters/llama"), 404)

    # Routing misses are JSON too.
    assert (await error(await rest.get("/api/v1/nope"), 404))["type"] == "not_found"
    not_allowed = await error(await rest.put("/api/v1/clusters"), 405)
    assert not_allowed["type"] == "method_not_allowed"


# -- nodes ---------------------------------------------------------------------------------


async def test_nodes_list_and_drain(rest: TestClient[Any, Any], connect: Connect) -> None:
    assert await body(await rest.get("/api/v1/nodes")) == []
    agent = await connect("agent")
    register = Register(
        node_id="gpu-1",
        address="127.0.0.1",
        gpus=(GpuInfo(index=0, uuid="gpu-1-0", model="RTX4090", vram_mib=24_576),),
    )
    raw = await agent.request(
        subjects.register("gpu-1"), msgspec.json.encode(register), timeout=5.0
    )
    assert msgspec.json.decode(raw.data, type=RegisterReply).accepted

    nodes = await body(await rest.get("/api/v1/nodes"))
    assert [n["node_id"] for n in nodes] == ["gpu-1"] and not nodes[0]["drained"]
    drained = await body(await rest.post("/api/v1/nodes/gpu-1/drain"))
    assert drained == {"node_id": "gpu-1", "drained": True}
    assert (await body(await rest.get("/api/v1/nodes")))[0]["drained"]

    missing = await error(await rest.post("/api/v1/nodes/gpu-9/drain"), 404)
    assert "unknown node 'gpu-9'" in missing["message"]


# -- events --------------------------------------------------------------------------------


async def test_events_pages_with_after(rest: TestClient[Any, Any]) -> None:
    for name in ("a", "b", "c"):
        assert (await rest.post("/api/v1/clusters", json=spec(name))).status == 201
    everything = await body(await rest.get("/api/v1/events"))
    positions = [e["position"] for e in everything["events"]]
    assert len(positions) >= 3 and positions == sorted(set(positions))
    assert everything["head"] >= positions[-1]

    paged: list[int] = []
    after = 0
    while True:
        page = await body(await rest.get(f"/api/v1/events?after={after}&limit=2"))
        assert len(page["events"]) <= 2
        paged += [e["position"] for e in page["events"]]
        if not page["events"]:
            break
        assert page["events"][0]["position"] > after
        after = page["next"]
    assert paged == positions

    for query, field in [
        ("after=-1", "after"),
        ("after=x", "after"),
        ("limit=0", "limit"),
        ("limit=5000", "limit"),
        ("heartbeats=maybe", "heartbeats"),
    ]:
        bad = await error(await rest.get(f"/api/v1/events?{query}"), 400)
        assert bad["field"] == field and bad["message"].startswith(f"{field}: "), bad


class Sse:
    """Frames of one Server-Sent Events response, comments and `retry:` skipped unless asked."""

    def __init__(self, resp: ClientResponse) -> None:
        self.resp = resp

    async def frame(self, *, comments: bool = False) -> dict[str, str]:
        async with asyncio.timeout(10):
            while True:
                raw = (await self.resp.content.readuntil(b"\n\n")).decode()
                assert raw.endswith("\n\n"), f"stream ended: {raw!r}"
                fields: dict[str, str] = {}
                for line in raw.strip("\n").split("\n"):
                    key, _, value = line.partition(": ")
                    fields[key] = value
                if "data" in fields or (comments and "" in fields):
                    return fields

    async def until_created(self, name: str) -> list[dict[str, str]]:
        seen = []
        while True:
            frame = await self.frame()
            seen.append(frame)
            if frame["event"] == CREATED and f'"name":"{name}"' in frame["data"]:
                return seen


async def test_event_stream_catches_up_then_tails_without_gap_or_duplicate(
    rest: TestClient[Any, Any],
) -> None:
    for name in ("a", "b"):
        assert (await rest.post("/api/v1/clusters", json=spec(name))).status == 201
    log = (await body(await rest.get("/api/v1/events")))["events"]
    after = next(e["position"] for e in log if e["type"] == CREATED)  # a's creation

    async with rest.get(f"/api/v1/events/stream?after={after}") as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        stream = Sse(resp)
        seen = await stream.until_created("b")  # from the log
        # The live subscription exists once the response has begun: c comes live.
        assert (await rest.post("/api/v1/clusters", json=spec("c"))).status == 201
        seen += await stream.until_created("c")
        assert (await rest.patch("/api/v1/clusters/c", json={"replicas": 2})).status == 200
        while (frame := await stream.frame())["event"] != "cluster.scaled.v1":
            seen.append(frame)
        seen.append(frame)

    positions = [int(f["id"]) for f in seen]
    assert positions == sorted(set(positions)), positions  # increasing, no duplicate
    assert positions[0] > after  # nothing at or before `after` again
    assert all(f["event"] != "node.heartbeat.v1" for f in seen)
    for frame in seen:
        envelope = msgspec.json.decode(frame["data"])
        assert envelope["position"] == int(frame["id"]) and envelope["type"] == frame["event"]
    # No gap: exactly the log after `after`, up to the last event seen.
    log = (await body(await rest.get(f"/api/v1/events?after={after}")))["events"]
    assert positions == [e["position"] for e in log if e["position"] <= positions[-1]]

    # A reconnect's Last-Event-ID wins over the URL's `after`.
    resume = positions[-2]
    headers = {"Last-Event-ID": str(resume)}
    async with rest.get(f"/api/v1/events/stream?after={after}", headers=headers) as resp:
        assert int((await Sse(resp).frame())["id"]) == positions[-1]
    bad = await error(await rest.get("/api/v1/events/stream", headers={"Last-Event-ID": "x"}), 400)
    assert bad["field"] == "Last-Event-ID"


async def test_event_stream_keeps_alive_and_unsubscribes_when_the_client_goes(
    controller: Controller, connect: Connect
) -> None:
    bus = WatchedBus(await connect("gateway"))
    async with serve(control_app(bus, events_poll=0.1, keepalive=0.1)) as client:
        async with client.get("/api/v1/events/stream") as resp:
            assert resp.status == 200
            assert (await Sse(resp).frame(comments=True)) == {"": "keep-alive"}
            assert bus.held == 1
        async with asyncio.timeout(5):
            await bus.released.wait()
        assert bus.held == 0


# -- the controller away ---------------------------------------------------------------------


async def test_no_controller_is_503_and_a_silent_one_504(bus: NatsBus, connect: Connect) -> None:
    watched = WatchedBus(bus)
    async with serve(control_app(watched)) as client:
        for method, path in [
            ("GET", "/api/v1/clusters"),
            ("POST", "/api/v1/nodes/gpu-1/drain"),
            ("GET", "/api/v1/events"),
            ("GET", "/api/v1/events/stream"),
        ]:
            resp = await client.request(method, path)
            found = await error(resp, 503)
            assert resp.headers["Retry-After"] == "2"
            assert found["type"] == "controller_unavailable"
            assert found["message"].startswith("controller not reachable (no responder on ")
        assert watched.held == 0  # the stream let go of its subscription

    silent = await connect("silent")
    sub = await silent.subscribe(subjects.API_ALL, queue="controller")
    try:
        async with serve(control_app(bus, timeout=0.2)) as client:
            found = await error(await client.get("/api/v1/clusters/llama"), 504)
            assert found["type"] == "controller_timeout"
    finally:
        await sub.unsubscribe()
