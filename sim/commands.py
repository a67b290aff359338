"""An in-memory CommandQueue with the durable semantics of the JetStream one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from events.contract.messages import Command
from events.ids import valid_id


@dataclass
class _NodeQueue:
    commands: list[Command] = field(default_factory=list)
    acked: int = 0  # commands[:acked] are acknowledged
    ids: set[str] = field(default_factory=set)
    changed: asyncio.Event = field(default_factory=asyncio.Event)


class MemoryDelivery:
    def __init__(self, queue: _NodeQueue, index: int, command: Command) -> None:
        self._queue = queue
        self._index = index
        self._command = command

    @property
    def command(self) -> Command:
        return self._command

    async def ack(self) -> None:
        self._queue.acked = max(self._queue.acked, self._index + 1)


class MemoryCommandQueue:
    def __init__(self) -> None:
        self._queues: dict[str, _NodeQueue] = {}

    def _queue(self, node_id: str) -> _NodeQueue:
        return self._queues.setdefault(node_id, _NodeQueue())

    async def send(self, node_id: str, command: Command) -> None:
        if not valid_id(node_id):
            # The same refusal as the JetStream queue, so tests catch what production would.
            raise ValueError(f"invalid node id {node_id!r}: use 1-128 of [A-Za-z0-9_-]")
        q = self._queue(node_id)
        # Per term, as the JetStream queue's Nats-Msg-Id: a new leader's re-send of what an
        # older one sent is a command of its own.
        key = f"{command.command_id}@{command.term}"
        if key in q.ids:
            return
        q.ids.add(key)
        q.commands.append(command)
        q.changed.set()

    def pending(self, node_id: str) -> list[Command]:
        q = self._queue(node_id)
        return q.commands[q.acked :]

    def consume(self, node_id: str) -> AsyncIterator[MemoryDelivery]:
        return self._consume(self._queue(node_id))

    async def _consume(self, q: _NodeQueue) -> AsyncIterator[MemoryDelivery]:
        # A new consumer starts at the oldest unacknowledged command: redelivery after a crash.
        index = q.acked
        while True:
            while index < len(q.commands):
                yield MemoryDelivery(q, index, q.commands[index])
                index += 1
            q.changed.clear()
            await q.changed.wait()
