"""The file's tables, the migrations that build them, and the column order every query shares."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Final

import sqlite_utils

from events.errors import StoreIOError

from .failures import rollback

SCHEMA_VERSION: Final = 1
"""Stored in PRAGMA user_version; bump it and add a step to _MIGRATIONS for every change."""

# The order of a row everywhere: the writer binds it, the readers decode it (see rows.py).
COLUMNS: Final = (
    "position, event_id, stream, version, type, recorded_at, correlation_id, causation_id, data"
)
SELECT_EVENTS: Final = f"SELECT {COLUMNS} FROM events"
STREAM_VERSION: Final = "SELECT MAX(version) FROM events WHERE stream = ?"


def _migrate_to_1(db: sqlite_utils.Database) -> None:
    events = db.table("events")
    events.create(
        {
            "position": int,
            "event_id": str,
            "stream": str,
            "version": int,
            "type": str,
            "recorded_at": int,
            "correlation_id": str,
            "causation_id": str,
            "data": bytes,
        },
        pk="position",
        not_null={"event_id", "stream", "version", "type", "recorded_at"},
    )
    events.create_index(["event_id"], index_name="events_event_id", unique=True)
    events.create_index(["stream", "version"], index_name="events_stream_version", unique=True)
    db.table("snapshots").create(
        {"stream": str, "version": int, "schema": str, "state": bytes},
        pk="stream",
        not_null={"version", "schema", "state"},
    )


# _MIGRATIONS[n] takes a file at user_version n to n + 1.
_MIGRATIONS: Final[dict[int, Callable[[sqlite_utils.Database], None]]] = {0: _migrate_to_1}


def migrate(conn: sqlite3.Connection, path: Path) -> None:
    """Bring the file at `path`, open on the writer's `conn`, up to SCHEMA_VERSION."""
    if int(conn.execute("PRAGMA user_version").fetchone()[0]) == SCHEMA_VERSION:
        # Current already: take no write lock, so opening beside a live writer (e.g.
        # `gpumesh events tail`) does not wait for it.
        return
    db = sqlite_utils.Database(conn, execute_plugins=False)
    conn.execute("BEGIN IMMEDIATE")
    try:
        version = int(conn.execute("PRAGMA user_version").fetchone()[0])
        if version > SCHEMA_VERSION:
            raise StoreIOError(
                f"event store {path} has schema version {version}; this build "
                f"understands up to {SCHEMA_VERSION}: upgrade gpumesh"
            )
        while version < SCHEMA_VERSION:
            _MIGRATIONS[version](db)
            version += 1
        conn.execute(f"PRAGMA user_version = {version}")
        conn.execute("COMMIT")
    except BaseException:
        rollback(conn)
        raise
