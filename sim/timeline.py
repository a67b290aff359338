"""When a scenario's faults start and when what they did ends: the one timeline that the
simulator (sim/faults.py, on virtual time), `gpumesh chaos` (on wall time) and chaos's dry-run
plan all walk, so a fault and an end due at the same instant come in the same order in each.

A runner walks `FaultTimeline.steps(faults, until=...)`: it waits until each step's `at`, then
applies the fault of a `Start`, or undoes the effect of an `End`. When it applies a fault it
registers what ends it with `ends_after` (one per victim, say). An effect due at or before a
fault's start ends before that fault starts; effects due at the same instant end in the order
of their names (`what`), then in the order they were registered. `steps` stops after the
effects due by `until` (when the faults stop); `cut()` hands over the ones still in effect then.

Nothing here sleeps or reads a clock: times are in whatever unit the runner uses (virtual
seconds in the simulator, the scenario's seconds in chaos, which divides them by --speed only
to sleep, so rounding never reorders an end and a fault that the scenario puts at one instant).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from .scenario import FaultPlan

U = TypeVar("U")


@dataclass(frozen=True, slots=True)
class Start:
    """`fault` starts at `at` (its own `at_s`)."""

    at: float
    fault: FaultPlan


@dataclass(frozen=True, slots=True)
class End(Generic[U]):
    """An effect of a fault ends at `at`: the runner undoes it with `undo`."""

    at: float
    what: str  # "power_loss node-3": what the runner's timeline says ends
    undo: U = field(compare=False)
    order: int = 0  # registration order: the last tie-break


class FaultTimeline(Generic[U]):
    """The effects in force and when each ends; `U` is whatever undoes one (a callable)."""

    def __init__(self) -> None:
        self._pending: list[End[U]] = []
        self._registered = 0

    def steps(self, faults: Sequence[FaultPlan], *, until: float) -> Iterator[Start | End[U]]:
        """The faults in the given order, each after the ends due at or before it, then the
        ends due by `until`. Lazy: an effect registered while a step is handled is seen by the
        steps after it."""
        for fault in faults:
            yield from self._due(fault.at_s)
            yield Start(fault.at_s, fault)
        yield from self._due(until)

    def ends_after(self, fault: FaultPlan, started: float, what: str, undo: U) -> None:
        """An effect of `fault`, which started at `started` (the runner's clock), ends
        `duration_s` later; a fault with no duration lasts until the faults stop (`cut`)."""
        if fault.duration_s is None:
            return
        self._registered += 1
        self._pending.append(End(started + fault.duration_s, what, undo, self._registered))

    def cut(self) -> list[End[U]]:
        """The faults stop: every effect still in force, by due time then registration, and
        none is left pending."""
        ends = sorted(self._pending, key=lambda e: (e.at, e.order))
        self._pending.clear()
        return ends

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _due(self, by: float) -> Iterator[End[U]]:
        while True:
            due = [e for e in self._pending if e.at <= by]
            if not due:
                return
            first = min(due, key=lambda e: (e.at, e.what, e.order))
            self._pending.remove(first)
            yield first
