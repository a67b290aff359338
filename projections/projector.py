"""Follows the log into FleetState and persists it, checkpoint and read model in one transaction.

On restart it loads the checkpoint and resumes from the next position; an event at or below the
checkpoint is a replay and changes nothing (projections.fleet.apply). The read-model database is
rebuildable from the log, so it runs with synchronous=NORMAL.
"""

from __future__ import annotations

import asyncio
import contextlib
import sqlite3
from pathlib import Path

import msgspec
import sqlite_utils

from events import EventStore

from . import fleet
from .catch_up import fold_log
from .views import FleetState

CHECKPOINT_NAME = "fleet"


class ReadModelError(Exception):
    """The read-model database cannot be read or written. The event log is not affected."""

    def __init__(self, path: Path, exc: sqlite3.Error) -> None:
        self.path = path
        full = "full" in str(exc)
        super().__init__(
            f"read model {path} cannot be written: {exc} (the event log is untouched; "
            + ("free space, then " if full else "")
            + "run `gpumesh events rebuild` to recreate it)"
        )


class Projector:
    def __init__(
        self,
        store: EventStore,
        db_path: Path | None,
        *,
        page_size: int = 10_000,
    ) -> None:
        self.store = store
        self.db_path = db_path
        self.page_size = page_size
        self.state = FleetState()
        self.flushed_position = 0

    async def load(self) -> None:
        """Restore the last checkpointed state, if there is one."""
        if self.db_path is None or not self.db_path.exists():
            return
        try:
            row = await asyncio.to_thread(_read_checkpoint, self.db_path)
        except sqlite3.Error as exc:
            raise ReadModelError(self.db_path, exc) from exc
        if row is not None:
            self.state = fleet.restore(row)
            self.flushed_position = self.state.position

    async def catch_up(self, *, skip_superseded_heartbeats: bool = False) -> int:
        """Fold everything committed so far; flush; return how many events were folded.

        With `skip_superseded_heartbeats` (a store that is a RebuildReader), heartbeats that a
        later one of the same node supersedes are not even decoded: the state is the same.
        """
        folded = await fold_log(
            self.store,
            self.state,
            page_size=self.page_size,
            skip_superseded_heartbeats=skip_superseded_heartbeats,
        )
        await self.flush()
        return folded

    async def run(self) -> None:
        """Catch up, then follow the log until cancelled, flushing whenever it is caught up."""
        await self.load()
        while True:
            await self.catch_up()
            # Wait for the next commit, then go back to paging (cheaper than one event at a time).
            async with contextlib.aclosing(self.store.subscribe(self.state.position + 1)) as live:
                async for envelope in live:
                    fleet.apply(self.state, envelope)
                    break
                else:
                    return  # the store closed

    async def flush(self) -> None:
        if self.db_path is None or self.state.position == self.flushed_position:
            return
        blob = fleet.snapshot(self.state)
        position = self.state.position
        try:
            await asyncio.to_thread(_write_checkpoint, self.db_path, blob, self.state)
        except sqlite3.Error as exc:
            raise ReadModelError(self.db_path, exc) from exc
        self.flushed_position = position


async def load_checkpoint(path: Path) -> FleetState | None:
    """The state a read model was last written with (its position inside), None if none."""
    try:
        row = await asyncio.to_thread(lambda: _read_checkpoint(path) if path.exists() else None)
    except sqlite3.Error as exc:
        raise ReadModelError(path, exc) from exc
    return fleet.restore(row) if row is not None else None


async def save_checkpoint(path: Path, state: FleetState) -> int:
    """Write `state` as the read model and its checkpoint; returns the position written.

    For a state that keeps changing while this runs (a controller's live state): it is
    snapshot here, in the loop, and the thread writes a copy decoded from the snapshot."""
    blob, position = fleet.snapshot(state), state.position

    def write() -> None:
        _write_checkpoint(path, blob, fleet.restore(blob))

    try:
        await asyncio.to_thread(write)
    except sqlite3.Error as exc:
        raise ReadModelError(path, exc) from exc
    return position


def _connect(path: Path) -> sqlite3.Connection:
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    conn.execute("PRAGMA synchronous=NORMAL")
    return conn


def _read_checkpoint(path: Path) -> bytes | None:
    conn = _connect(path)
    try:
        db = sqlite_utils.Database(conn)
        if "checkpoints" not in db.table_names():
            return None
        row = conn.execute(
            "SELECT state FROM checkpoints WHERE name = ?", (CHECKPOINT_NAME,)
        ).fetchone()
        return bytes(row[0]) if row else None
    finally:
        conn.close()


def _write_checkpoint(path: Path, blob: bytes, state: FleetState) -> None:
    """Checkpoint and every read-model table in ONE transaction: they can never disagree."""
    conn = _connect(path)
    try:
        db = sqlite_utils.Database(conn)
        _ensure_schema(db)
        conn.execute("BEGIN IMMEDIATE")
        try:
            conn.execute(
                "INSERT INTO checkpoints(name, position, schema, state) VALUES (?, ?, ?, ?) "
                "ON CONFLICT(name) DO UPDATE SET position=excluded.position, "
                "schema=excluded.schema, state=excluded.state",
                (CHECKPOINT_NAME, state.position, fleet.SNAPSHOT_SCHEMA, blob),
            )
            for table in ("nodes", "clusters", "replicas", "routes"):
                conn.execute(f"DELETE FROM {table}")
            conn.executemany(
                "INSERT INTO nodes VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                [
                    (
                        n.node_id,
                        n.health,
                        n.health_reason,
                        n.region,
                        len(n.gpus),
                        n.last_heartbeat_at,
                        int(n.drained),
                        n.version,
                    )
                    for n in state.nodes.nodes.values()
                ],
            )
            conn.executemany(
                "INSERT INTO clusters VALUES (?, ?, ?)",
                [
                    (c.spec.name, c.spec.replicas, msgspec.json.encode(c.spec).decode())
                    for c in state.clusters.clusters.values()
                ],
            )
            conn.executemany(
                "INSERT INTO replicas VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (r.replica_id, r.cluster, r.node_id, r.epoch, r.status, r.address)
                    for r in state.replicas.replicas.values()
                ],
            )
            conn.executemany(
                "INSERT INTO routes VALUES (?, ?, ?, ?, ?)",
                [
                    (cluster, r.replica_id, r.node_id, r.address, r.epoch)
                    for cluster, routes in state.routing.routes.items()
                    for r in routes
                ],
            )
            conn.execute("COMMIT")
        except BaseException:
            conn.execute("ROLLBACK")
            raise
    finally:
        conn.close()


def _ensure_schema(db: sqlite_utils.Database) -> None:
    existing = set(db.table_names())
    if "checkpoints" not in existing:
        db.table("checkpoints").create(
            {"name": str, "position": int, "schema": str, "state": bytes}, pk="name"
        )
    if "nodes" not in existing:
        db.table("nodes").create(
            {
                "node_id": str,
                "health": str,
                "health_reason": str,
                "region": str,
                "gpus": int,
                "last_heartbeat_at": int,
                "drained": int,
                "version": int,
            },
            pk="node_id",
        )
    if "clusters" not in existing:
        db.table("clusters").create({"name": str, "replicas": int, "spec": str}, pk="name")
    if "replicas" not in existing:
        db.table("replicas").create(
            {
                "replica_id": str,
                "cluster": str,
                "node_id": str,
                "epoch": int,
                "status": str,
                "address": str,
            },
            pk="replica_id",
        )
    if "routes" not in existing:
        db.table("routes").create(
            {"cluster": str, "replica_id": str, "node_id": str, "address": str, "epoch": int},
            pk=("cluster", "replica_id"),
        )
