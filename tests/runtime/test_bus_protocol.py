"""The Bus protocol is whole or refused: a caller never guesses what an adapter can tell."""

from __future__ import annotations

import random
from typing import Any

import pytest

from events import MemoryEventStore
from runtime.env import BUS_MEMBERS, Bus, NoBus, check_bus
from runtime.real_env import real_env
from sim.bus import MemoryBus
from sim.network import SimNetwork
from wire.nats_bus import NatsBus


def test_every_adapter_has_every_member() -> None:
    for adapter in (NatsBus, MemoryBus, NoBus):
        missing = [name for name in BUS_MEMBERS if not hasattr(adapter, name)]
        assert missing == [], adapter.__name__
    check_bus(SimNetwork(random.Random(1)).endpoint("a"))


def test_the_members_are_the_protocols() -> None:
    declared = {name for name in dir(Bus) if not name.startswith("_") and name not in dir(object)}
    assert declared == set(BUS_MEMBERS)


class WithoutConnectionState:
    """A bus that cannot say whether it is connected: a controller on it would declare every
    node offline while cut off from NATS, so it must be refused, not guessed about."""

    async def publish(self, subject: str, data: bytes, **kw: Any) -> None: ...
    async def subscribe(self, subject: str, **kw: Any) -> Any: ...
    async def request(self, subject: str, data: bytes, **kw: Any) -> Any: ...
    def new_inbox(self) -> str:
        return "_INBOX.x"


def test_an_adapter_lacking_a_member_is_refused_when_the_env_is_built() -> None:
    with pytest.raises(TypeError) as caught:
        real_env(MemoryEventStore(), bus=WithoutConnectionState(), seed=1)  # type: ignore[arg-type]
    assert str(caught.value) == (
        "WithoutConnectionState is not a Bus: it lacks is_connected, max_payload, "
        "add_reconnect_callback, remove_reconnect_callback"
    )


def test_a_bound_env_keeps_its_checked_bus() -> None:
    env = real_env(MemoryEventStore(), bus=MemoryBus(), seed=1)
    assert env.bind(node="n1").bus is env.bus
