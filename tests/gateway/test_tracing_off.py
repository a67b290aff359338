"""Tracing off (the default) costs the request path no import of opentelemetry: a request
through a real gateway and a node's fencing front, in a fresh interpreter, leaves no
opentelemetry module in sys.modules. Needs no extra."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import asyncio, sys

    import aiohttp

    from gateway.server import GatewayConfig
    from nodeagent.fencing_front import DirectFront, front_path
    from sim.bus import MemoryBus
    from tests.integration.gateway_kit import RoutingSource, Upstream, route, running_gateway


    async def main() -> None:
        upstream = await Upstream("u0").start()
        front = DirectFront("127.0.0.1", 0, lambda r, e: upstream.address, lambda r, e: "")
        serving = asyncio.create_task(front.run())
        await front.listening.wait()
        bus = MemoryBus()
        async with RoutingSource(bus) as source:
            address = f"http://127.0.0.1:{front.port}{front_path('r1', 1)}"
            await source.publish({"llama": [route("r1", address)]})
            config = GatewayConfig(gateway_id="gw-off", port=0, access_log=False)
            async with running_gateway(bus, config) as gw, aiohttp.ClientSession() as http:
                assert gw.proxy.tracer is None
                body = {"model": "llama", "messages": [{"role": "user", "content": "hi"}]}
                for _ in range(3):
                    async with http.post(f"{gw.url}/v1/chat/completions", json=body) as r:
                        assert r.status == 200, r.status
        serving.cancel()
        await asyncio.wait({serving})
        await upstream.stop()
        assert len(upstream.seen) == 3

    asyncio.run(main())
    print(sorted(m for m in sys.modules if m.startswith("opentelemetry")))
    """
)


def test_a_request_with_tracing_off_imports_no_opentelemetry() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout
