"""The dashboard's fleet page (gateway/ui) at 1,000 nodes: how long it takes to load, and what
following 1,000 heartbeats a second costs the page and the gateway.

    python bench/dashboard.py [--nodes 1000] [--loads 5] [--rate 1000] [--seconds 10] [--json]
    python bench/dashboard.py --quick

The gateway's /ui routes (gateway/ui.mount, as `gpumesh gateway` serves them) run in this
process on a real port, over a synthetic controller: a Bus that answers `node.list`,
`cluster.list` and `events.list` with `--nodes` nodes (two GPUs each, readings in every
heartbeat, a few degraded and offline) and 20 clusters whose replicas are spread over them, and
that publishes heartbeats on the events subject. A headless Chromium (tests/integration/
browser.py: Debian's `chromium`, over the DevTools protocol) loads /ui/fleet `--loads` times.

Load, per load (the page's own marks, milliseconds from the start of navigation):
  response    the HTML, with the 1,000 nodes in it, has arrived (responseEnd)
  rows        every row is drawn (performance mark gm-ready)
  painted     the first frame after that (gm-painted): what the issue's "loads in under 1 s"
              measures
Live: the page left open while `--rate` heartbeats a second arrive for `--seconds`; the page's
main-thread time (CDP Performance.getMetrics TaskDuration) per second of it, and this process's
CPU per second (the gateway's relay of the stream, plus the synthetic controller's publishing)
with the page open and with it closed. A benchmark that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from events.contract import subjects  # noqa: E402
from events.contract.subjects import POSITION_HEADER  # noqa: E402
from gateway.auth import KeyRing  # noqa: E402
from gateway.ui import mount  # noqa: E402
from runtime.env import Msg, MsgHandler  # noqa: E402
from tests.integration.browser import Chromium, chromium_path  # noqa: E402

REGIONS = ("eu-west", "eu-central", "us-east", "us-west", "ap-south", "ap-northeast")
MODELS = (("A100", 81920), ("RTX4090", 24576), ("L40S", 46068), ("H100", 81559))
CLUSTERS = 20
HEARTBEAT = "node.heartbeat.v1"
QUICK: dict[str, Any] = {"nodes": 100, "loads": 1, "rate": 100, "seconds": 2.0}


class SyntheticController:
    """A Bus, as far as the dashboard's routes use one: the read verbs and the events subject."""

    def __init__(self, nodes: int) -> None:
        self.nodes = [self._node(i) for i in range(nodes)]
        self.clusters = self._clusters()
        self.log: list[bytes] = []  # envelopes, JSON, position = index + 1
        self._subscribers: list[asyncio.Queue[Msg | None]] = []
        self._handlers: list[MsgHandler] = []
        self._node_list = msgspec.json.encode(self._reply(self.nodes))
        self._cluster_list = msgspec.json.encode(self._reply(self.clusters))
        for i in range(len(self.nodes)):  # one heartbeat each, so the log has a head
            self.append(self._heartbeat(i, 0))

    @staticmethod
    def _reply(data: Any) -> dict[str, Any]:
        return {"type": "api_reply.v1", "ok": True, "data": data}

    def _node(self, i: int) -> dict[str, Any]:
        model, vram = MODELS[i % len(MODELS)]
        health = "offline" if i % 100 == 7 else "degraded" if i % 100 == 42 else "healthy"
        return {
            "node_id": f"node-{i:04d}",
            "hostname": f"gpu{i:04d}.example",
            "address": f"10.{i // 250}.{i % 250}.1",
            "region": REGIONS[i % len(REGIONS)],
            "zone": f"{REGIONS[i % len(REGIONS)]}-{'abc'[i % 3]}",
            "labels": {"tier": "gold" if i % 5 == 0 else "standard"},
            "gpus": [
                {"index": g, "uuid": f"GPU-{i:04d}-{g}", "model": model, "vram_mib": vram}
                for g in range(2)
            ],
            "driver_version": "550.54.15",
            "cuda_version": "12.4",
            "price_per_hour": 1.5,
            "health": health,
            "health_reason": "registered" if health == "healthy" else "thermal",
            "health_detail": "",
            "drained": False,
            "cordoned_until_ns": 0,
            "cordon_reason": "",
            "last_heartbeat_at": time.time_ns(),
            "last_heartbeat_seq": 1,
            "metrics": self._metrics(i, 0),
            "probe_error": "",
            "running": [],
            "version": 3,
        }

    @staticmethod
    def _metrics(i: int, tick: int) -> list[dict[str, Any]]:
        _, vram = MODELS[i % len(MODELS)]
        return [
            {
                "index": g,
                "temperature_c": 40.0 + (i * 7 + g * 3 + tick) % 50,
                "utilization_pct": float((i * 13 + g * 29 + tick * 3) % 100),
                "memory_used_mib": (vram * ((i + g + tick) % 90)) // 100,
                "memory_total_mib": vram,
                "power_w": 250.0,
            }
            for g in range(2)
        ]

    def _clusters(self) -> list[dict[str, Any]]:
        clusters = []
        per = max(1, len(self.nodes) // CLUSTERS)
        for c in range(CLUSTERS):
            replicas = [
                {
                    "replica_id": f"model-{c}-{r}",
                    "node_id": self.nodes[(c * per + r) % len(self.nodes)]["node_id"],
                    "epoch": 1,
                    "revision": 1,
                    "status": "ready",
                    "address": f"http://10.0.0.1:{8000 + r}",
                    "why": "wins on spread",
                    "failure": "",
                }
                for r in range(per)
            ]
            spec = {"name": f"model-{c}", "replicas": per, "command": "serve --port {port}"}
            clusters.append(
                {
                    "name": f"model-{c}",
                    "desired": per,
                    "ready": per,
                    "revision": 1,
                    "rolled_out": 1,
                    "unschedulable": "",
                    "spec": spec,
                    "replicas": replicas,
                }
            )
        return clusters

    def _heartbeat(self, i: int, tick: int) -> dict[str, Any]:
        node_id = self.nodes[i]["node_id"]
        return {
            "event_id": f"hb-{len(self.log) + 1}",
            "stream": f"heartbeat/{node_id}",
            "version": tick + 1,
            "position": len(self.log) + 1,
            "type": HEARTBEAT,
            "recorded_at": time.time_ns(),
            "payload": {
                "type": HEARTBEAT,
                "node_id": node_id,
                "seq": tick + 1,
                "gpus": self._metrics(i, tick),
            },
        }

    def append(self, envelope: dict[str, Any]) -> Msg:
        data = msgspec.json.encode(envelope)
        self.log.append(data)
        return Msg(
            subject=subjects.event(envelope["stream"]),
            data=data,
            headers={POSITION_HEADER: str(envelope["position"])},
        )

    def publish_heartbeat(self, i: int, tick: int = 1) -> None:
        msg = self.append(self._heartbeat(i, tick))
        for queue in self._subscribers:
            queue.put_nowait(msg)
        for handler in self._handlers:
            handler(msg)

    async def heartbeats(self, rate: float, seconds: float) -> int:
        """Heartbeats round the fleet at `rate` a second for `seconds`, published live."""
        sent = 0
        start = time.perf_counter()
        tick = 1
        while (elapsed := time.perf_counter() - start) < seconds:
            due = int(elapsed * rate)
            while sent < due:
                self.publish_heartbeat(sent % len(self.nodes), tick + sent // len(self.nodes))
                sent += 1
            await asyncio.sleep(0.01)
        return sent

    # -- the Bus --------------------------------------------------------------------------

    async def publish(self, subject: str, data: bytes, **kw: Any) -> None:
        raise AssertionError("the dashboard never publishes")

    async def subscribe(
        self, subject: str, *, queue: str = "", handler: MsgHandler | None = None
    ) -> Any:
        inbox: asyncio.Queue[Msg | None] = asyncio.Queue()
        subscribers = self._subscribers
        handlers = self._handlers
        if handler is None:
            subscribers.append(inbox)
        else:  # as NatsBus: each message to the handler, and an iteration that only ends
            handlers.append(handler)

        class Subscription:
            async def __aiter__(self) -> AsyncIterator[Msg]:
                while (msg := await inbox.get()) is not None:
                    yield msg

            async def unsubscribe(self) -> None:
                if handler is None:
                    subscribers.remove(inbox)
                else:
                    handlers.remove(handler)
                    inbox.put_nowait(None)

        return Subscription()

    async def request(self, subject: str, data: bytes, *, timeout: float, **kw: Any) -> Msg:
        verb = subject.rsplit(".", 2)
        name = f"{verb[-2]}.{verb[-1]}"
        if name == "node.list":
            return Msg(subject="_INBOX", data=self._node_list)
        if name == "cluster.list":
            return Msg(subject="_INBOX", data=self._cluster_list)
        assert name == "events.list", name
        body = json.loads(data)
        after, limit = body["after"], body["limit"]
        wanted = self.log[after : after + limit] if body.get("heartbeats") else []
        head = len(self.log)
        nxt = after + len(wanted) if wanted else head
        page = b'{"type":"api_reply.v1","ok":true,"data":{"events":[%s],"next":%d,"head":%d}}'
        return Msg(subject="_INBOX", data=page % (b",".join(wanted), nxt, head))


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    controller = SyntheticController(args.nodes)
    app = web.Application()
    mount(app, controller, KeyRing.open(insecure_api=True))  # type: ignore[arg-type]
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    url = f"http://127.0.0.1:{port}/ui/fleet"
    loads: list[dict[str, float]] = []
    try:
        async with Chromium.launch() as browser:
            page = await browser.new_page(width=1600, height=1000)
            await page.send("Performance.enable")
            for _ in range(args.loads):
                await page.goto("about:blank")
                await page.goto(url, timeout=30)
                await page.wait_for("performance.getEntriesByName('gm-painted').length", timeout=30)
                loads.append(await page.evaluate(TIMINGS))
            rows = await page.evaluate("document.querySelectorAll('#nodes tbody tr').length")
            assert rows == args.nodes, rows
            if args.screenshot:
                await page.screenshot(args.screenshot)
            await page.wait_for("document.getElementById('live').classList.contains('on')")
            live = await _live(page, controller, args)
            await page.goto("about:blank")
            closed_cpu = time.process_time()
            await controller.heartbeats(args.rate, args.seconds)
            closed_cpu = time.process_time() - closed_cpu
            problems = page.problems
    finally:
        await runner.cleanup()
    return {
        "nodes": args.nodes,
        "html_bytes": loads[-1]["bytes"] if loads else 0,
        "html_bytes_decoded": loads[-1]["decoded"] if loads else 0,
        "loads": len(loads),
        "load_ms": {
            name: {
                "median": statistics.median(load[name] for load in loads),
                "max": max(load[name] for load in loads),
            }
            for name in ("response", "rows", "painted")
        },
        "live": {
            **live,
            "process_cpu_pct_page_closed": 100 * closed_cpu / args.seconds,
        },
        "console_problems": problems,
    }


TIMINGS = """(() => {
  const nav = performance.getEntriesByType('navigation')[0];
  return {
    response: nav.responseEnd,
    rows: performance.getEntriesByName('gm-ready')[0].startTime,
    painted: performance.getEntriesByName('gm-painted')[0].startTime,
    bytes: nav.encodedBodySize,
    decoded: nav.decodedBodySize,
  };
})()"""


async def _live(
    page: Any, controller: SyntheticController, args: argparse.Namespace
) -> dict[str, Any]:
    async def task_seconds() -> float:
        metrics = (await page.send("Performance.getMetrics"))["metrics"]
        return float(next(m["value"] for m in metrics if m["name"] == "TaskDuration"))

    before_page = await task_seconds()
    before_cpu = time.process_time()
    sent = await controller.heartbeats(args.rate, args.seconds)
    cpu = time.process_time() - before_cpu
    busy = await task_seconds() - before_page
    # One more heartbeat, for the node at the top of the page, behind all the others: how far
    # behind the page was when they stopped.
    caught_up = time.perf_counter()
    controller.publish_heartbeat(0)
    last = json.loads(controller.log[-1])
    await page.wait_for(
        f"document.querySelector('tr[data-id={last['payload']['node_id']}]').cells[8].title"
        f" === gm.fmtDateTime({last['recorded_at']})",
        timeout=30,
        every=0.01,
    )
    lag_ms = (time.perf_counter() - caught_up) * 1000
    return {
        "last_heartbeat_shown_after_ms": lag_ms,
        "heartbeats_per_s": sent / args.seconds,
        "page_main_thread_pct": 100 * busy / args.seconds,
        "process_cpu_pct_page_open": 100 * cpu / args.seconds,
    }


def main(args: argparse.Namespace) -> int:
    if chromium_path() is None:
        message = "bench/dashboard.py: no chromium to drive (apt-get install -y chromium)"
        print(message, file=sys.stderr)
        return 0 if args.quick else 1  # CI's quick run where apt-get could not install it
    announce(args, json_output=args.json)
    result = mark(args, asyncio.run(measure(args)))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(
            f"fleet page, {result['nodes']} nodes, {result['html_bytes_decoded']:,} bytes of "
            f"HTML ({result['html_bytes']:,} gzipped):"
        )
        for name, figures in result["load_ms"].items():
            print(
                f"  {name:>9}: {figures['median']:7.1f} ms median, {figures['max']:7.1f} ms max "
                f"over {result['loads']} loads"
            )
        live = result["live"]
        print(
            f"  live: {live['heartbeats_per_s']:.0f} heartbeats/s; the page's main thread "
            f"{live['page_main_thread_pct']:.1f}% busy; this process "
            f"{live['process_cpu_pct_page_open']:.1f}% CPU with the page open, "
            f"{live['process_cpu_pct_page_closed']:.1f}% with it closed; the last heartbeat "
            f"on the page {live['last_heartbeat_shown_after_ms']:.0f} ms after it was sent"
        )
        if result["console_problems"]:
            print(f"  console problems: {result['console_problems']}")
    return 1 if result["console_problems"] else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000)
    parser.add_argument("--loads", type=int, default=5, help="page loads to time (default 5)")
    parser.add_argument("--rate", type=float, default=1000.0, help="heartbeats a second")
    parser.add_argument("--seconds", type=float, default=10.0, help="of heartbeats, per phase")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--screenshot", type=Path, metavar="PNG", help="the loaded page, as docs/img shows it"
    )
    add_quick(parser, "--nodes 100 --loads 1 --rate 100 --seconds 2")
    arguments = parser.parse_args()
    apply_quick(parser, arguments, **QUICK)
    sys.exit(main(arguments))
