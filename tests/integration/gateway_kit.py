"""Parts for gateway tests: a routing source that stands in for the controller, and upstreams
that misbehave on purpose (hang before the head, cut a stream, refuse connections)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import msgspec
from aiohttp import web
from multidict import CIMultiDict

from events.contract import subjects
from events.contract.messages import ApiReply, RouteEntry, RoutingUpdate
from gateway.auth import KeyRing
from gateway.server import Gateway, GatewayConfig
from runtime.env import Bus, Msg
from runtime.real_env import LoopClock
from wire.nats_bus import NatsBus
from wire.routing_log import last_routing_table


class RoutingSource:
    """Answers `routing.get` and publishes `gpumesh.v1.routing`, as the controller does."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.update = RoutingUpdate(position=0)
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> RoutingSource:
        sub = await self.bus.subscribe(subjects.api("routing.get"))

        async def serve() -> None:
            async for msg in sub:
                await self._answer(msg)

        self._task = asyncio.create_task(serve())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _answer(self, msg: Msg) -> None:
        reply = ApiReply(ok=True, data=msgspec.to_builtins(self.update))
        await self.bus.publish(msg.reply, msgspec.json.encode(reply))

    async def publish(
        self,
        routes: dict[str, list[RouteEntry]],
        *clusters: str,
        models: dict[str, str] | None = None,
        cold_start: dict[str, float] | None = None,
    ) -> None:
        names = tuple(sorted({*routes, *clusters}))
        self.update = RoutingUpdate(
            position=self.update.position + 1,
            routes={c: tuple(r) for c, r in routes.items() if r},
            clusters=names,
            models=models or {},
            cold_start=cold_start or {},
        )
        await self.bus.publish(subjects.ROUTING, msgspec.json.encode(self.update))


def route(replica_id: str, address: str, *, node_id: str = "", epoch: int = 1) -> RouteEntry:
    return RouteEntry(
        replica_id=replica_id, node_id=node_id or f"node-{replica_id}", address=address, epoch=epoch
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Upstream:
    """A small aiohttp server whose behaviour a test sets: echo, hang, 500 or cut streams."""

    name: str
    mode: str = "ok"  # ok | hang | error | cut | cut0 | slowbody | cutbody | slowstream
    seen: list[CIMultiDict[str]] = field(default_factory=list)
    runner: web.AppRunner | None = None
    port: int = 0
    hung: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> Upstream:
        app = web.Application(client_max_size=8 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.chat)
        app.router.add_post("/v1/completions", self.chat)
        app.router.add_post("/v1/embeddings", self.chat)
        app.router.add_get("/health", self.health)
        app.on_response_prepare.append(self._mark)
        self.runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.1)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self.runner.addresses[0][1]
        return self

    async def _mark(self, request: web.Request, response: web.StreamResponse) -> None:
        # Every answer, the router's own 404/405 included, says it came from this upstream.
        response.headers.setdefault("X-Upstream", self.name)

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()

    async def health(self, request: web.Request) -> web.Response:
        return web.json_response(
            {"status": "ok", "upstream": self.name, "query": request.query_string}
        )

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(request.headers.copy())
        if self.mode == "hang":
            self.hung.set()
            await asyncio.sleep(3600)
        if self.mode == "error":
            return web.json_response({"error": "boom"}, status=500)
        if self.mode in ("slowbody", "cutbody"):
            # The head at once, the body later (a long generation) or never (a crash).
            payload = b'{"id": "chatcmpl-%s", "choices": []}' % self.name.encode()
            response = web.StreamResponse(
                headers={"Content-Type": "application/json", "X-Upstream": self.name}
            )
            response.content_length = len(payload)
            await response.prepare(request)
            await response.write(payload[:5])
            if self.mode == "cutbody":
                assert request.transport is not None
                request.transport.abort()
                return response
            await asyncio.sleep(0.5)
            await response.write(payload[5:])
            await response.write_eof()
            return response
        words = str(body.get("messages", [{}])[-1].get("content", "")).split() or ["ok"]
        if not body.get("stream"):
            return web.json_response(
                {
                    "id": f"chatcmpl-{self.name}",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body.get("model", ""),
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": " ".join(words)},
                            "finish_reason": "stop",
                        }
                    ],
                    "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                },
                headers={"X-Upstream": self.name},
            )
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "X-Upstream": self.name}
        )
        await response.prepare(request)
        if self.mode == "cut0":
            await asyncio.sleep(0.01)
            assert request.transport is not None
            request.transport.abort()  # dies after its head, before its first token
            return response
        for i, word in enumerate(words):
            chunk = {
                "id": f"chatcmpl-{self.name}",
                "object": "chat.completion.chunk",
                "created": 0,
                "model": body.get("model", ""),
                "choices": [
                    {
                        "index": 0,
                        "delta": {"content": ("" if i == 0 else " ") + word},
                        "finish_reason": None,
                    }
                ],
            }
            await response.write(b"data: " + msgspec.json.encode(chunk) + b"\n\n")
            if self.mode == "slowstream":
                await asyncio.sleep(0.5)  # a long generation, a token now and then
            if self.mode == "cut" and i == 1:
                await asyncio.sleep(0.01)
                assert request.transport is not None
                request.transport.abort()  # the replica dies mid-answer
                return response
        done = {
            "id": f"chatcmpl-{self.name}",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": body.get("model", ""),
            "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}],
        }
        await response.write(b"data: " + msgspec.json.encode(done) + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


@contextlib.asynccontextmanager
async def running_gateway(
    bus: Bus, config: GatewayConfig | None = None, keys: KeyRing | None = None, **overrides: Any
) -> AsyncIterator[Gateway]:
    config = config or GatewayConfig(gateway_id="gw-test", port=0, **overrides)
    routing_log = partial(last_routing_table, bus) if isinstance(bus, NatsBus) else None
    gateway = Gateway(
        bus,
        config,
        # No keys: a local development stack, /api/v1 open as with `--insecure-api`.
        keys or KeyRing.open(insecure_api=True),
        clock=LoopClock(),
        rng=random.Random(7),
        routing_log=routing_log,
    )
    task = asyncio.create_task(gateway.run())
    try:
        waiter = asyncio.ensure_future(gateway.started.wait())
        await asyncio.wait({waiter, task}, return_when=asyncio.FIRST_COMPLETED, timeout=10)
        waiter.cancel()
        if task.done():
            task.result()
        await asyncio.wait_for(gateway.feed.ready.wait(), 10)
        yield gateway
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def until(check: Callable[[], bool | Awaitable[bool]], *, within: float = 5.0) -> None:
    async with asyncio.timeout(within):
        while True:
            result = check()
            if not isinstance(result, bool):
                result = await result
            if result:
                return
            await asyncio.sleep(0.01)
