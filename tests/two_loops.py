"""Two loops for one test: every async test in a package whose conftest imports this runs twice:
on the stock asyncio loop and on the simulator's
virtual-time loop (`[asyncio]` / `[sim]` in the test id). Tests that need real I/O or signals
opt out with `@pytest.mark.asyncio(loop_factories=["asyncio"])`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping

import pytest

from events import MemoryEventStore
from runtime import Env
from runtime.real_env import real_env
from sim import SimEventLoop, sim_env


def pytest_asyncio_loop_factories(
    config: pytest.Config, item: pytest.Item
) -> Mapping[str, Callable[[], asyncio.AbstractEventLoop]]:
    return {"asyncio": asyncio.new_event_loop, "sim": SimEventLoop}


def simulated() -> bool:
    """True under the virtual-time loop: long timeouts cost nothing there."""
    return isinstance(asyncio.get_running_loop(), SimEventLoop)


@pytest.fixture
async def env() -> Env:
    """The production wiring on the real loop, the simulator's on the virtual one."""
    if simulated():
        return sim_env(7)
    return real_env(MemoryEventStore(), seed=7)
