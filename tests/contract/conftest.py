from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from events import EventStore, MemoryEventStore


@pytest.fixture(params=["memory", "sqlite"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[EventStore]:
    """Every contract test runs against both stores."""
    s: EventStore
    if request.param == "memory":
        s = MemoryEventStore()
    else:
        from events.sqlite_store import SqliteEventStore

        s = await SqliteEventStore.open(tmp_path / "events.db")
    try:
        yield s
    finally:
        await s.close()
