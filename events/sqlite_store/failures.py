"""How SQLite's failures are told apart: a storage failure fails a whole transaction and leaves
as StoreFull or StoreIOError; a row failure belongs to one append and fails it alone."""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Final

from events.errors import EventStoreError, StoreFull, StoreIOError

# Failures that belong to one append's rows, not to the storage: the batch is replayed with a
# SAVEPOINT per append so only the append that caused one fails. IntegrityError is a UNIQUE or
# NOT NULL constraint; the others are values SQLite cannot bind.
ROW_ERRORS: Final = (
    sqlite3.IntegrityError,
    sqlite3.InterfaceError,
    sqlite3.ProgrammingError,
    OverflowError,
    TypeError,
    ValueError,
)


def is_disk_full(exc: sqlite3.Error) -> bool:
    code = getattr(exc, "sqlite_errorcode", None)
    if isinstance(code, int):
        return code & 0xFF == sqlite3.SQLITE_FULL
    return "database or disk is full" in str(exc)


def translate(path: Path, exc: sqlite3.Error) -> EventStoreError:
    """sqlite3 exceptions never leave the store: callers see these instead."""
    if is_disk_full(exc):
        return StoreFull(str(path))
    return StoreIOError(f"event store {path}: {type(exc).__name__}: {exc}")


def rollback(conn: sqlite3.Connection) -> None:
    # After SQLITE_FULL or an I/O error SQLite may already have rolled back by itself.
    if conn.in_transaction:
        try:
            conn.execute("ROLLBACK")
        except sqlite3.Error:
            pass
