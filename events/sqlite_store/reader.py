"""The reader thread: a second, query-only connection that WAL lets run beside the writer."""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Final

from events.catalog import HEARTBEAT_TYPE
from events.envelope import Envelope
from events.errors import StoreClosed
from events.store import Snapshot

from .failures import translate
from .rows import as_bytes, to_envelope
from .schema import SELECT_EVENTS, STREAM_VERSION

_READ_ALL: Final = f"{SELECT_EVENTS} WHERE position >= ? ORDER BY position LIMIT ?"
# Heartbeats that a later heartbeat of their stream supersedes are skipped in SQLite's C loop.
# ?5 is a JSON array of each stream's latest heartbeat as of position ?3; newer ones are kept.
_LATEST_HEARTBEATS: Final = "SELECT MAX(position) FROM events WHERE type = ? GROUP BY stream"
_READ_FOR_REBUILD: Final = (
    f"{SELECT_EVENTS} WHERE position >= ?1 AND (type != ?4 OR position > ?3 OR position IN "
    "(SELECT value FROM json_each(?5))) ORDER BY position LIMIT ?2"
)
_READ_STREAM: Final = f"{SELECT_EVENTS} WHERE stream = ? AND version >= ? ORDER BY version"


class Reader:
    """The reader thread's connection and queries: every method runs on that thread only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None
        self._latest_heartbeats: tuple[int, str] | None = None  # see read_for_rebuild

    def _connection(self) -> sqlite3.Connection:
        if self._conn is None:
            raise StoreClosed()
        return self._conn

    def open(self) -> None:
        try:
            conn = sqlite3.connect(self.path, isolation_level=None, timeout=5.0)
            conn.execute("PRAGMA query_only = ON")
            conn.execute("PRAGMA cache_size = -65536")
        except sqlite3.Error as exc:
            raise translate(self.path, exc) from exc
        self._conn = conn

    def close(self) -> None:
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def read_all(self, from_position: int, limit: int) -> list[Envelope]:
        rows = self._connection().execute(_READ_ALL, (from_position, limit)).fetchall()
        return [to_envelope(row) for row in rows]

    def read_for_rebuild(self, from_position: int, limit: int) -> list[Envelope]:
        conn = self._connection()
        if from_position <= 1 or self._latest_heartbeats is None:
            # Computed once per rebuild; heartbeats committed later are newer than `as_of`.
            as_of = self.head()
            latest = [row[0] for row in conn.execute(_LATEST_HEARTBEATS, (HEARTBEAT_TYPE,))]
            self._latest_heartbeats = (as_of, json.dumps(latest))
        as_of, latest_json = self._latest_heartbeats
        rows = conn.execute(
            _READ_FOR_REBUILD, (from_position, limit, as_of, HEARTBEAT_TYPE, latest_json)
        ).fetchall()
        return [to_envelope(row) for row in rows]

    def read_stream(self, stream: str, from_version: int) -> list[Envelope]:
        rows = self._connection().execute(_READ_STREAM, (stream, from_version)).fetchall()
        return [to_envelope(row) for row in rows]

    def stream_version(self, stream: str) -> int:
        found = self._connection().execute(STREAM_VERSION, (stream,)).fetchone()[0]
        return int(found or 0)

    def head(self) -> int:
        found = self._connection().execute("SELECT MAX(position) FROM events").fetchone()[0]
        return int(found or 0)

    def load_snapshot(self, stream: str) -> Snapshot | None:
        row = (
            self._connection()
            .execute("SELECT version, schema, state FROM snapshots WHERE stream = ?", (stream,))
            .fetchone()
        )
        if row is None:
            return None
        return Snapshot(stream=stream, version=row[0], schema=row[1], state=as_bytes(row[2]))
