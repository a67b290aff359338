"""The controller asks the command queue again while NATS cannot take a send (a command stream
electing its leader fails every publish for a few seconds): a StartReplica given up then was
never sent again, and its replica never started. A fenced refusal is not asked again."""

from __future__ import annotations

import pytest
import structlog

import actors.controller as controller_module
from actors.fenced_store import Deposed
from events.contract.messages import StopReplica
from runtime.env import BusError


class Flaky:
    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures = failures
        self.error = error or BusError("no JetStream stream captures gpumesh.v1.node.n.cmd")
        self.tries = 0
        self.sent: list[str] = []

    async def send(self, node_id: str, command: StopReplica) -> None:
        self.tries += 1
        if self.tries <= self.failures:
            raise self.error
        self.sent.append(command.command_id)

    def consume(self, node_id: str) -> object:
        raise NotImplementedError


def command() -> StopReplica:
    return StopReplica(command_id="stop-r-1", replica_id="r", epoch=1, reason="test")


@pytest.fixture(autouse=True)
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(controller_module, "_COMMAND_RETRY_FIRST_S", 0.001)
    monkeypatch.setattr(controller_module, "_COMMAND_RETRY_MAX_S", 0.002)
    monkeypatch.setattr(controller_module, "_COMMAND_RETRY_FOR_S", 0.05)


async def test_a_send_nats_cannot_take_now_is_asked_again() -> None:
    queue = Flaky(failures=3)
    persistent = controller_module._Persistent(queue, log=structlog.get_logger())  # type: ignore[arg-type]
    await persistent.send("n", command())
    assert queue.tries == 4 and queue.sent == ["stop-r-1"]


async def test_it_gives_up_after_a_while() -> None:
    queue = Flaky(failures=10_000)
    persistent = controller_module._Persistent(queue, log=structlog.get_logger())  # type: ignore[arg-type]
    with pytest.raises(BusError):
        await persistent.send("n", command())
    assert 2 < queue.tries < 200


async def test_a_fenced_refusal_is_not_asked_again() -> None:
    queue = Flaky(failures=1, error=Deposed("term 3: the lease may have expired"))
    persistent = controller_module._Persistent(queue, log=structlog.get_logger())  # type: ignore[arg-type]
    with pytest.raises(Deposed):
        await persistent.send("n", command())
    assert queue.tries == 1
