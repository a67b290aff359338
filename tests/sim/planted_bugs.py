"""Bugs the simulator's tests plant in production code from outside, to prove the checkers
find them: production code carries no switch for them."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import pytest

from actors import cluster_actor, scheduler
from events import ClusterSpec
from projections.views import NodeView, ReplicaView
from runtime.env import RandomSource

Schedule = Callable[..., Any]


def stacking(real: Schedule) -> Schedule:
    """`real`, but preferring nodes that already hold a replica of the cluster: the spread
    invariant (never two replicas of one cluster on one node when it can be avoided) must
    catch it from the second placement on a node with a GPU to spare."""

    def schedule(
        nodes: Sequence[NodeView],
        spec: ClusterSpec,
        placements: Sequence[ReplicaView],
        rng: RandomSource,
        *,
        avoid: Collection[str] = (),
        now_ns: int = 0,
    ) -> scheduler.Placement | scheduler.NoFit:
        held = {
            p.node_id
            for p in placements
            if p.cluster == spec.name and p.status not in scheduler.RELEASED
        }
        stacked = [n for n in nodes if n.node_id in held]
        if stacked:
            decision = real(stacked, spec, placements, rng, avoid=avoid, now_ns=now_ns)
            if isinstance(decision, scheduler.Placement):
                return decision
        return real(nodes, spec, placements, rng, avoid=avoid, now_ns=now_ns)

    return schedule


def plant_stacking_bug(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_actor, "schedule", stacking(scheduler.schedule))


def remove_planted_bugs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cluster_actor, "schedule", scheduler.schedule)


def plant_expiry_ignored(monkeypatch: pytest.MonkeyPatch) -> None:
    """A leader that ignores its own expiry and goes on working when it steps down: it
    believes it holds the lease whatever its clock says, and its term's work is not stopped
    when the leadership gives the term up, so a leader woken from a pause past its lease (or
    cut off) keeps writing beside its successor. The one_writer invariant must catch it.

    (Ignoring the expiry alone is no longer enough to show: a woken leader's renewal loop
    runs first and steps down before any of its work does.)"""
    from actors import leadership

    async def left_running(task: object) -> None:
        return None

    monkeypatch.setattr(leadership.Leadership, "holds_lease", lambda self: True)
    monkeypatch.setattr(leadership, "_stop", left_running)


def plant_no_term_fence(monkeypatch: pytest.MonkeyPatch) -> None:
    """A log that does not fence appends on the term record (as JetStream does on the server,
    sim/controllers.py WriterTap): with a leader that ignores its expiry too, two terms write."""
    from sim import controllers

    monkeypatch.setattr(controllers.WriterTap, "_check_term", lambda self: None)
