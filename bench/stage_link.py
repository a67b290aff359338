"""What carrying a pipeline stage's TCP link over NATS costs: the stage link
(nodeagent/stage_link.py) against direct TCP on loopback, both run here, in this process.

    python bench/stage_link.py [--pings 200] [--push-mib 64] [--secure] [--json] [--quick]

A local nats-server (`--secure`: TLS and one NKEY identity per node, with the stage link's
permissions), a worker's and a head's agent end, each on its own NATS connection as on two
nodes, and a TCP responder behind the worker's end. It measures, through the tunnel and direct:
  - rtt: the median of `--pings` one-byte round trips (a token's hop is about one);
  - push: `--push-mib` MiB sent, acknowledged by one byte once all are read, as Gbit/s.
These are the overlay's cost the plan must state (docs/sharding.md). A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from events.contract import stage_link as frames  # noqa: E402
from gpumesh.logconfig import configure_logging  # noqa: E402
from nodeagent.stage_link import StageLinkClient, StageLinkServer, StageTarget  # noqa: E402
from wire.nats_access import Credentials  # noqa: E402
from wire.nats_bus import NatsBus  # noqa: E402
from wire.nats_server import EmbeddedNats  # noqa: E402

QUICK = {"pings": 20, "push_mib": 2}
PING = b"P"
PUSH = b"T"


async def responder(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """`P` -> `P`; `T` + 8-byte length + that many bytes -> `T` once all are read."""
    try:
        while op := await reader.read(1):
            if op == PING:
                writer.write(PING)
            elif op == PUSH:
                left = int.from_bytes(await reader.readexactly(8), "big")
                while left:
                    left -= len(await reader.read(min(left, 1 << 20)))
                writer.write(PUSH)
            else:
                break
            await writer.drain()
    except (ConnectionError, asyncio.IncompleteReadError):
        pass
    finally:
        writer.close()


async def measure(host: str, port: int, pings: int, push_bytes: int) -> dict[str, float]:
    reader, writer = await asyncio.open_connection(host, port)
    try:
        for _ in range(5):  # warm up: the stream's OPEN, the first frames
            writer.write(PING)
            await reader.readexactly(1)
        rtts = []
        for _ in range(pings):
            start = time.perf_counter()
            writer.write(PING)
            await reader.readexactly(1)
            rtts.append(time.perf_counter() - start)
        block = bytes(1 << 20)
        start = time.perf_counter()
        writer.write(PUSH + push_bytes.to_bytes(8, "big"))
        left = push_bytes
        while left:
            n = min(left, len(block))
            writer.write(block[:n])
            await writer.drain()
            left -= n
        await reader.readexactly(1)
        push_s = time.perf_counter() - start
    finally:
        writer.close()
    rtt = statistics.median(rtts)
    return {
        "rtt_ms": rtt * 1e3,
        "rtt_p90_ms": sorted(rtts)[int(0.9 * len(rtts))] * 1e3,
        "push_s": push_s,
        "gbps": push_bytes * 8 / max(push_s - rtt, rtt) / 1e9,
    }


@asynccontextmanager
async def nats(tmp: Path, secure: bool) -> AsyncIterator[tuple[str, Callable[[str], Any]]]:
    if not secure:
        async with EmbeddedNats(tmp / "nats") as server:
            yield server.url, lambda name: None
        return
    from gpumesh.security import identities
    from tests.integration.stage_link_access import with_stage_link_permissions
    from wire.nats_access import SecurityLayout, load_credentials

    layout = SecurityLayout(tmp / "secure")
    with with_stage_link_permissions():
        identities.init(layout)
        for name in ("head", "worker"):
            identities.issue(layout, name, "node")

    def creds(name: str) -> Credentials:
        return load_credentials(layout.creds(name))

    async with EmbeddedNats(tmp / "nats", config_file=layout.server_config) as server:
        yield server.url, creds


async def main(args: argparse.Namespace) -> dict[str, Any]:
    push = args.push_mib << 20
    echo = await asyncio.start_server(responder, "127.0.0.1", 0)
    port = echo.sockets[0].getsockname()[1]
    try:
        direct = await measure("127.0.0.1", port, args.pings, push)
        with tempfile.TemporaryDirectory() as tmp:
            async with nats(Path(tmp), args.secure) as (url, creds):
                worker_bus = await NatsBus.connect(url, name="worker", credentials=creds("worker"))
                head_bus = await NatsBus.connect(url, name="head", credentials=creds("head"))
                worker = StageLinkServer(
                    worker_bus, "worker", lambda r, e, k: ("127.0.0.1", port), window=args.window
                )
                head = StageLinkClient(head_bus, "head", window=args.window)
                tasks = [asyncio.create_task(worker.run()), asyncio.create_task(head.run())]
                try:
                    await worker.subscribed.wait()
                    await head.ready.wait()
                    host, fport = await head.forward(StageTarget("worker", "r", 1, 1))
                    tunnel = await measure(host, fport, args.pings, push)
                finally:
                    for task in tasks:
                        task.cancel()
                    await asyncio.gather(*tasks, return_exceptions=True)
                    await head_bus.close()
                    await worker_bus.close()
    finally:
        echo.close()
    return {
        "pings": args.pings,
        "push_mib": args.push_mib,
        "window": args.window,
        "secure": args.secure,
        "direct": direct,
        "tunnel": tunnel,
        "rtt_added_ms": tunnel["rtt_ms"] - direct["rtt_ms"],
        "throughput_ratio": tunnel["gbps"] / direct["gbps"],
    }


def report(result: dict[str, Any]) -> str:
    d, t = result["direct"], result["tunnel"]
    nats = "secured NATS (TLS, NKEY)" if result["secure"] else "plain NATS"
    push = f"push {result['push_mib']} MiB (Gbit/s)"
    return "\n".join(
        [
            f"stage link over a local {nats}, window {result['window'] >> 10} KiB, "
            f"chunks of {frames.MAX_CHUNK >> 10} KiB",
            f"{'':<28}{'direct':>12}{'tunnel':>12}",
            f"{'1-byte rtt, median (ms)':<28}{d['rtt_ms']:>12.3f}{t['rtt_ms']:>12.3f}",
            f"{'1-byte rtt, p90 (ms)':<28}{d['rtt_p90_ms']:>12.3f}{t['rtt_p90_ms']:>12.3f}",
            f"{push:<28}{d['gbps']:>12.2f}{t['gbps']:>12.2f}",
            f"rtt +{result['rtt_added_ms']:.3f} ms; throughput x{result['throughput_ratio']:.3f}",
        ]
    )


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pings", type=int, default=200)
    parser.add_argument("--push-mib", type=int, default=64)
    parser.add_argument("--window", type=int, default=frames.DEFAULT_WINDOW)
    parser.add_argument("--secure", action="store_true", help="TLS and NKEY identities")
    parser.add_argument("--json", action="store_true")
    add_quick(parser, "--pings 20 --push-mib 2")
    args = parser.parse_args(argv)
    apply_quick(parser, args, argv, **QUICK)
    return args


if __name__ == "__main__":
    arguments = parse()
    configure_logging(level="warning", json=False)
    announce(arguments, json_output=arguments.json)
    outcome = asyncio.run(main(arguments))
    print(json.dumps(mark(arguments, outcome)) if arguments.json else report(outcome))
