"""A full disk under the event log (real SQLite, real time): the controller refuses writes in
one line, keeps serving reads and keeps its nodes healthy, and takes writes again as soon as
space returns, with the log still equal to live state."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path

import projections
from events.sqlite_store import SqliteEventStore
from tests.control.harness import fleet

SPEC = {"name": "llama", "replicas": 1, "command": "gpumesh workload echo --port {port}"}


def _fill(conn: sqlite3.Connection) -> int:
    # No page beyond those in use: the next write that needs one fails with SQLITE_FULL.
    pages = int(conn.execute("PRAGMA page_count").fetchone()[0])
    return int(conn.execute(f"PRAGMA max_page_count = {pages}").fetchone()[0])


def _free(conn: sqlite3.Connection) -> int:
    return int(conn.execute("PRAGMA max_page_count = 1073741823").fetchone()[0])


def test_a_full_disk_refuses_writes_serves_reads_and_recovers(tmp_path: Path) -> None:
    async def main() -> None:
        store = await SqliteEventStore.open(tmp_path / "events.db")
        try:
            async with fleet(2, store=store) as f:  # type: ignore[arg-type]
                assert (await f.api("cluster.create", SPEC)).ok
                await f.until(lambda: len(f.ready("llama")) == 1, within=10, why="1 ready")
                await store.run_on_writer(_fill)
                # Heartbeats keep coming; wait until a write has certainly been refused.
                dropped = f.controller.dropped
                await f.until(lambda: dropped["heartbeat_store_error"] > 0, within=5, why="refused")

                refused = await f.api("cluster.scale", {"name": "llama", "replicas": 2})
                assert not refused.ok
                assert "disk is full" in refused.error and "\n" not in refused.error
                refused = await f.api("cluster.create", {**SPEC, "name": "other"})
                assert not refused.ok and "disk is full" in refused.error
                for verb, body in (
                    ("cluster.list", {}),
                    ("cluster.get", {"name": "llama"}),
                    ("node.list", {}),
                    ("routing.get", {}),
                    ("events.list", {"limit": 5}),
                ):
                    answer = await f.api(verb, body)
                    assert answer.ok, (verb, answer.error)
                # Longer than the offline window (3 missed 1 s beats): nobody is declared
                # offline for the controller's own disk, and the controller is still up.
                await asyncio.sleep(3.5)
                assert {n.health for n in f.state.nodes.nodes.values()} == {"healthy"}
                assert (await f.api("cluster.list")).ok

                await store.run_on_writer(_free)
                scaled = await f.api("cluster.scale", {"name": "llama", "replicas": 2})
                assert scaled.ok, scaled.error
                await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="2 ready")
                everything = await store.read_all(1, 1_000_000)
                assert projections.rebuild(everything) == f.state
        finally:
            await store.close()

    asyncio.run(main())
