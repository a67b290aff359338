"""Part (c) of bench/eventstore.py: rebuild every projection from a large log.

The log is a synthetic fleet history (events/synthetic.py) written straight into the store's
schema, since this part measures the rebuild, not the append path. The rebuild is the real
`gpumesh events rebuild --json`, run in a child process so its peak RSS is its own.
"""

from __future__ import annotations

import asyncio
import json
import random
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from events.codec import encode_payload
from events.sqlite_store import SqliteEventStore
from events.synthetic import fleet_history

TARGET_SECONDS = 3.0


def write_log(path: Path, events: int, nodes: int) -> float:
    """Write `events` synthetic events into a fresh store file; return seconds taken."""
    started = time.perf_counter()

    async def create() -> None:
        store = await SqliteEventStore.open(path, synchronous="OFF")
        await store.close()

    asyncio.run(create())
    conn = sqlite3.connect(path)
    conn.execute("PRAGMA synchronous=OFF")
    rows = []
    for position, step in enumerate(
        fleet_history(random.Random(42), nodes=nodes, clusters=5, limit=events), start=1
    ):
        e = step.event
        rows.append(
            (
                position,
                e.event_id,
                step.stream,
                step.expected_version + 1,
                e.type,
                e.recorded_at,
                e.correlation_id,
                e.causation_id,
                encode_payload(e.payload),
            )
        )
        if len(rows) == 50_000:
            _flush(conn, rows)
    _flush(conn, rows)
    conn.close()
    return time.perf_counter() - started


def _flush(conn: sqlite3.Connection, rows: list[tuple[Any, ...]]) -> None:
    conn.executemany(
        "INSERT INTO events (position, event_id, stream, version, type, recorded_at, "
        "correlation_id, causation_id, data) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        rows,
    )
    conn.commit()
    rows.clear()


def rebuild(data_dir: Path, *, full: bool) -> dict[str, Any]:
    (data_dir / "projections.db").unlink(missing_ok=True)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "gpumesh",
            "events",
            "rebuild",
            "--json",
            "--data-dir",
            str(data_dir),
            *(["--full"] if full else []),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def run(workdir: Path, events: int, nodes: int = 1_000) -> dict[str, Any]:
    data_dir = workdir / f"rebuild-{events}"
    data_dir.mkdir(parents=True, exist_ok=True)
    log = data_dir / "events.db"
    for suffix in ("", "-wal", "-shm"):
        Path(f"{log}{suffix}").unlink(missing_ok=True)
    write_seconds = write_log(log, events, nodes)
    result = rebuild(data_dir, full=False)
    full = rebuild(data_dir, full=True)
    same = ("position", "nodes", "clusters", "replicas", "routes")
    assert {k: result[k] for k in same} == {k: full[k] for k in same}, "modes disagree"
    return {
        "events": result["events"],
        "nodes": result["nodes"],
        "log_mib": round(log.stat().st_size / 2**20, 1),
        "write_seconds": round(write_seconds, 2),
        "rebuild_seconds": result["seconds"],
        "rebuild_events_per_second": result["events_per_second"],
        "decoded": result["decoded"],
        "peak_rss_mib": result["peak_rss_mib"],
        "full_rebuild_seconds": full["seconds"],
        "full_rebuild_peak_rss_mib": full["peak_rss_mib"],
        "target_seconds_per_million": TARGET_SECONDS,
        "meets_target": result["seconds"] * 1_000_000 / max(1, result["events"]) <= TARGET_SECONDS,
    }
