"""`gpumesh events rebuild`: every projection from the log, timed."""

from __future__ import annotations

import argparse
import asyncio
import gc
import resource
import sys
import time
from collections.abc import Sequence
from typing import Any, TextIO

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
    rebuild.add_argument(
        "--progress",
        action="store_true",
        help="show progress on stderr (events folded of the log's head, rate, ETA) even when "
        "stderr is not a terminal, one line per update; on a terminal it is shown anyway",
    )
    rebuild.set_defaults(handler=rebuild_projections)


PROGRESS_EVERY_S = 0.5  # on a terminal; a line per second otherwise


class Progress:
    """Where a rebuild stands, on stderr: `folded/total events, pct, rate, ETA`. On a terminal
    one line redrawn in place (a carriage return); otherwise (`--progress` into a file or a
    pipe) one line per update. Reads the fold's position between pages: nothing is added to
    the fold itself."""

    def __init__(self, total: int, stream: TextIO, *, tty: bool) -> None:
        self.total = total
        self.stream = stream
        self.tty = tty
        self.started = time.perf_counter()
        self._drawn = False

    def line(self, position: int) -> str:
        elapsed = time.perf_counter() - self.started
        rate = position / elapsed if elapsed > 0 else 0.0
        pct = 100.0 * position / self.total if self.total else 100.0
        left = self.total - position
        eta = f"ETA {left / rate:.1f} s" if rate > 0 and left > 0 else "ETA -"
        if left <= 0:
            eta = f"done in {elapsed:.2f} s"
        return (
            f"rebuild: {position:,}/{self.total:,} events ({pct:.0f}%), {rate:,.0f} events/s, {eta}"
        )

    def show(self, position: int) -> None:
        text = self.line(position)
        if self.tty:
            self.stream.write(f"\r{text}\x1b[K")
            self._drawn = True
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def end(self, position: int) -> None:
        self.show(position)
        if self._drawn:
            self.stream.write("\n")  # the summary starts on a line of its own
            self.stream.flush()

    async def follow(self, projector: Projector) -> None:
        """Show the fold's position every so often until cancelled (by its owner, the rebuild).
        The store reads a page in a thread, so this runs between pages."""
        every = PROGRESS_EVERY_S if self.tty else 1.0
        while True:
            self.show(projector.state.position)
            await asyncio.sleep(every)


async def rebuild_projections(args: argparse.Namespace) -> int:
    from events.sqlite_store import SqliteEventStore

    if not args.events_db.exists():
        raise LogNotFound(str(args.events_db))
    store = await SqliteEventStore.open(args.events_db)
    try:
        projector = Projector(store, args.read_model_db, page_size=50_000)
        progress: Progress | None = None
        if getattr(args, "progress", False) or sys.stderr.isatty():
            progress = Progress(await store.head(), sys.stderr, tty=sys.stderr.isatty())
        started = time.perf_counter()
        follower = (
            asyncio.create_task(progress.follow(projector), name="rebuild-progress")
            if progress is not None
            else None
        )
        # A rebuild allocates millions of objects that all stay alive: the cyclic collector
        # would rescan them again and again for nothing (measured: about 3x slower with it).
        gc.disable()
        try:
            # Fresh state: this is a whole rebuild.
            folded = await projector.catch_up(skip_superseded_heartbeats=not args.full)
        finally:
            gc.enable()
            if follower is not None:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
        elapsed = time.perf_counter() - started
        if progress is not None:
            progress.end(projector.state.position)
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
