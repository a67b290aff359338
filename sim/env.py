"""Build the Env a simulated run hands to its actors: virtual clock, seeded randomness."""

from __future__ import annotations

import random
from typing import final

from events import EventStore, MemoryEventStore
from runtime.env import Bus, Env, NoBus, RandomSource

from .clock import SimClock


@final
class SeededStreams:
    """One random.Random per component, derived from the run seed.

    String seeds are hashed with SHA-512 by random.Random, so the streams do not depend on
    PYTHONHASHSEED, and adding a component leaves the others' draws unchanged.
    """

    def __init__(self, seed: int) -> None:
        self.seed = seed

    def __call__(self, component: str) -> RandomSource:
        return random.Random(f"{self.seed}:{component}")


def sim_env(seed: int, store: EventStore | None = None, *, bus: Bus | None = None) -> Env:
    """An Env for a simulated run: SimClock, streams derived from `seed`, a MemoryEventStore."""
    derive = SeededStreams(seed)
    return Env(
        clock=SimClock(),
        rng=derive("root"),
        store=store if store is not None else MemoryEventStore(),
        derive_rng=derive,
        bus=bus if bus is not None else NoBus(),
    )
