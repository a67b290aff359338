"""A rolling update and a canary under load, on real processes: what clients see.

    python bench/rollout.py [--clients 64] [--canary-s 3] [--json] [--quick]

One fresh stack on 127.0.0.1 (tests/integration/stack.py: nats-server, `gpumesh controller`, 3
agents with fake GPUs, the echo workload paced like a small model: 20 ms to the first token, 400
tokens/s), cluster `echo` of 3 replicas, and the gateway (in this process, as the integration
tests run it). `--clients` closed-loop clients, half of them streaming, send chat completions
through the gateway throughout:

1. `cluster.apply` records revision 2 (a new env var) and the controller replaces the replicas
   within `max_surge = 1`, `max_unavailable = 0`; the load goes on until it has rolled out and
   one second more.
2. `cluster.canary` serves revision 3's spec beside it as `echo-canary` with 25% of the
   requests, for 3 s of load once the canary is ready; then `cluster.promote`, which rolls
   revision 3 out over the cluster's replicas, and one second more.

Per phase: requests, failed (any status but 200, or a client error), streams cut (a 200 stream
without its `data: [DONE]`), the fewest replicas the gateway routed to, how long it took, and for
the canary the share of answers that came from it (each echo answer names its replica).

A benchmark that prints figures, not a test (tests/integration/test_rolling_update.py is).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from gpumesh.logconfig import configure_logging  # noqa: E402
from tests.integration.gateway_kit import running_gateway, until  # noqa: E402
from tests.integration.stack import Stack, echo_spec  # noqa: E402
from tests.integration.test_failover_processes import serving  # noqa: E402
from tests.integration.test_gateway_stack import start_clients  # noqa: E402
from wire.nats_server import find_nats_server  # noqa: E402


def _phase(log: list[Any], routed: list[int], took: float) -> dict[str, Any]:
    failed = [e for e in log if e[2] != 200]
    cut = [e for e in log if e[2] == 200 and e[1] and "data: [DONE]" not in e[3]]
    return {
        "requests": len(log),
        "failed": len(failed),
        "streams_cut": len(cut),
        "fewest_routed": min(routed) if routed else 0,
        "took_s": round(took, 2),
        "first_failures": [str(e)[:200] for e in failed[:3]],
    }


async def _rolled_out(stack: Stack, revision: int) -> bool:
    return bool((await stack.cluster("echo"))["rolled_out"] == revision)


def _answered(gw: Any, cluster: str) -> int:
    """Requests the gateway answered 200 for `cluster` (its own counter, by serving cluster)."""
    value = gw.registry.get_sample_value(
        "gpumesh_gateway_requests_total", {"cluster": cluster, "status": "200"}
    )
    return int(value or 0)


async def _under_load(
    gw: Any, clients: int, work: Any, routed_of: Any
) -> tuple[list[Any], list[int], float]:
    stop = asyncio.Event()
    log: list[Any] = []
    routed: list[int] = []
    async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tasks:
        start_clients(tasks, session, gw.url, stop, log, count=clients)
        await asyncio.sleep(1.0)
        began = time.monotonic()
        watching = asyncio.create_task(work())
        while not watching.done():
            routed.append(routed_of())
            await asyncio.sleep(0.05)
        await watching
        took = time.monotonic() - began
        await asyncio.sleep(1.0)
        stop.set()
    return log, routed, took


async def run(args: argparse.Namespace) -> dict[str, Any]:
    root = Path(tempfile.mkdtemp(prefix="gpumesh-rollout-"))
    stack = Stack(root / "stack", agents=3, nats_binary=find_nats_server())
    out: dict[str, Any] = {"clients": args.clients}
    async with stack:
        spec = echo_spec(3)
        spec["command"] += " --ttft-ms 20 --tokens-per-s 400"
        spec["env"] = {"GREETING": "v1"}
        await stack.create_cluster(spec)
        await serving(stack, 3)
        async with running_gateway(stack.bus) as gw:
            await until(lambda: len(gw.router.routes("echo")) >= 3, within=10)

            async def roll() -> None:
                await stack.api("cluster.apply", {**spec, "env": {"GREETING": "v2"}}, timeout=30)
                await stack.wait_until(lambda: _rolled_out(stack, 2), timeout=120)

            log, routed, took = await _under_load(
                gw, args.clients, roll, lambda: len(gw.router.routes("echo"))
            )
            out["rolling_update"] = _phase(log, routed, took)

            v3 = {**spec, "env": {"GREETING": "v3"}}

            async def canary() -> None:
                body = {"name": "echo", "spec": v3, "weight": 25}
                await stack.api("cluster.canary", body, timeout=30)
                await until(lambda: len(gw.router.routes("echo-canary")) >= 1, within=30)
                await asyncio.sleep(args.canary_s)
                await stack.api("cluster.promote", {"name": "echo"}, timeout=30)
                await stack.wait_until(lambda: _rolled_out(stack, 3), timeout=120)

            log, routed, took = await _under_load(
                gw, args.clients, canary, lambda: len(gw.router.routes("echo"))
            )
            phase = _phase(log, routed, took)
            phase["answers_from_canary"] = _answered(gw, "echo-canary")
            out["canary_then_promote"] = phase
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument(
        "--canary-s", type=float, default=3.0, help="load on the canary before promote (3 s)"
    )
    parser.add_argument("--json", action="store_true")
    add_quick(parser, "--clients 4 --canary-s 1")
    args = parser.parse_args()
    apply_quick(parser, args, clients=4, canary_s=1.0)
    configure_logging(level="warning", json=False, stream=sys.stderr)
    announce(args, json_output=args.json)
    result = mark(args, asyncio.run(run(args)))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        for name in ("rolling_update", "canary_then_promote"):
            p = result[name]
            extra = (
                f", {p['answers_from_canary']} answers from the canary"
                if "answers_from_canary" in p
                else ""
            )
            print(
                f"{name}: {p['requests']} requests, {p['failed']} failed, {p['streams_cut']} "
                f"streams cut, fewest routed {p['fewest_routed']}, {p['took_s']} s{extra}"
            )
    phases = ("rolling_update", "canary_then_promote")
    bad = any(result[n]["failed"] or result[n]["streams_cut"] for n in phases)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
