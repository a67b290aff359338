from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from events import EventStore, MemoryEventStore
from events.jetstream_store import JetStreamOptions
from tests.contract.jetstream import drop, fresh_options


@pytest.fixture(params=["memory", "sqlite", "jetstream"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[EventStore]:
    """Every contract test runs against every store. The JetStream store gets a stream of its
    own on a nats-server shared by the session (tests/contract/jetstream.py)."""
    s: EventStore
    stream: JetStreamOptions | None = None
    if request.param == "memory":
        s = MemoryEventStore()
    elif request.param == "sqlite":
        from events.sqlite_store import SqliteEventStore

        s = await SqliteEventStore.open(tmp_path / "events.db")
    else:
        from tests.contract.jetstream import fresh_options, open_store

        stream = fresh_options()
        s = await open_store(stream)
    try:
        yield s
    finally:
        await s.close()
        if stream is not None:
            await drop(stream)


@pytest.fixture
async def options() -> AsyncIterator[JetStreamOptions]:
    """A stream of its own on the shared nats-server, dropped after the test."""
    o = fresh_options()
    try:
        yield o
    finally:
        await drop(o)
