"""What the node's fencing front (nodeagent/fencing_front.py) adds to a direct-transport request.

    python bench/front.py [--requests 3000] [--json] [--quick]

One echo workload (`gpumesh workload echo`, its own process) and, in this process, the front
that forwards to it; a client in this process sends the same non-streaming chat request
sequentially, first straight to the workload, then through the front, then straight again
(the baseline is the mean of the two straight runs). Reported: p50 and p99 latency and the
front's extra CPU per request (this process's CPU minus the client's share, measured on the
straight runs). A benchmark that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from nodeagent.fencing_front import DirectFront, front_path  # noqa: E402
from tests.integration.gateway_kit import free_port  # noqa: E402

CHAT = b'{"model": "echo", "messages": [{"role": "user", "content": "front"}]}'
QUICK_REQUESTS = 200


async def _run(url: str, n: int) -> dict[str, float]:
    latencies = []
    cpu = time.process_time()
    async with aiohttp.ClientSession() as http:
        for _ in range(n):
            start = time.perf_counter()
            async with http.post(url, data=CHAT) as resp:
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


async def measure(base: str, args: argparse.Namespace) -> dict[str, Any]:
    async with aiohttp.ClientSession() as http:
        for _ in range(100):
            try:
                async with http.get(base + "/health") as resp:
                    if resp.status == 200:
                        break
            except aiohttp.ClientError:
                await asyncio.sleep(0.1)
    front = DirectFront("127.0.0.1", 0, lambda _r, _e: base, lambda _r, _e: "")
    async with asyncio.TaskGroup() as tasks:
        serving = tasks.create_task(front.run())
        await front.listening.wait()
        path = "/v1/chat/completions"
        fronted = f"http://127.0.0.1:{front.port}{front_path('echo-0', 1)}{path}"
        await _run(base + path, 200)  # warm both
        await _run(fronted, 200)
        straight_a = await _run(base + path, args.requests)
        through = await _run(fronted, args.requests)
        straight_b = await _run(base + path, args.requests)
        serving.cancel()
    straight = {k: (straight_a[k] + straight_b[k]) / 2 for k in straight_a}
    return {
        "requests": args.requests,
        "straight": straight,
        "through_front": through,
        "added_p50_us": through["p50_us"] - straight["p50_us"],
        "added_p99_us": through["p99_us"] - straight["p99_us"],
        "front_cpu_us_per_request": through["cpu_us_per_request"] - straight["cpu_us_per_request"],
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=3000)
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
