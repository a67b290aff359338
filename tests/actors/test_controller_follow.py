"""A standby follows the log again after a read fails (actors/controller_process.py): cut off
from NATS for a while, its reads time out; once NATS answers it must follow on, or it would
take over from a state long behind."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from actors.controller import ControllerConfig
from actors.controller_process import ControllerProcess, ProcessConfig
from actors.live_state import LiveState
from events import MemoryEventStore, NodeRegistered
from events.envelope import Envelope
from events.errors import StoreIOError
from runtime.real_env import LoopClock
from tests.factories import EventMaker


class FlakyReads(MemoryEventStore):
    """Its first subscriptions fail as a read through a stalled connection does."""

    def __init__(self, failures: int) -> None:
        super().__init__()
        self.failures = failures

    def subscribe_batches(self, from_position: int = 1) -> AsyncGenerator[list[Envelope], None]:
        if self.failures > 0:
            self.failures -= 1
            return self._failing()
        return super().subscribe_batches(from_position)

    async def _failing(self) -> AsyncGenerator[list[Envelope], None]:
        raise StoreIOError("event store on NATS stream GPUMESH_LOG: no answer within 10 s")
        yield []  # pragma: no cover (makes this an async generator)


async def test_a_standby_follows_again_after_its_reads_failed() -> None:
    store = FlakyReads(failures=2)
    said: list[tuple[str, dict[str, Any]]] = []

    class Log:
        def info(self, event: str, **fields: Any) -> None:
            said.append((event, fields))

    class NoNats:  # only the follower runs here
        def jetstream(self, **_: Any) -> None:
            return None

    process = ControllerProcess(
        NoNats(),  # type: ignore[arg-type]
        LoopClock(),
        ProcessConfig(controller=ControllerConfig(), log="jetstream"),
        log=Log(),
    )
    process.live = LiveState(store)
    process._follow()
    make = EventMaker()
    await store.append("node/a", [make(NodeRegistered(node_id="a"))], 0)
    async with asyncio.timeout(10):
        await process.live.wait_for(1)
    await process._stop_following()
    assert [event for event, _ in said] == ["follow_failed", "follow_failed"]
    assert said[0][1]["attempt"] == 1 and "no answer" in said[0][1]["error"]
