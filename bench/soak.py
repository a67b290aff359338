"""Soak: gateway load for minutes, a node killed now and then; do memory and descriptors stay
flat, and is every error one the docs promise?

    python bench/soak.py [--minutes 10] [--agents 4] [--clients 8] [--kill-every 60]
                         [--sample-every 30] [--json] [--quick]

A real stack on loopback (tests/integration/stack.py: nats-server, the controller, agents with
fake GPUs and echo workloads), cluster `echo` of 3 replicas, and a `gpumesh gateway` process.
--clients closed-loop clients in this process send chat requests through the gateway, every
other one streaming. Every --kill-every seconds a seeded RNG picks an agent that holds a
replica; it and its workload are SIGKILLed (a power loss) and the agent is started again 5 s
later. Every --sample-every seconds (30) it samples the gateway's and the controller's resident
memory and open file descriptors from /proc and prints a line.

At the end it prints the samples' first (after one minute of warm-up) and last values, and
the outcomes of the requests: answered, streams cut with an SSE `event: error` (the documented
outcome for a stream whose replica dies mid-answer), and everything else, which should be
nothing: errors before the first byte, silent cuts, connection failures. It exits 1 when
memory grew by more than 20 %, descriptors by more than 16, or an undocumented error occurred
(with --quick, seconds long, only on an undocumented error: memory has no time to settle).
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._gateway_process import GatewayProcess  # noqa: E402
from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from gpumesh.logconfig import configure_logging  # noqa: E402
from tests.integration.stack import Stack, echo_spec  # noqa: E402

WARMUP_S = 60.0
SAMPLE_EVERY_S = 30.0
# About 12 s in all, stack start included: one power loss, a sample every 3 s.
QUICK = {"minutes": 0.2, "agents": 3, "clients": 2, "kill_every": 4.0, "sample_every": 3.0}


def say(text: str) -> None:
    print(f"soak: {text}", file=sys.stderr, flush=True)


def rss_mib(pid: int | None) -> float:
    if pid is None:
        return 0.0
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def fds(pid: int | None) -> int:
    if pid is None:
        return 0
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


async def client(url: str, n: int, outcomes: Counter[str], stop: asyncio.Event) -> None:
    stream = n % 2 == 1
    body = {
        "model": "echo",
        "stream": stream,
        "messages": [{"role": "user", "content": f"soak client {n} " + "word " * 20}],
    }
    timeout = aiohttp.ClientTimeout(total=30)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        while not stop.is_set():
            try:
                async with http.post(f"{url}/v1/chat/completions", json=body) as resp:
                    data = await resp.read()
                    if resp.status != 200:
                        outcomes[f"error {resp.status} before the first byte"] += 1
                    elif not stream:
                        outcomes["answered"] += 1
                    elif b"event: error" in data:
                        outcomes["stream cut with event: error (documented)"] += 1
                    elif b"data: [DONE]" in data:
                        outcomes["answered"] += 1
                    else:
                        outcomes["stream cut silently"] += 1
            except aiohttp.ClientPayloadError:
                outcomes["stream cut silently"] += 1
            except (aiohttp.ClientError, TimeoutError) as exc:
                outcomes[f"connection failed: {type(exc).__name__}"] += 1


async def killer(
    stack: Stack, rng: random.Random, every: float, kills: Counter[str], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(every):
                await stop.wait()
        if stop.is_set():
            return
        cluster = await stack.cluster("echo")
        holders = sorted({r["node_id"] for r in cluster["replicas"] if r["status"] == "ready"})
        if not holders:
            continue
        victim = rng.choice(holders)
        await stack.kill_agent(victim)
        kills[victim] += 1
        say(f"power loss: {victim}")
        await asyncio.sleep(5)
        stack.start_agent(victim)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    outcomes: Counter[str] = Counter()
    kills: Counter[str] = Counter()
    samples: list[dict[str, float]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gpumesh-soak-") as tmp:
        async with Stack(Path(tmp) / "stack", agents=args.agents) as stack:
            await stack.create_cluster(echo_spec(3))
            await stack.wait_until(
                lambda: _ready(stack, 3), timeout=60, why="3 echo replicas ready"
            )
            gateway = GatewayProcess(stack)
            gateway.start()
            stop = asyncio.Event()
            try:
                await stack.wait_until(lambda: _answers(gateway), timeout=30, why="gateway up")
                say(f"stack up; {args.clients} clients for {args.minutes:g} min")
                async with asyncio.TaskGroup() as tasks:
                    for n in range(args.clients):
                        tasks.create_task(client(gateway.url, n, outcomes, stop))
                    tasks.create_task(killer(stack, rng, args.kill_every, kills, stop))
                    end = started + args.minutes * 60
                    while (now := time.monotonic()) < end:
                        await asyncio.sleep(min(args.sample_every, end - now))
                        controller = stack.controller.pid if stack.controller else None
                        sample = {
                            "t_s": round(time.monotonic() - started, 1),
                            "gateway_rss_mib": round(rss_mib(gateway.pid), 1),
                            "gateway_fds": fds(gateway.pid),
                            "controller_rss_mib": round(rss_mib(controller), 1),
                            "controller_fds": fds(controller),
                            "requests": sum(outcomes.values()),
                        }
                        samples.append(sample)
                        say(" ".join(f"{k}={v}" for k, v in sample.items()))
                    stop.set()
            finally:
                await gateway.kill()
    return _verdict(samples, outcomes, kills, args)


async def _ready(stack: Stack, count: int) -> bool:
    cluster = await stack.cluster("echo")
    return sum(1 for r in cluster["replicas"] if r["status"] == "ready") >= count


async def _answers(gateway: GatewayProcess) -> bool:
    try:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{gateway.url}/readyz") as resp,
        ):
            return resp.status == 200
    except aiohttp.ClientError:
        return False


def _verdict(
    samples: list[dict[str, float]],
    outcomes: Counter[str],
    kills: Counter[str],
    args: argparse.Namespace,
) -> dict[str, Any]:
    warm = [s for s in samples if s["t_s"] >= WARMUP_S] or samples
    first, last = warm[0], samples[-1]
    documented = {"answered", "stream cut with event: error (documented)"}
    undocumented = {k: v for k, v in outcomes.items() if k not in documented}
    rss_growth = last["gateway_rss_mib"] / first["gateway_rss_mib"] - 1
    fd_growth = last["gateway_fds"] - first["gateway_fds"]
    return {
        "minutes": args.minutes,
        "kills": dict(kills),
        "outcomes": dict(outcomes),
        "undocumented_errors": undocumented,
        "gateway_rss_mib": [first["gateway_rss_mib"], last["gateway_rss_mib"]],
        "gateway_rss_growth_pct": round(100 * rss_growth, 1),
        "gateway_fds": [first["gateway_fds"], last["gateway_fds"]],
        "controller_rss_mib": [first["controller_rss_mib"], last["controller_rss_mib"]],
        "controller_fds": [first["controller_fds"], last["controller_fds"]],
        "samples": samples,
        "flat": rss_growth <= 0.2 and fd_growth <= 16,
        "ok": (args.quick or (rss_growth <= 0.2 and fd_growth <= 16)) and not undocumented,
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--kill-every", type=float, default=60.0, metavar="S")
    parser.add_argument(
        "--sample-every",
        type=float,
        default=SAMPLE_EVERY_S,
        metavar="S",
        help=f"memory and descriptors sampled every S seconds ({SAMPLE_EVERY_S:g})",
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    add_quick(parser, " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in QUICK.items()))
    arguments = parser.parse_args()
    apply_quick(parser, arguments, **QUICK)
    configure_logging(level="warning", json=False, stream=sys.stderr)
    announce(arguments, json_output=arguments.json)
    result = mark(arguments, asyncio.run(main(arguments)))
    if arguments.json:
        print(json.dumps(result, indent=2))
    else:
        for key, value in result.items():
            if key != "samples":
                print(f"{key:>24}: {value}")
    sys.exit(0 if result["ok"] else 1)
