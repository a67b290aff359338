"""Durable per-node command queues: the controller sends, each node's agent consumes and acks.

A command sent while the node is disconnected waits for it; an unacknowledged command is
delivered again; a command id seen twice is a duplicate. Production: JetStream
(wire/nats_commands.py); simulator and unit tests: sim/commands.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from events.contract.messages import Command


class Delivery(Protocol):
    @property
    def command(self) -> Command: ...

    async def ack(self) -> None:
        """Acknowledge after acting: until then the command will be delivered again."""
        ...


class CommandQueue(Protocol):
    async def send(self, node_id: str, command: Command) -> None:
        """Durably enqueue for `node_id`; re-sending the same command_id is a no-op."""
        ...

    def consume(self, node_id: str) -> AsyncIterator[Delivery]:
        """Deliver `node_id`'s commands in order, starting with the oldest unacknowledged."""
        ...
