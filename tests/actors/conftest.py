"""Async tests here run on the stock asyncio loop and on the simulator's (tests/two_loops.py)."""

from tests.two_loops import (
    env as env,
    pytest_asyncio_loop_factories as pytest_asyncio_loop_factories,
)
