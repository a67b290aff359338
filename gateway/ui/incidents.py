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

Paging through a long log (`WindowScan`, the incidents page's "older incidents"): the log is
cut into windows of `WINDOW` positions, window k holding positions k*WINDOW+1 .. (k+1)*WINDOW
(heartbeats take positions too). The rule:

* An incident belongs to the window that holds its first health change (the position in its
  id), and is shown only with that window: a page shows the incidents that *begin* in its
  windows.
* Whether a health change begins an incident is judged by a fold begun `CONTEXT` (2) windows
  before the incident's window: a node already down then is known to be down, and its next
  health change is no beginning.
* An incident is followed whole through the window after its own (a page reads on past its
  end for that); after that only its moved replicas' placements and readiness are added,
  until every one is ready or `FOLLOW_WINDOWS` windows later. So an incident that straddles
  a boundary is drawn once, whole, on the page of its beginning, and the page after draws
  none of it.
* Ejections lead an incident from its own window or the one before at most.

Why nothing is drawn twice: the fold of the window after an incident's begins two windows
back, before the incident began, so it sees the same beginning and takes the incident's
events in that window as that incident's, not as a new one's (and ejections reach back one
window, no further, for the same reason); past that window the incident takes only the
placements and readiness of replicas whose last failure it holds. A heartbeat aside (two
incidents of a node may share its last one), each event is drawn in one incident at most, each
incident on one page (tests/gateway/test_incidents_paging.py, over random logs).

The pages together are `incidents()` of the whole log when each incident, from its replicas'
placements and the ejections before it to its last event, spans a window at most. Otherwise:
an older incident keeps only its replacements past the window after its own (its node's
return, say, is not drawn), and a node down through two whole windows with no health change
that changes again begins a new incident there.
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
# Positions per window of the incidents page. A 1,000-node fleet heartbeats about 1,000 times a
# second: a window is then 40 s, and the first page (two windows, and the two before them)
# reads 160,000 positions, as far as the events page reads back at most (data.MAX_LOOKBACK).
WINDOW: Final = 40_000
CONTEXT: Final = 2  # windows a window's fold begins before it
# Windows past the one after its own that an incident's replacements are followed through:
# loading a large model again can take minutes.
FOLLOW_WINDOWS: Final = 25
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
    hidden: set[tuple[str, int]] = field(default_factory=set)  # moves after the fold's seal

    @property
    def shown(self) -> list[Move]:
        return [move for key, move in self.moves.items() if key not in self.hidden]

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
            moves=tuple(self.shown),
        )


def incidents(envelopes: Iterable[Envelope]) -> list[Incident]:
    """The incidents in `envelopes` (committed, in position order), oldest first."""
    fold = _Fold()
    for envelope in envelopes:
        fold.apply(envelope)
    return [episode.freeze() for episode in fold.episodes if episode.moves]


def with_heartbeat(incident: Incident, beat: Envelope) -> Incident:
    """`incident` with `beat` as its node's last heartbeat before it: the dashboard reads the
    log without heartbeats (most of it), and looks each incident's up on its own."""
    if incident.last_heartbeat_ns or not isinstance(beat.payload, NodeHeartbeat):
        return incident
    mark = Mark(beat.recorded_at, "heartbeat", beat.position, node_id=incident.node_id)
    marks = sorted((mark, *incident.marks), key=lambda m: (m.position, m.at_ns))
    return replace(incident, last_heartbeat_ns=beat.recorded_at, marks=tuple(marks))


def window_of(position: int, size: int) -> int:
    """The window holding `position` (>= 1): window k holds k*size+1 .. (k+1)*size."""
    return (position - 1) // size


class WindowScan:
    """The incidents that begin in windows `first`..`last` of `size` positions, by the rule of
    the module docstring. Feed it the envelopes after position `start`, in position order,
    while `wanted()`; positions past `limit` are never wanted. Holds a fold per window (what
    a fold keeps: the open episodes, the replicas' placements), never the envelopes."""

    def __init__(self, first: int, last: int, *, size: int, follow: int = FOLLOW_WINDOWS) -> None:
        if not 0 <= first <= last or size < 1:
            raise ValueError(f"windows {first}..{last} of {size} positions")
        self.first, self.last, self.size, self.follow = first, last, size, follow
        self.start = max(0, (first - CONTEXT) * size)
        self.limit = (last + 2 + follow) * size
        self.position = self.start  # of the last envelope fed
        self._next = first  # the first window whose fold has not begun
        self._folds: dict[int, _Fold] = {}
        self._found: dict[int, list[Incident]] = {}

    def feed(self, envelope: Envelope) -> None:
        p = envelope.position
        if p <= self.position:
            return  # read twice (a page boundary of events.list): applied once
        self.position = p
        while self._next <= self.last and p > (self._next - CONTEXT) * self.size:
            k = self._next
            self._folds[k] = _Fold(seal=(k + 2) * self.size, lead_from=(k - 1) * self.size)
            self._next += 1
        for k, fold in list(self._folds.items()):
            fold.apply(envelope)
            followed = p >= (k + 2) * self.size and not self._pending(k, fold)
            if followed or p >= (k + 2 + self.follow) * self.size:
                self._found[k] = self._claimed(k, fold)
                del self._folds[k]

    def wanted(self) -> bool:
        """Whether an envelope after the last one fed could still change what it finds."""
        if self.position >= self.limit:
            return False
        return self._next <= self.last or bool(self._folds)

    def incidents(self) -> list[Incident]:
        """What it found, oldest first: as far as it was fed (a log that ends is its head)."""
        found = dict(self._found)
        for k, fold in self._folds.items():
            found[k] = self._claimed(k, fold)
        return [i for k in sorted(found) for i in found[k]]

    def _claimed(self, k: int, fold: _Fold) -> list[Incident]:
        lo, hi = k * self.size, (k + 1) * self.size
        return [e.freeze() for e in fold.episodes if lo < e.position <= hi and e.shown]

    def _pending(self, k: int, fold: _Fold) -> bool:
        """A replica it shows moving is not ready again yet."""
        lo, hi = k * self.size, (k + 1) * self.size
        for episode, key in fold.waiting.values():
            if lo < episode.position <= hi and key not in episode.hidden:
                return True
        return False


class _Fold:
    """`seal`: past this position an episode takes nothing new but its shown moves' placements
    and readiness (WindowScan: the end of the window after its own). `lead_from`: ejections
    at or before it lead no episode."""

    def __init__(self, *, seal: int | None = None, lead_from: int = 0) -> None:
        self.seal = seal
        self.lead_from = lead_from
        self.sealed = False
        self.episodes: list[_Open] = []
        self.open: dict[str, _Open] = {}  # node -> its episode while the node is not healthy
        self.heartbeat: dict[str, tuple[int, int]] = {}  # node -> (recorded_at, position)
        self.placed: dict[str, tuple[int, str, str]] = {}  # replica -> (epoch, node, cluster)
        # replica -> the episode and key of its move, until its replacement is ready
        self.waiting: dict[str, tuple[_Open, tuple[str, int]]] = {}
        self.ejections: dict[str, list[Mark]] = {}  # node -> recent ejections, before any episode

    def apply(self, e: Envelope) -> None:
        self.sealed = self.seal is not None and e.position > self.seal
        p = e.payload
        if isinstance(p, NodeHeartbeat):
            self.heartbeat[p.node_id] = (e.recorded_at, e.position)
        elif isinstance(p, NodeHealthChanged):
            self._health(e, p)
        elif isinstance(p, NodeRemoved):
            episode = self.open.pop(p.node_id, None)
            if episode is not None and not self.sealed:
                episode.marks.append(
                    Mark(e.recorded_at, "removed", e.position, node_id=p.node_id, detail=p.reason)
                )
            if episode is not None:
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
                if not self.sealed:
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
            episode.marks += [
                m
                for m in recent
                if m.at_ns >= e.recorded_at - LEAD_NS and m.position > self.lead_from
            ]
            self.open[p.node_id] = episode
            self.episodes.append(episode)
        elif self.sealed:
            return
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
        self.waiting[p.replica_id] = (episode, key)
        if self.sealed:
            episode.hidden.add(key)
            return
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
        if key in episode.hidden:
            return
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
        del self.waiting[p.replica_id]
        if key in episode.hidden:
            return
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
            if not self.sealed:
                episode.marks.append(mark)
            return
        recent = self.ejections.setdefault(node, [])
        recent.append(mark)
        # Only the last LEAD_NS matter to an incident that opens later.
        while recent and recent[0].at_ns < e.recorded_at - LEAD_NS:
            recent.pop(0)


__all__ = [
    "CONTEXT",
    "FOLLOW_WINDOWS",
    "LEAD_NS",
    "WINDOW",
    "Incident",
    "Mark",
    "MarkKind",
    "Move",
    "WindowScan",
    "incidents",
    "window_of",
    "with_heartbeat",
]
