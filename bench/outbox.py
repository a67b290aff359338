"""How fast the outbox copies the log onto GPUMESH_EVENTS, against plain JetStream publishes.

The outbox (actors/outbox.py) publishes every committed event onto the events stream for
integrators, each publish conditional on the one before (`Nats-Expected-Last-Sequence`), up to
256 unacknowledged. This fills a memory store with heartbeats of 2,000 nodes, then times one
`publish_pending` catch-up onto a fresh stream, and, as the baseline in the same process, the
same number of bare `publish_async` calls of the same bodies with the same 256 in flight onto
another fresh stream of the same servers.

    python bench/outbox.py [--events 100000] [--servers 3] [--json] [--quick]

`--servers 3`: three local nats-servers clustered by routes, streams R3, `sync_interval:
always` (the HA shape); `--servers 1`: one server, R1, the same sync. A benchmark, not a test.
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from nats.js.api import StorageType, StreamConfig  # noqa: E402

from actors.outbox import OutboxPublisher  # noqa: E402
from bench._quick import add_quick, announce, apply_quick, mark  # noqa: E402
from bench.eventstore import nats_servers  # noqa: E402
from events import ANY, NodeHeartbeat  # noqa: E402
from events.codec import encode_envelope  # noqa: E402
from events.envelope import NewEvent  # noqa: E402
from events.memory_store import MemoryEventStore  # noqa: E402
from wire.nats_bus import NatsBus, ensure_stream  # noqa: E402
from wire.nats_cluster import wait_for_jetstream  # noqa: E402

QUICK = {"events": 2000}
NODES = 2000
WINDOW = 256


async def filled_store(events: int) -> MemoryEventStore:
    store = MemoryEventStore()
    work: list[tuple[str, list[NewEvent], int]] = []
    for i in range(events):
        node = f"hb-{i % NODES:05d}"
        beat = NodeHeartbeat(node_id=node, seq=i // NODES)
        event = NewEvent(event_id=f"e{i}", payload=beat, recorded_at=i)
        work.append((f"heartbeat/{node}", [event], ANY))
        if len(work) == 1000:
            await store.append_many(work)
            work = []
    if work:
        await store.append_many(work)
    return store


async def baseline(bus: NatsBus, store: MemoryEventStore, replicas: int) -> float:
    """Seconds for bare publish_async of the same bodies, WINDOW in flight."""
    js = bus.jetstream(timeout=30)
    config = StreamConfig(name="BENCH_BARE", subjects=["bench.bare.>"], storage=StorageType.FILE)
    await ensure_stream(js, config, replicas=replicas)
    bodies = [encode_envelope(e) for e in await store.read_all(1, 1 << 30)]
    slots = asyncio.Semaphore(WINDOW)
    acks: list[asyncio.Future[Any]] = []
    began = time.perf_counter()
    for i, body in enumerate(bodies):
        await slots.acquire()
        ack = await js.publish_async(f"bench.bare.{i % NODES}", body)
        ack.add_done_callback(lambda _: slots.release())
        acks.append(ack)
    await asyncio.gather(*acks)
    return time.perf_counter() - began


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    store = await filled_store(args.events)
    with (
        tempfile.TemporaryDirectory() as tmp,
        nats_servers(Path(tmp), args.servers, "always") as urls,
    ):
        url = ",".join(urls)
        await wait_for_jetstream(url, replicas=args.servers, timeout=60)
        bus = await NatsBus.connect(url, name="bench-outbox")
        try:
            outbox = OutboxPublisher(store, bus, window=WINDOW, ack_timeout=30.0)
            for attempt in range(60):  # a new cluster elects its meta leader in a few seconds
                try:
                    await outbox.ensure_stream()
                    break
                except Exception:
                    if attempt == 59:
                        raise
                    await asyncio.sleep(0.5)
            cpu0 = time.process_time()
            began = time.perf_counter()
            published = await outbox.publish_pending()
            took = time.perf_counter() - began
            cpu = time.process_time() - cpu0
            bare = await baseline(bus, store, bus.stream_replicas)
        finally:
            await bus.close()
    assert published == args.events, (published, args.events)
    return {
        "servers": args.servers,
        "events": args.events,
        "outbox_per_second": round(published / took),
        "outbox_cpu_us_per_event": round(cpu / published * 1e6, 1),
        "bare_publish_per_second": round(args.events / bare),
        "outbox_of_bare": round(bare / took, 3),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=100_000)
    parser.add_argument("--servers", type=int, choices=(1, 3), default=3)
    parser.add_argument("--json", action="store_true")
    add_quick(parser, "--events 2000")
    args = parser.parse_args()
    apply_quick(parser, args, **QUICK)
    announce(args, json_output=args.json)
    result = mark(args, asyncio.run(measure(args)))
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>26}  {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
