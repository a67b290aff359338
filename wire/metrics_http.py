"""GET /metrics over HTTP for a process's Prometheus registry: the controller's and the agent's
(`--metrics-listen HOST:PORT`). The gateway serves its own on its listening port."""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

# The text format generate_latest writes; the library's own CONTENT_TYPE_LATEST says
# version=1.0.0, which older servers do not know (as gateway/metrics.py).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `[IPV6]:PORT`, or `PORT` alone (127.0.0.1). ValueError with the reason."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        host, port = "127.0.0.1", text.strip()
    if not port.isdigit() or not 0 <= int(port) <= 65535 or (sep and not host):
        raise ValueError(f"--metrics-listen: expected HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


async def start_metrics(
    registry: CollectorRegistry,
    listen: str,
    *,
    name: str,
    before: Callable[[], Awaitable[None]] | None = None,
) -> web.AppRunner:
    """Serve GET /metrics on `listen` (HOST:PORT) until the runner is cleaned up; says where
    on stderr. `before`: awaited before each scrape. ValueError for a malformed `listen`,
    OSError when it cannot listen there."""
    host, port = parse_listen(listen)
    app = web.Application()

    async def metrics(request: web.Request) -> web.Response:
        if before is not None:
            await before()
        return web.Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE})

    app.router.add_get("/metrics", metrics)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound = runner.addresses[0]
    print(f"{name}: metrics on http://{bound[0]}:{bound[1]}/metrics", file=sys.stderr)
    return runner
