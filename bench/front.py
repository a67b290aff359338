"""What the node's fencing front (nodeagent/fencing_front.py) adds to a direct-transport request.

    python bench/front.py [--requests 3000] [--tls] [--json] [--quick]

One echo workload (`gpumesh workload echo`, its own process) and, in this process, the front
that forwards to it; a client in this process sends the same non-streaming chat request
sequentially, first straight to the workload, then through the front, then straight again
(the baseline is the mean of the two straight runs). Reported: p50 and p99 latency and the
front's extra CPU per request (this process's CPU minus the client's share, measured on the
straight runs). A benchmark that prints figures, not a test.

`--tls`: also through a second front that is mutual TLS, as `gpumesh up` runs them, called
with a gateway's certificate (a CA, a node's and a gateway's certificates made in a temporary
directory by gpumesh/security). The client keeps its connection alive as the gateway's pool
does, so the handshake happens once and the figure is TLS's cost per request. The plain and
TLS fronts are measured in the order plain, TLS, TLS, plain (each row the mean of its two
runs), so a drift of the machine falls on both. `tls_cpu_added_pct` compares this process's
CPU per request (client and front: both ends of the hop) through the TLS front with the plain
one; `tls_cpu_added_pct_of_front` compares the same added CPU with the plain front's own CPU
(through minus straight), the stricter reading.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from gpumesh.security import identities  # noqa: E402
from nodeagent.fencing_front import DirectFront, FrontTLS, front_path  # noqa: E402
from tests.integration.gateway_kit import free_port  # noqa: E402
from wire.nats_access import SecurityLayout, load_credentials  # noqa: E402

CHAT = b'{"model": "echo", "messages": [{"role": "user", "content": "front"}]}'
QUICK_REQUESTS = 200


async def _run(url: str, n: int, context: ssl.SSLContext | None = None) -> dict[str, float]:
    latencies = []
    cpu = time.process_time()
    async with aiohttp.ClientSession() as http:
        for _ in range(n):
            start = time.perf_counter()
            async with http.post(url, data=CHAT, ssl=context) as resp:
                await resp.read()
                assert resp.status == 200, resp.status
            latencies.append(time.perf_counter() - start)
    latencies.sort()
    return {
        "p50_us": statistics.median(latencies) * 1e6,
        "p99_us": latencies[int(len(latencies) * 0.99)] * 1e6,
        "cpu_us_per_request": (time.process_time() - cpu) / n * 1e6,
    }


def main(args: argparse.Namespace) -> dict[str, Any]:
    port = free_port()
    workload = subprocess.Popen(
        [sys.executable, "-m", "gpumesh", "workload", "echo", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        return asyncio.run(measure(f"http://127.0.0.1:{port}", args))
    finally:
        workload.terminate()
        workload.wait(10)


def _tls_pair(folder: Path) -> tuple[FrontTLS, ssl.SSLContext]:
    """A node's front TLS and a gateway's client context, of a new CA, as `gpumesh up` makes."""
    layout = SecurityLayout(folder)
    identities.init(layout)
    identities.issue(layout, "bench-node", "node")
    node = load_credentials(layout.creds("bench-node"))
    gateway = load_credentials(layout.creds("gateway"))
    front = FrontTLS(node.tls_context(server=True), node.ca_pem, layout.crl)
    return front, gateway.tls_context(server=False)


def _mean(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: (a[k] + b[k]) / 2 for k in a}


async def measure(base: str, args: argparse.Namespace) -> dict[str, Any]:
    if args.tls:
        with tempfile.TemporaryDirectory(prefix="bench-front-") as folder:
            return await _measure(base, args, _tls_pair(Path(folder)))
    return await _measure(base, args, None)


async def _measure(
    base: str, args: argparse.Namespace, tls: tuple[FrontTLS, ssl.SSLContext] | None
) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            try:
                async with http.get(base + "/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
    front = DirectFront("127.0.0.1", 0, lambda _r, _e: base, lambda _r, _e: "")
    secured = None
    if tls is not None:
        secured = DirectFront("127.0.0.1", 0, lambda _r, _e: base, lambda _r, _e: "", tls=tls[0])
    async with asyncio.TaskGroup() as tasks:
        serving = [tasks.create_task(f.run()) for f in (front, secured) if f is not None]
        await front.listening.wait()
        path = "/v1/chat/completions"
        fronted = f"http://127.0.0.1:{front.port}{front_path('echo-0', 1)}{path}"
        await _run(base + path, 200)  # warm both
        await _run(fronted, 200)
        if secured is not None and tls is not None:
            await secured.listening.wait()
            fronted_tls = f"https://127.0.0.1:{secured.port}{front_path('echo-0', 1)}{path}"
            await _run(fronted_tls, 200, tls[1])
        straight_a = await _run(base + path, args.requests)
        through = await _run(fronted, args.requests)
        if secured is not None and tls is not None:
            through_tls_a = await _run(fronted_tls, args.requests, tls[1])
            through_tls_b = await _run(fronted_tls, args.requests, tls[1])
            through = _mean(through, await _run(fronted, args.requests))
        straight_b = await _run(base + path, args.requests)
        for task in serving:
            task.cancel()
    straight = _mean(straight_a, straight_b)
    front_cpu = through["cpu_us_per_request"] - straight["cpu_us_per_request"]
    result: dict[str, Any] = {
        "requests": args.requests,
        "straight": straight,
        "through_front": through,
        "added_p50_us": through["p50_us"] - straight["p50_us"],
        "added_p99_us": through["p99_us"] - straight["p99_us"],
        "front_cpu_us_per_request": front_cpu,
    }
    if secured is not None:
        through_tls = _mean(through_tls_a, through_tls_b)
        added = through_tls["cpu_us_per_request"] - through["cpu_us_per_request"]
        result |= {
            "through_front_tls": through_tls,
            "tls_handshakes": secured.handshakes,  # one per client session (run), warm-up too
            "tls_added_p50_us": through_tls["p50_us"] - through["p50_us"],
            "tls_cpu_added_us_per_request": added,
            "tls_cpu_added_pct": 100 * added / through["cpu_us_per_request"],
            "tls_cpu_added_pct_of_front": 100 * added / front_cpu,
        }
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument(
        "--tls", action="store_true", help="also through a mutual-TLS front (see above)"
    )
    parser.add_argument("--json", action="store_true")
    add_quick(parser, f"--requests {QUICK_REQUESTS}")
    arguments = parser.parse_args()
    apply_quick(parser, arguments, requests=QUICK_REQUESTS)
    announce(arguments, json_output=arguments.json)
    result = mark(arguments, main(arguments))
    if arguments.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            if isinstance(value, dict):
                value = {k: round(v, 1) for k, v in value.items()}
            elif isinstance(value, float):
                value = round(value, 1)
            print(f"{key:>26}: {value}")
