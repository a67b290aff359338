"""`gpumesh status`: the fleet on one screen, refreshed as events happen.

Nodes (health, region, GPUs, the hottest GPU, drained), clusters (ready of desired, why one is
unschedulable), replicas (id, epoch, state, node) and the last events. Everything comes from
the control API (`node.list`, `cluster.list`, `events.list`), as for `gpumesh nodes` and
`gpumesh cluster list`; the live screen subscribes to the events subject
(`gpumesh.v1.events.>`, docs/subjects.md) only to know when to ask again, at most a few times a
second, and every few seconds when nothing happens (so a controller that stops answering shows).

`summarise` turns API answers into the data `--json` prints; `render` turns that data into rich
tables; `watch` is the live loop. The first two are pure, for the tests.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import io
import os
import sys
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any

import msgspec
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from events.contract import subjects
from events.contract.messages import ApiReply
from runtime.env import BusError, NoResponders, RequestTimeout
from wire.commandline import add_creds_argument, credentials
from wire.errors import CommandFailed
from wire.stack import find_nats_url

EVENTS_SHOWN = 10
DEBOUNCE_S = 0.3  # after an event, gather the ones right behind it: ~3 refreshes a second at most
IDLE_REFRESH_S = 5.0  # with no event at all, still ask now and then
REQUEST_TIMEOUT_S = 5.0
_PAGE = 1000  # events.list's most per request
_BACKFILL_SPANS = (2_000, 50_000)  # positions to look back for the last events (heartbeats skipped)
_MAX_PAGES = 20  # per refresh: a screen that lags far behind catches up over a few refreshes
_DETAIL_WIDTH = 100
_PLAIN_WIDTH = 200

_HEALTH_STYLE = {
    "healthy": "green",
    "suspect": "yellow",
    "degraded": "yellow",
    "unhealthy": "red",
    "offline": "red",
}
_REPLICA_STYLE = {"ready": "green", "failed": "red", "stopping": "dim", "stopped": "dim"}


def register(commands: Any, parents: Sequence[argparse.ArgumentParser]) -> None:
    status = commands.add_parser(
        "status",
        parents=list(parents),
        help="the fleet on one live screen: nodes, clusters, replicas, last events",
        description="One screen of the running stack: nodes (health, region, GPUs, hottest "
        "GPU, drained), clusters (ready/desired, why unschedulable), replicas (id, epoch, "
        "state, node) and the last events. In a terminal it stays open and refreshes as "
        "events arrive (Ctrl-C leaves); --once prints it once, and so does a stdout that is "
        "not a terminal (a pipe, CI), in plain text; --json prints the same data once as "
        "JSON. It finds the stack like the other commands: --nats, else the URL a running "
        "`gpumesh up` or `gpumesh controller` wrote in the data directory.",
    )
    status.add_argument(
        "--nats",
        metavar="URL",
        help="NATS server or cluster to use (default: the local stack's, found through the "
        "data directory)",
    )
    add_creds_argument(status, "admin")
    status.add_argument("--once", action="store_true", help="print the screen once and exit")
    status.add_argument("--json", action="store_true", help="print the data once as JSON")
    status.add_argument(
        "--events",
        type=int,
        default=EVENTS_SHOWN,
        metavar="N",
        help=f"how many of the last events to show, heartbeats left out (default {EVENTS_SHOWN})",
    )
    status.set_defaults(handler=run_status)


# -- data ------------------------------------------------------------------------------------


def summarise(
    nodes: list[dict[str, Any]],
    clusters: list[dict[str, Any]],
    events: list[dict[str, Any]],
    *,
    nats: str = "",
    taken_at_ns: int = 0,
    error: str = "",
) -> dict[str, Any]:
    """What the screen shows (and `--json` prints), from the answers of `node.list`,
    `cluster.list` and `events.list` (its `events`, oldest first)."""
    node_rows = []
    for n in nodes:
        temps = [g.get("temperature_c", 0.0) for g in n.get("metrics", ())]
        node_rows.append(
            {
                "node_id": n["node_id"],
                "health": n.get("health", ""),
                "health_reason": n.get("health_reason", ""),
                "region": n.get("region", ""),
                "gpus": len(n.get("gpus", ())),
                "gpu_models": sorted({g.get("model", "") for g in n.get("gpus", ())}),
                "max_temperature_c": max(temps) if temps else None,
                "drained": bool(n.get("drained", False)),
            }
        )
    cluster_rows = []
    replica_rows = []
    for c in clusters:
        cluster_rows.append(
            {
                "name": c["name"],
                "ready": c.get("ready", 0),
                "desired": c.get("desired", 0),
                "revision": c.get("revision", 0),
                "unschedulable": c.get("unschedulable", ""),
            }
        )
        replica_rows += [
            {
                "replica_id": r["replica_id"],
                "cluster": c["name"],
                "epoch": r.get("epoch", 0),
                "status": r.get("status", ""),
                "node_id": r.get("node_id", ""),
            }
            for r in c.get("replicas", ())
        ]
    event_rows = [
        {
            "position": e.get("position", 0),
            "recorded_at": e.get("recorded_at", 0),
            "stream": e.get("stream", ""),
            "type": e.get("type", ""),
            "detail": event_detail(e.get("payload")),
        }
        for e in events
    ]
    return {
        "nats": nats,
        "taken_at": taken_at_ns,
        "error": error,
        "nodes": node_rows,
        "clusters": cluster_rows,
        "replicas": replica_rows,
        "events": event_rows,
    }


def event_detail(payload: Any) -> str:
    """`key=value` for a payload's non-empty fields (its type tag left out): short values whole,
    lists of plain values joined, anything nested as its length."""
    if not isinstance(payload, dict):
        return ""
    parts = []
    for key, value in payload.items():
        if key == "type" or value in ("", [], {}, None):
            continue
        if isinstance(value, list) and all(isinstance(v, str | int | float) for v in value):
            text = ",".join(map(str, value))
        elif isinstance(value, list | dict):
            text = f"[{len(value)}]"
        else:
            text = str(value)
        parts.append(f"{key}={' '.join(text.split())}")
    return " ".join(parts)


# -- rendering -------------------------------------------------------------------------------


def render(data: dict[str, Any], *, plain: bool = False) -> RenderableType:
    """The screen: a header line and four tables. `plain`: no borders, for pipes and logs."""
    frame = None if plain else box.SIMPLE_HEAD

    def table(title: str) -> Table:
        return Table(
            title=title,
            title_justify="left",
            box=frame,
            show_edge=False,
            pad_edge=False,
            header_style="" if plain else "bold",
            title_style="" if plain else "bold",
        )

    taken = (
        datetime.fromtimestamp(data["taken_at"] / 1e9, tz=UTC).strftime("%H:%M:%S UTC")
        if data["taken_at"]
        else "-"
    )
    head = Text(f"gpumesh status  {data['nats']}  at {taken}")
    parts: list[RenderableType] = [head]
    if data["error"]:
        parts.append(Text(f"error: {data['error']}", style="bold red"))

    nodes = table(f"nodes ({len(data['nodes'])})")
    for column in ("NODE", "HEALTH", "REASON", "REGION", "GPUS", "MAX TEMP", "DRAINED"):
        nodes.add_column(column, justify="right" if column == "MAX TEMP" else "left")
    for n in data["nodes"]:
        temp = n["max_temperature_c"]
        gpus = f"{n['gpus']}" + (f" {'/'.join(n['gpu_models'])}" if n["gpu_models"] else "")
        nodes.add_row(
            n["node_id"],
            Text(n["health"], style=_HEALTH_STYLE.get(n["health"], "")),
            n["health_reason"],
            n["region"] or "-",
            gpus,
            f"{temp:.0f} C" if temp is not None else "-",
            "yes" if n["drained"] else "no",
        )

    clusters = table(f"clusters ({len(data['clusters'])})")
    for column in ("CLUSTER", "READY", "REVISION", "UNSCHEDULABLE"):
        clusters.add_column(column, justify="right" if column == "REVISION" else "left")
    for c in data["clusters"]:
        short = c["ready"] < c["desired"]
        clusters.add_row(
            c["name"],
            Text(f"{c['ready']}/{c['desired']}", style="yellow" if short else "green"),
            str(c["revision"]),
            Text(c["unschedulable"] or "-", style="red" if c["unschedulable"] else ""),
        )

    replicas = table(f"replicas ({len(data['replicas'])})")
    for column in ("REPLICA", "CLUSTER", "EPOCH", "STATE", "NODE"):
        replicas.add_column(column, justify="right" if column == "EPOCH" else "left")
    for r in data["replicas"]:
        replicas.add_row(
            r["replica_id"],
            r["cluster"],
            str(r["epoch"]),
            Text(r["status"], style=_REPLICA_STYLE.get(r["status"], "yellow")),
            r["node_id"] or "-",
        )

    events = table(f"last {len(data['events'])} events")
    events.add_column("POSITION", justify="right")
    events.add_column("TIME")
    events.add_column("STREAM", no_wrap=True)
    events.add_column("TYPE", no_wrap=True)
    events.add_column("DETAIL", no_wrap=True, overflow="ellipsis", max_width=_DETAIL_WIDTH)
    for e in data["events"]:
        at = datetime.fromtimestamp(e["recorded_at"] / 1e9, tz=UTC).strftime("%H:%M:%S")
        detail = e["detail"]
        if plain and len(detail) > _DETAIL_WIDTH:
            detail = detail[: _DETAIL_WIDTH - 3] + "..."
        events.add_row(str(e["position"]), at, e["stream"], e["type"], detail)

    for part in (nodes, clusters, replicas, events):
        parts += [Text(""), part]
    return Group(*parts)


def render_text(data: dict[str, Any], *, width: int = _PLAIN_WIDTH, plain: bool = True) -> str:
    """The screen as text (no colour, no trailing blanks): `--once` in a pipe, and the tests."""
    console = Console(file=io.StringIO(), record=True, width=width, no_color=True, highlight=False)
    console.print(render(data, plain=plain))
    lines = console.export_text(styles=False).splitlines()
    return "\n".join(line.rstrip() for line in lines) + "\n"


# -- the control API -------------------------------------------------------------------------


class StatusSource:
    """Asks the control API for what the screen shows, on one connection; keeps the last
    events between refreshes and asks only for the ones after them."""

    def __init__(self, bus: Any, url: str, *, events_shown: int = EVENTS_SHOWN) -> None:
        self.bus = bus
        self.url = url
        self._recent: collections.deque[dict[str, Any]] = collections.deque(
            maxlen=max(0, events_shown)
        )
        self._cursor: int | None = None

    async def ask(self, verb: str, body: object) -> Any:
        try:
            raw = await self.bus.request(
                subjects.api(verb), msgspec.json.encode(body), timeout=REQUEST_TIMEOUT_S
            )
        except NoResponders:
            raise CommandFailed(
                f"no controller is answering on {self.url} (is `gpumesh up` or `gpumesh "
                "controller` running? `gpumesh controller status` says who leads)"
            ) from None
        except RequestTimeout:
            raise CommandFailed(
                f"the controller on {self.url} did not answer within {REQUEST_TIMEOUT_S:g} s"
            ) from None
        reply = msgspec.json.decode(raw.data, type=ApiReply)
        if not reply.ok:
            raise CommandFailed(reply.error)
        return reply.data

    async def data(self) -> dict[str, Any]:
        nodes = await self.ask("node.list", {})
        clusters = await self.ask("cluster.list", {})
        await self._catch_up()
        return summarise(
            nodes, clusters, list(self._recent), nats=self.url, taken_at_ns=time.time_ns()
        )

    async def _catch_up(self) -> None:
        if self._recent.maxlen == 0:
            return
        if self._cursor is None:
            head = (await self.ask("events.list", {"after": 0, "limit": 1}))["head"]
            for span in _BACKFILL_SPANS:
                start = max(0, head - span)
                self._recent.clear()
                self._cursor = await self._scan(start)
                if len(self._recent) == self._recent.maxlen or start == 0:
                    break
        else:
            self._cursor = await self._scan(self._cursor)

    async def _scan(self, after: int) -> int:
        """Every non-heartbeat event after `after` into the recent ones; the position read to."""
        for _ in range(_MAX_PAGES):
            page = await self.ask("events.list", {"after": after, "limit": _PAGE})
            self._recent.extend(page["events"])
            if page["next"] <= after or page["next"] >= page["head"]:
                return max(after, int(page["next"]))
            after = int(page["next"])
        return after


# -- the command -----------------------------------------------------------------------------


async def run_status(args: argparse.Namespace) -> int:
    from runtime.shutdown import run_until_signal
    from wire.nats_bus import NatsBus

    url = find_nats_url(args.data_dir, args.nats)
    live = not (args.once or args.json) and sys.stdout.isatty()
    if live and getattr(args, "log_level", None) is None:
        # A log line written over the screen would tear it: only errors, unless asked.
        from .logconfig import configure_logging

        fmt = getattr(args, "log_format", "auto")
        configure_logging(level="error", json=None if fmt == "auto" else fmt == "json")
    bus = await NatsBus.connect(
        url, name="gpumesh-status", credentials=credentials(args, url, "admin")
    )
    try:
        source = StatusSource(bus, url, events_shown=args.events)
        if not live:
            data = await source.data()
            if args.json:
                print(msgspec.json.encode(data).decode())
            elif sys.stdout.isatty():
                Console(highlight=False).print(render(data))
            else:
                width = int(os.environ.get("COLUMNS") or _PLAIN_WIDTH)
                sys.stdout.write(render_text(data, width=width))
            return 0
        console = Console(highlight=False)
        with Live(console=console, screen=True, auto_refresh=False) as screen:
            await run_until_signal(
                watch(bus, source, lambda data: screen.update(render(data), refresh=True))
            )
        return 0
    finally:
        await bus.close()


async def watch(
    bus: Any,
    source: StatusSource,
    show: Callable[[dict[str, Any]], None],
    *,
    debounce_s: float = DEBOUNCE_S,
    idle_s: float = IDLE_REFRESH_S,
) -> None:
    """Show the data, then again after each event (gathering those within `debounce_s` of it)
    or after `idle_s` without one, until cancelled. A failed refresh shows the last data with
    the error and tries again on the next event or after `idle_s`."""
    wake = asyncio.Event()
    subscription = await bus.subscribe(subjects.EVENTS_ALL, handler=lambda _msg: wake.set())
    last: dict[str, Any] = summarise([], [], [], nats=source.url)
    try:
        while True:
            wake.clear()
            try:
                last = await source.data()
            except (CommandFailed, BusError) as exc:
                last = {**last, "error": str(exc), "taken_at": time.time_ns()}
            show(last)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(idle_s):
                    await wake.wait()
            await asyncio.sleep(debounce_s)
    finally:
        await subscription.unsubscribe()
