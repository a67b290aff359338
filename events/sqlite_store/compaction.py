"""Heartbeat compaction: the one write that deletes, run by the writer in a transaction alone."""

from __future__ import annotations

import sqlite3
from typing import Final

from events.catalog import HEARTBEAT_TYPE

from .jobs import Compact
from .rows import clamp

# The latest heartbeat of every stream survives whatever its age, as in the memory store.
_COMPACT: Final = (
    "DELETE FROM events WHERE type = ? AND recorded_at < ? AND position NOT IN "
    "(SELECT MAX(position) FROM events WHERE type = ? GROUP BY stream)"
)


def compact(conn: sqlite3.Connection, job: Compact) -> None:
    """Delete and commit, then record the count in `job`. Raises sqlite3.Error, rolling back
    nothing: the writer's failure path does that."""
    conn.execute("BEGIN IMMEDIATE")
    cutoff = clamp(job.older_than_ns)
    removed = conn.execute(_COMPACT, (HEARTBEAT_TYPE, cutoff, HEARTBEAT_TYPE)).rowcount
    conn.execute("COMMIT")
    # The latest event of a stream is never deleted, so the writer's cached versions stay right.
    job.removed = removed
