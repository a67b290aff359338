"""Processes that bench/gateway.py starts around the proxy under test (not a benchmark itself).

    python bench/_upstream.py serve --port P --id u1 [--chunks 20] [--chunk-delay-ms 5]
        A fake OpenAI-compatible replica (aiohttp, access log off), the same as in the peers'
        measurements that docs/performance.md compares with: POST /v1/chat/completions parses
        the JSON body and answers a fixed 317-byte chat.completion, or with `"stream": true` 20 SSE
        chunks `--chunk-delay-ms` apart and `data: [DONE]`. `--chunks 0` streams forever, one
        chunk every `--chunk-delay-ms`, until the client goes away (the many-streams check).
        Also GET /health and GET /v1/models.

    python bench/_upstream.py proxy --port P --upstream http://... [--upstream ...]
        A bare aiohttp reverse proxy (round robin, nothing else): the aiohttp floor.

    python bench/_upstream.py routing --nats URL --route bench,r1,node1,http://...
        Stands in for the controller: answers `routing.get` and publishes the table
        (CLUSTER,REPLICA,NODE,ADDRESS per --route) on `gpumesh.v1.routing` every 2 s.

    python bench/_upstream.py agent --nats URL --node node1 --replica r1=http://... [--max N]
        The node agent's tunnel server alone (nodeagent/tunnel.py), for the overlay transport:
        replica id -> the local upstream's URL.

Each prints `ready` on stdout once it serves, and stops on SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import signal
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BODY_BYTES = 317  # the peers' fixed chat.completion answer


def raise_fd_limit() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


def completion_body(upstream_id: str) -> bytes:
    """A chat.completion JSON padded to exactly BODY_BYTES."""

    def encode(content: str) -> bytes:
        return json.dumps(
            {
                "id": f"chatcmpl-{upstream_id}",
                "object": "chat.completion",
                "created": 1700000000,
                "model": "bench",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
            },
            separators=(",", ":"),
        ).encode()

    base = encode("")
    return encode("x" * max(0, BODY_BYTES - len(base)))


def chunk_event(upstream_id: str, index: int) -> bytes:
    chunk = {
        "id": f"chatcmpl-{upstream_id}",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "bench",
        "choices": [{"index": 0, "delta": {"content": f" tok{index}"}, "finish_reason": None}],
    }
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


async def serve(args: argparse.Namespace) -> None:
    from aiohttp import web

    body = completion_body(args.id)
    chunks = [chunk_event(args.id, i) for i in range(max(args.chunks, 1))]
    delay = args.chunk_delay_ms / 1000.0
    headers = {"X-Upstream": args.id}

    async def chat(request: web.Request) -> web.StreamResponse:
        parsed = json.loads(await request.read())
        if not parsed.get("stream"):
            return web.Response(body=body, content_type="application/json", headers=headers)
        response = web.StreamResponse(
            headers={**headers, "Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        if args.chunks <= 0:  # forever, until the client goes away (or 15 minutes)
            for i in range(int(900 / max(delay, 0.001))):
                await response.write(chunks[i % len(chunks)])
                await asyncio.sleep(delay)
            return response
        for i, chunk in enumerate(chunks):
            if i and delay:
                await asyncio.sleep(delay)
            await response.write(chunk)
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def models(request: web.Request) -> web.Response:
        return web.json_response(
            {"object": "list", "data": [{"id": "bench", "object": "model", "owned_by": "bench"}]}
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_post("/v1/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", args.port, backlog=4096)
    await site.start()
    print("ready", flush=True)
    try:
        await _until_stopped()
    finally:
        await runner.cleanup()


async def proxy(args: argparse.Namespace) -> None:
    """A bare aiohttp reverse proxy (round robin, no routing logic, no retries): the floor
    that any aiohttp gateway starts from, as in the peers' measurements."""
    import itertools

    import aiohttp
    from aiohttp import web

    hop = {"connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade"}
    upstreams = itertools.cycle(u.rstrip("/") for u in args.upstream)
    session: aiohttp.ClientSession | None = None

    async def forward(request: web.Request) -> web.StreamResponse:
        nonlocal session
        if session is None:
            session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=60),
                auto_decompress=False,
                timeout=aiohttp.ClientTimeout(total=None),
            )
        body = await request.read()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in hop]
        async with session.request(
            request.method, next(upstreams) + request.path_qs, headers=headers, data=body
        ) as up:
            out = [(k, v) for k, v in up.headers.items() if k.lower() not in hop]
            if up.content_length is not None:
                response = web.Response(status=up.status, body=await up.read())
                response.headers.extend(out)
                return response
            stream = web.StreamResponse(status=up.status)
            stream.headers.extend(out)
            await stream.prepare(request)
            async for chunk in up.content.iter_any():
                await stream.write(chunk)
            await stream.write_eof()
            return stream

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", forward)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", args.port, backlog=4096).start()
    print("ready", flush=True)
    try:
        await _until_stopped()
    finally:
        await runner.cleanup()
        if session is not None:
            await session.close()


async def routing(args: argparse.Namespace) -> None:
    import msgspec

    from events.contract import subjects
    from events.contract.messages import ApiReply, RouteEntry, RoutingUpdate
    from wire.nats_access import load_credentials
    from wire.nats_bus import NatsBus

    routes: dict[str, list[RouteEntry]] = {}
    for spec in args.route:
        cluster, replica_id, node_id, address = spec.split(",", 3)
        routes.setdefault(cluster, []).append(
            RouteEntry(replica_id=replica_id, node_id=node_id, address=address, epoch=1)
        )
    update = RoutingUpdate(
        position=1,
        routes={c: tuple(r) for c, r in routes.items()},
        clusters=tuple(sorted(routes)),
    )
    encoded = msgspec.json.encode(update)
    reply = msgspec.json.encode(ApiReply(ok=True, data=msgspec.to_builtins(update)))
    # A secured stack (bench/_tls_fronts.py routing) gives the controller's credentials.
    creds = getattr(args, "creds", None)
    credentials = load_credentials(creds) if creds is not None else None
    bus = await NatsBus.connect(args.nats, name="bench-routing", credentials=credentials)
    try:
        sub = await bus.subscribe(subjects.api("routing.get"))

        async def answer() -> None:
            async for msg in sub:
                if msg.reply:
                    await bus.publish(msg.reply, reply)

        async def publish() -> None:
            while True:
                await bus.publish(subjects.ROUTING, encoded)
                await asyncio.sleep(2.0)

        tasks = [asyncio.create_task(answer()), asyncio.create_task(publish())]
        await bus.flush()
        print("ready", flush=True)
        await _until_stopped()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    finally:
        await bus.close()


async def agent(args: argparse.Namespace) -> None:
    from nodeagent.tunnel import TunnelServer
    from wire.nats_bus import NatsBus

    table: dict[str, str] = {}
    for spec in args.replica:
        replica_id, url = spec.split("=", 1)
        table[replica_id] = url.rstrip("/")
    bus = await NatsBus.connect(args.nats, name=f"bench-agent-{args.node}")
    server = TunnelServer(bus, args.node, lambda r, e: table.get(r), max_concurrent=args.max)
    task = asyncio.create_task(server.run())
    try:
        await asyncio.wait_for(server.subscribed.wait(), 10)
        await bus.flush()
        print("ready", flush=True)
        await _until_stopped()
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await bus.close()


async def _until_stopped() -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    s = commands.add_parser("serve")
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--id", default="u1")
    s.add_argument("--chunks", type=int, default=20)
    s.add_argument("--chunk-delay-ms", type=float, default=5.0)
    p = commands.add_parser("proxy")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", action="append", default=[], metavar="URL")
    r = commands.add_parser("routing")
    r.add_argument("--nats", required=True)
    r.add_argument("--route", action="append", default=[], metavar="CLUSTER,ID,NODE,ADDRESS")
    a = commands.add_parser("agent")
    a.add_argument("--nats", required=True)
    a.add_argument("--node", required=True)
    a.add_argument("--replica", action="append", default=[], metavar="ID=URL")
    a.add_argument("--max", type=int, default=512, help="requests in flight on the agent")
    args = parser.parse_args()
    raise_fd_limit()
    from gpumesh.logconfig import configure_logging

    configure_logging(level="warning", json=True)
    handler: Any = {"serve": serve, "proxy": proxy, "routing": routing, "agent": agent}
    handler = handler[args.command]
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(handler(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
