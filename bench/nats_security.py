"""What NATS security costs: TLS, NKEY authentication and per-role permissions against a plain
server, both run here, in this process, on the same machine.

    python bench/nats_security.py [--messages 200000] [--size 400] [--connects 40]
                                  [--round-trips 2000] [--identities 1000] [--json] [--quick]

It measures, for a plain and a secured nats-server (the configuration `gpumesh up` writes):
  - connect: median time to a usable connection (TCP, TLS handshake, NKEY challenge);
  - publish: heartbeat-sized messages per second from a node identity (whose permissions the
    server checks on every publish) to a controller subscriber, until the last one arrives;
  - round trip: median request/reply time (a register-like call);
and, for the secured server only, how long a revocation takes with `--identities` issued: the
registry and nats.conf rewritten, the server reloaded, and the revoked connection closed.
A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from events.contract import subjects  # noqa: E402
from gpumesh.logconfig import configure_logging  # noqa: E402
from gpumesh.security import identities  # noqa: E402
from wire.nats_access import Credentials, SecurityLayout, load_credentials  # noqa: E402
from wire.nats_bus import NatsBus  # noqa: E402
from wire.nats_server import EmbeddedNats  # noqa: E402

NODE = "node-0"
QUICK = {"messages": 500, "connects": 3, "round_trips": 200, "identities": 5}


async def _connect(url: str, name: str, creds: Credentials | None) -> NatsBus:
    return await NatsBus.connect(url, name=name, credentials=creds, connect_timeout=5.0)


async def measure(
    url: str, layout: SecurityLayout | None, args: argparse.Namespace
) -> dict[str, Any]:
    def creds(name: str) -> Credentials | None:
        return load_credentials(layout.creds(name)) if layout else None

    connects = []
    for _ in range(args.connects):
        start = time.perf_counter()
        bus = await _connect(url, "probe", creds(NODE))
        connects.append(time.perf_counter() - start)
        await bus.close()

    controller = await _connect(url, "controller", creds("controller"))
    node = await _connect(url, NODE, creds(NODE))
    try:
        payload = b"x" * args.size
        got = 0
        done = asyncio.Event()
        sub = await controller.subscribe(subjects.HEARTBEAT_ALL, pending_limit=args.messages + 1)

        async def count() -> None:
            nonlocal got
            async for _ in sub:
                got += 1
                if got == args.messages:
                    done.set()
                    return

        async with asyncio.TaskGroup() as tasks:
            counter = tasks.create_task(count())
            start = time.perf_counter()
            subject = subjects.heartbeat(NODE)
            for _ in range(args.messages):
                await node.publish(subject, payload)
            await node.flush()
            async with asyncio.timeout(120):
                await done.wait()
            elapsed = time.perf_counter() - start
            counter.cancel()
        await sub.unsubscribe()

        api = await controller.subscribe(subjects.register(NODE))

        async def answer() -> None:
            async for msg in api:
                await controller.publish(msg.reply, b'{"accepted": true}')

        trips = []
        async with asyncio.TaskGroup() as tasks:
            server = tasks.create_task(answer())
            for _ in range(args.round_trips):
                start = time.perf_counter()
                await node.request(subjects.register(NODE), payload, timeout=5.0)
                trips.append(time.perf_counter() - start)
            server.cancel()
    finally:
        await node.close()
        await controller.close()
    return {
        "connect_ms_p50": statistics.median(connects) * 1e3,
        "publish_msgs_per_s": args.messages / elapsed,
        "round_trip_us_p50": statistics.median(trips) * 1e6,
    }


async def revocation(url: str, server: EmbeddedNats, layout: SecurityLayout) -> dict[str, Any]:
    victim = await _connect(url, "victim", load_credentials(layout.creds("victim")))
    try:
        start = time.perf_counter()
        identities.revoke(layout, "victim")
        rewritten = time.perf_counter() - start
        server.reload()
        async with asyncio.timeout(30):
            # The bus has no "disconnected" event to await; 1 ms polling is the resolution.
            while victim.is_connected:  # noqa: ASYNC110
                await asyncio.sleep(0.001)
        return {"rewrite_ms": rewritten * 1e3, "cut_off_ms": (time.perf_counter() - start) * 1e3}
    finally:
        await victim.close()


async def main(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        async with EmbeddedNats(root / "plain") as plain:
            baseline = await measure(plain.url, None, args)
        layout = SecurityLayout(root / "secure")
        start = time.perf_counter()
        identities.init(layout)
        identities.issue(layout, NODE, "node")
        identities.issue(layout, "victim", "node")
        for i in range(args.identities):
            identities.issue(layout, f"extra-{i}", "node")
        issue_s = time.perf_counter() - start
        async with EmbeddedNats(root / "nats", config_file=layout.server_config) as secure:
            secured = await measure(secure.url, layout, args)
            revoke = await revocation(secure.url, secure, layout)
    ratios = {k: secured[k] / baseline[k] for k in baseline}
    return {
        "plain": baseline,
        "secured": secured,
        "secured_over_plain": ratios,
        "identities": args.identities + 5,
        "issue_all_s": issue_s,
        "revocation": revoke,
    }


def report(result: dict[str, Any]) -> str:
    p, s, r = result["plain"], result["secured"], result["secured_over_plain"]
    lines = [
        f"{'':<26}{'plain':>12}{'secured':>12}{'ratio':>8}",
        f"{'connect p50 (ms)':<26}{p['connect_ms_p50']:>12.2f}{s['connect_ms_p50']:>12.2f}"
        f"{r['connect_ms_p50']:>8.2f}",
        f"{'publish (msgs/s)':<26}{p['publish_msgs_per_s']:>12,.0f}"
        f"{s['publish_msgs_per_s']:>12,.0f}{r['publish_msgs_per_s']:>8.2f}",
        f"{'request round trip p50 (us)':<26}{p['round_trip_us_p50']:>12.0f}"
        f"{s['round_trip_us_p50']:>12.0f}{r['round_trip_us_p50']:>8.2f}",
        f"issuing {result['identities']} identities: {result['issue_all_s']:.2f} s",
        f"revoking one of them: registry and nats.conf rewritten in "
        f"{result['revocation']['rewrite_ms']:.1f} ms, connection closed "
        f"{result['revocation']['cut_off_ms']:.1f} ms after the revoke began",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=200_000)
    parser.add_argument("--size", type=int, default=400, help="bytes per message (a heartbeat)")
    parser.add_argument("--connects", type=int, default=40)
    parser.add_argument("--round-trips", type=int, default=2000, help="requests timed (2000)")
    parser.add_argument("--identities", type=int, default=1000)
    parser.add_argument("--json", action="store_true")
    add_quick(parser, " ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK.items()))
    arguments = parser.parse_args()
    apply_quick(parser, arguments, **QUICK)
    configure_logging(level="warning", json=False)
    announce(arguments, json_output=arguments.json)
    outcome = mark(arguments, asyncio.run(main(arguments)))
    print(json.dumps(outcome, indent=2) if arguments.json else report(outcome))
