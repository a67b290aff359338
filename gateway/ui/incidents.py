"""Incidents, read from the event log: each node loss or health change that moved replicas.

`incidents(envelopes)` is a pure function over committed envelopes in log order (heartbeats may
be among them, and give each incident its node's last heartbeat before it). The dashboard's
incidents page (gateway/ui/routes.py) and `gpumesh sim run --html` (sim/report_html.py) both
call it, and both draw what it returns with gateway/ui/timeline.py.

An incident opens when a node's health leaves `healthy` (suspect, degraded, unhealthy,
offline) and stays open while the node is not healthy: every replica whose current placement
is on that node and that fails meanwhile is a *move*, followed through its next placement to
`replica.ready` of that epoch. Only an episode that moved at least one replica is an incident
(a suspect node that answers again, an offline node that ran nothing, are not). The gateway's
ejections (`replica.suspected`, recorded from its reports) of the node's replicas count from
`LEAD_NS` before the first health change to the incident's end: a gateway usually sees
connections fail before the heartbeats are missed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Final, Literal

from events import (
    Envelope,
    NodeHealthChanged,
    NodeHeartbeat,
    NodeRemoved,
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaSuspected,
)

MarkKind = Literal[
    "heartbeat",  # the node's last heartbeat before the incident
    "suspect",
    "degraded",
    "unhealthy",
    "offline",
    "healthy",  # the node is back
    "removed",
    "ejected",  # a gateway took a replica of the node out of its routing
    "failed",
    "placed",
    "ready",
]
LEAD_NS: Final = 30_000_000_000
# Worst first: the state an incident is named after.
_SEVERITY: Final = {"offline": 4, "unhealthy": 3, "degraded": 2, "suspect": 1}
# The controller's failure detail for a lost node (actors/cluster_actor.py, _fail_on_lost_nodes):
# read only when the failed epoch's placement is older than the envelopes given.
_LOST_NODE: Final = re.compile(r"^node (\S+) is ")


@dataclass(frozen=True, slots=True)
class Mark:
    """One point of an incident's timeline: an event of the log, at its recorded time."""

    at_ns: int
    kind: MarkKind
    position: int
    replica_id: str = ""
    epoch: int = 0
    node_id: str = ""  # the node it concerns: for `placed`, the new one
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Move:
    """A replica that failed with its node, and its replacement so far."""

    replica_id: str
    cluster: str
    epoch: int  # the epoch that failed
    reason: str
    failed_ns: int
    new_epoch: int = 0  # 0: not placed again yet
    new_node: str = ""
    placed_ns: int = 0
    ready_ns: int = 0  # 0: not ready yet


@dataclass(frozen=True, slots=True)
class Incident:
    id: str  # "<node>@<position of the first health change>": stable while it grows
    node_id: str
    state: str  # the worst state the node reached in it
    reason: str  # why it first left healthy
    start_ns: int  # the first health change
    position: int
    last_heartbeat_ns: int  # 0: not among the envelopes given
    recovered_ns: int  # 0: the node is not healthy again (yet)
    marks: tuple[Mark, ...]  # in log order
    moves: tuple[Move, ...]

    @property
    def resolved(self) -> bool:
        """Every replica it moved is ready again."""
        return all(m.ready_ns for m in self.moves)

    @property
    def end_ns(self) -> int:
        return max(m.at_ns for m in self.marks)

    @property
    def begin_ns(self) -> int:
        """Where its timeline starts: the last heartbeat, or an earlier ejection."""
        return min(m.at_ns for m in self.marks)

    @property
    def ejections(self) -> int:
        return sum(m.kind == "ejected" for m in self.marks)

    @property
    def detection_s(self) -> float | None:
        """From the last heartbeat to the node's first health change."""
        if not self.last_heartbeat_ns:
            return None
        return (self.start_ns - self.last_heartbeat_ns) / 1e9

    @property
    def replacement_s(self) -> float | None:
        """From the first health change until every replica it moved is ready again."""
        if not self.moves or not self.resolved:
            return None
        return (max(m.ready_ns for m in self.moves) - self.start_ns) / 1e9


@dataclass
class _Open:
    node_id: str
    state: str
    reason: str
    start_ns: int
    position: int
    last_heartbeat_ns: int
    recovered_ns: int = 0
    closed: bool = False  # the node is healthy again: no new failures join it
    marks: list[Mark] = field(default_factory=list)
    moves: dict[tuple[str, int], Move] = field(default_factory=dict)

    def freeze(self) -> Incident:
        marks = sorted(self.marks, key=lambda m: (m.position, m.at_ns))
        return Incident(
            id=f"{self.node_id}@{self.position}",
            node_id=self.node_id,
            state=self.state,
            reason=self.reason,
            start_ns=self.start_ns,
            position=self.position,
            last_heartbeat_ns=self.last_heartbeat_ns,
            recovered_ns=self.recovered_ns,
            marks=tuple(marks),
            moves=tuple(self.moves.values()),
        )


def incidents(envelopes: Iterable[Envelope]) -> list[Incident]:
    """The incidents in `envelopes` (committed, in position order), oldest first."""
    fold = _Fold()
    for envelope in envelopes:
        fold.apply(envelope)
    return [episode.freeze() for episode in fold.episodes if episode.moves]


class _Fold:
    def __init__(self) -> None:
        self.episodes: list[_Open] = []
        self.open: dict[str, _Open] = {}  # node -> its episode while the node is not healthy
        self.heartbeat: dict[str, tuple[int, int]] = {}  # node -> (recorded_at, position)
        self.placed: dict[str, tuple[int, str, str]] = {}  # replica -> (epoch, node, cluster)
        # replica -> the episode and key of its move, until its replacement is ready
        self.waiting: dict[str, tuple[_Open, tuple[str, int]]] = {}
        self.ejections: dict[str, list[Mark]] = {}  # node -> recent ejections, before any episode

    def apply(self, e: Envelope) -> None:
        p = e.payload
        if isinstance(p, NodeHeartbeat):
            self.heartbeat[p.node_id] = (e.recorded_at, e.position)
        elif isinstance(p, NodeHealthChanged):
            self._health(e, p)
        elif isinstance(p, NodeRemoved):
            episode = self.open.pop(p.node_id, None)
            if episode is not None:
                episode.marks.append(
                    Mark(e.recorded_at, "removed", e.position, node_id=p.node_id, detail=p.reason)
                )
                episode.closed = True
        elif isinstance(p, ReplicaPlaced):
            self.placed[p.replica_id] = (p.epoch, p.node_id, p.cluster)
            self._placed(e, p)
        elif isinstance(p, ReplicaFailed):
            self._failed(e, p)
        elif isinstance(p, ReplicaReady):
            self._ready(e, p)
        elif isinstance(p, ReplicaSuspected):
            self._ejected(e, p)

    def _health(self, e: Envelope, p: NodeHealthChanged) -> None:
        episode = self.open.get(p.node_id)
        detail = f"{p.reason}: {p.detail}" if p.detail else p.reason
        if p.state == "healthy":
            if episode is not None:
                episode.marks.append(
                    Mark(e.recorded_at, "healthy", e.position, node_id=p.node_id, detail=detail)
                )
                episode.recovered_ns = e.recorded_at
                episode.closed = True
                del self.open[p.node_id]
            return
        if episode is None:
            beat_ns, beat_position = self.heartbeat.get(p.node_id, (0, 0))
            episode = _Open(
                node_id=p.node_id,
                state=p.state,
                reason=p.reason,
                start_ns=e.recorded_at,
                position=e.position,
                last_heartbeat_ns=beat_ns,
            )
            if beat_ns:
                episode.marks.append(Mark(beat_ns, "heartbeat", beat_position, node_id=p.node_id))
            recent = self.ejections.pop(p.node_id, [])
            episode.marks += [m for m in recent if m.at_ns >= e.recorded_at - LEAD_NS]
            self.open[p.node_id] = episode
            self.episodes.append(episode)
        elif _SEVERITY[p.state] > _SEVERITY.get(episode.state, 0):
            episode.state = p.state
        episode.marks.append(
            Mark(e.recorded_at, p.state, e.position, node_id=p.node_id, detail=detail)
        )

    def _failed(self, e: Envelope, p: ReplicaFailed) -> None:
        epoch, node, cluster = self.placed.get(p.replica_id, (0, "", ""))
        if epoch != p.epoch:
            # The placement is older than what we were given: the controller names a lost node
            # in its detail.
            found = _LOST_NODE.match(p.detail)
            lost = p.reason in ("node_offline", "node_unhealthy")
            node = found.group(1) if found and lost else ""
            cluster = p.replica_id.rsplit("-", 1)[0]
        episode = self.open.get(node)
        if episode is None or (p.replica_id, p.epoch) in episode.moves:
            return
        key = (p.replica_id, p.epoch)
        episode.moves[key] = Move(
            replica_id=p.replica_id,
            cluster=cluster,
            epoch=p.epoch,
            reason=p.reason,
            failed_ns=e.recorded_at,
        )
        episode.marks.append(
            Mark(
                e.recorded_at,
                "failed",
                e.position,
                replica_id=p.replica_id,
                epoch=p.epoch,
                node_id=node,
                detail=f"{p.reason}: {p.detail}" if p.detail else p.reason,
            )
        )
        self.waiting[p.replica_id] = (episode, key)

    def _placed(self, e: Envelope, p: ReplicaPlaced) -> None:
        waiting = self.waiting.get(p.replica_id)
        if waiting is None:
            return
        episode, key = waiting
        move = episode.moves[key]
        if p.epoch <= move.epoch:
            return
        episode.moves[key] = replace(
            move, new_epoch=p.epoch, new_node=p.node_id, placed_ns=e.recorded_at
        )
        episode.marks.append(
            Mark(
                e.recorded_at,
                "placed",
                e.position,
                replica_id=p.replica_id,
                epoch=p.epoch,
                node_id=p.node_id,
                detail=p.why,
            )
        )

    def _ready(self, e: Envelope, p: ReplicaReady) -> None:
        waiting = self.waiting.get(p.replica_id)
        if waiting is None:
            return
        episode, key = waiting
        move = episode.moves[key]
        if p.epoch != move.new_epoch:
            return
        episode.moves[key] = replace(move, ready_ns=e.recorded_at)
        episode.marks.append(
            Mark(
                e.recorded_at,
                "ready",
                e.position,
                replica_id=p.replica_id,
                epoch=p.epoch,
                node_id=move.new_node,
                detail=p.address,
            )
        )
        del self.waiting[p.replica_id]

    def _ejected(self, e: Envelope, p: ReplicaSuspected) -> None:
        epoch, node, _ = self.placed.get(p.replica_id, (0, "", ""))
        if epoch != p.epoch or not node:
            return
        mark = Mark(
            e.recorded_at,
            "ejected",
            e.position,
            replica_id=p.replica_id,
            epoch=p.epoch,
            node_id=node,
            detail=f"gateway {p.gateway_id}: {p.reason}, {p.failures} failures",
        )
        episode = self.open.get(node)
        if episode is not None:
            episode.marks.append(mark)
            return
        recent = self.ejections.setdefault(node, [])
        recent.append(mark)
        # Only the last LEAD_NS matter to an incident that opens later.
        while recent and recent[0].at_ns < e.recorded_at - LEAD_NS:
            recent.pop(0)


__all__ = ["LEAD_NS", "Incident", "Mark", "MarkKind", "Move", "incidents"]
