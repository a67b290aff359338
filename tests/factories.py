"""Deterministic event construction for tests: a counting clock and a seeded random source."""

from __future__ import annotations

import random

from events import DomainEvent, NewEvent, new_event

EPOCH_NS = 1_750_000_000_000_000_000


class EventMaker:
    def __init__(self, seed: int = 7, start_ns: int = EPOCH_NS, step_ns: int = 1_000_000) -> None:
        self.rng = random.Random(seed)
        self.now_ns = start_ns
        self.step_ns = step_ns

    def __call__(self, payload: DomainEvent, *, at_ns: int | None = None) -> NewEvent:
        if at_ns is None:
            self.now_ns += self.step_ns
            at_ns = self.now_ns
        return new_event(payload, wall_ns=at_ns, entropy=self.rng)


class ManualClock:
    """A clock a test moves by hand (`clock.now += 2.0`): the injected Clock of a pure part."""

    def __init__(self, now: float = 100.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def wall_ns(self) -> int:
        return int(self.now * 1e9)
