"""The production Env: the asyncio loop's clock, the OS wall clock, a seeded random source.

This is the one module of runtime/ allowed to read the wall clock and OS entropy.
"""

from __future__ import annotations

import asyncio
import os
import random
import time

from events import EventStore

from .env import Bus, Env, NoBus, RandomSource


class LoopClock:
    """Monotonic time from the running loop (so virtual loops stay in charge), wall from the OS."""

    def monotonic(self) -> float:
        return asyncio.get_running_loop().time()

    def wall_ns(self) -> int:
        return time.time_ns()


def seeded_rng_factory(root_seed: int) -> _Derive:
    return _Derive(root_seed)


class _Derive:
    def __init__(self, root_seed: int) -> None:
        self.root_seed = root_seed

    def __call__(self, component: str) -> RandomSource:
        # String seeds are hashed with SHA-512 by random.Random: stable across processes.
        return random.Random(f"{self.root_seed}:{component}")


def real_env(store: EventStore, *, bus: Bus | None = None, seed: int | None = None) -> Env:
    """Production wiring. The seed comes from OS entropy unless given, and is logged by callers."""
    root = seed if seed is not None else int.from_bytes(os.urandom(8), "big")
    derive = seeded_rng_factory(root)
    return Env(
        clock=LoopClock(),
        rng=derive("root"),
        store=store,
        derive_rng=derive,
        bus=bus if bus is not None else NoBus(),
    )
