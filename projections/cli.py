"""`gpumesh events rebuild`: every projection from the log, timed."""

from __future__ import annotations

import argparse
import gc
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any

import msgspec

from events.errors import LogNotFound

from .projector import Projector


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    rebuild = commands.add_parser(
        "rebuild",
        parents=list(parents),
        help="rebuild every projection from the event log and say how long it took",
        description="Drop the read model and fold the whole log again: nodes, clusters, "
        "replicas and the routing table. Events that cannot be decoded are reported by "
        "position and skipped, never dropped from the log.",
    )
    rebuild.add_argument("--json", action="store_true", help="print the summary as JSON")
    rebuild.add_argument(
        "--full",
        action="store_true",
        help="decode every event, superseded heartbeats too (slower; the state is the same, "
        "and every corrupt row is reported, not only those the fold would read)",
    )
    rebuild.set_defaults(handler=rebuild_projections)


async def rebuild_projections(args: argparse.Namespace) -> int:
    from events.sqlite_store import SqliteEventStore

    if not args.events_db.exists():
        raise LogNotFound(str(args.events_db))
    store = await SqliteEventStore.open(args.events_db)
    try:
        projector = Projector(store, args.read_model_db, page_size=50_000)
        started = time.perf_counter()
        # A rebuild allocates millions of objects that all stay alive: the cyclic collector
        # would rescan them again and again for nothing (measured: about 3x slower with it).
        gc.disable()
        try:
            # Fresh state: this is a whole rebuild.
            folded = await projector.catch_up(skip_superseded_heartbeats=not args.full)
        finally:
            gc.enable()
        elapsed = time.perf_counter() - started
    finally:
        await store.close()
    state = projector.state
    summary = {
        "events": state.position,
        "decoded": folded,
        "mode": "full" if args.full else "skip-superseded-heartbeats",
        "position": state.position,
        "seconds": round(elapsed, 3),
        "events_per_second": round(state.position / elapsed) if elapsed > 0 else None,
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        "nodes": len(state.nodes.nodes),
        "clusters": len(state.clusters.clusters),
        "replicas": len(state.replicas.replicas),
        "routes": sum(len(r) for r in state.routing.routes.values()),
        "undecodable_positions": state.undecodable,
        "read_model": str(args.read_model_db),
    }
    if args.json:
        print(msgspec.json.encode(summary).decode())
        return 0
    print(
        f"rebuilt the log to position {state.position} in {elapsed:.2f} s "
        f"({summary['events_per_second']} events/s, {folded} decoded, "
        f"peak RSS {summary['peak_rss_mib']} MiB)"
    )
    print(
        f"  nodes {summary['nodes']}  clusters {summary['clusters']}  replicas "
        f"{summary['replicas']}  routes {summary['routes']}  -> {args.read_model_db}"
    )
    if state.undecodable:
        shown = ", ".join(map(str, state.undecodable[:20]))
        more = "" if len(state.undecodable) <= 20 else f" (+{len(state.undecodable) - 20} more)"
        print(
            f"  {len(state.undecodable)} undecodable events kept raw at positions {shown}{more}",
            file=sys.stderr,
        )
    return 0
