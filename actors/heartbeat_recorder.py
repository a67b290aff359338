"""Heartbeats recorded in batches, outside the NodeActors' mailboxes.

Every admitted heartbeat becomes a `node.heartbeat.v1` event in the node's `heartbeat/<id>`
stream. The recorder takes them as the controller reads them and appends what arrived during
one commit as one `append_many` (the oldest of each node's, one event per append; a node's
next waits for the next commit): one trip to the store and one wake-up for a few hundred
nodes, where a mailbox turn and a commit wake-up for each heartbeat cost a quarter
of the controller's CPU per heartbeat (docs/performance.md, Heartbeat throughput).

What a heartbeat means stays the NodeActor's decision. Two small tables, `NodeLiveness`, are
all the two share: when each node was last heard from (written here, read by the NodeActor's
silence watch) and the verdict each NodeActor holds (written by it, read by the controller to
pass on only the heartbeats that could change that verdict).

The recorder is the only writer of heartbeat streams in a controller and keeps their versions,
so its appends are checked like any other: a second controller writing the same streams shows
up as a conflict, counted and logged, not as an interleaving nobody noticed.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable

from events import NodeHeartbeat, stream_name
from events.contract.messages import Heartbeat
from events.envelope import NewEvent
from events.errors import ConcurrencyConflict, EventStoreError
from events.node import HealthState
from runtime.env import Env

from .health import HealthPolicy, evaluate

# Heartbeats waiting for a commit. The intake limiter bounds each node's rate, so this fills
# only when the store stops taking writes; past it heartbeats are dropped, and counted.
MAX_PENDING = 100_000
# Stream versions asked of the store at once, for nodes first heard since the start.
_VERSION_READS = 256

# kind, how many heartbeats, a detail for the log.
LossReport = Callable[[str, int, str], None]


class NodeLiveness:
    """When each node was last heard from, and the health verdict its NodeActor holds."""

    def __init__(self) -> None:
        self.last_heard: dict[str, float] = {}  # node id -> loop time; the controller writes
        self.verdicts: dict[str, tuple[HealthState, str]] = {}  # node id -> (state, reason)
        # When this controller last began to hear heartbeats (it started, or came back to
        # NATS): while nobody took heartbeats in, agents kept serving on their last lease
        # (nodeagent/agent.py), so silence counts from the end of such a lease at the
        # earliest (`leases_end`), and until `grace_until` only nodes heard from since may
        # take a replica. Infinite until the controller first hears.
        self.hearing_since = math.inf
        self.leases_end = math.inf
        self.grace_until = math.inf

    def heard(self, node_id: str, at: float) -> None:
        self.last_heard[node_id] = at

    def begin_hearing(self, at: float, policy: HealthPolicy) -> None:
        self.hearing_since = at
        self.leases_end = at + policy.lease_s
        self.grace_until = at + policy.grace_s

    @property
    def hearing(self) -> bool:
        return self.hearing_since != math.inf

    def placeable(self, node_id: str, now: float) -> bool:
        """During the grace, only a node heard from since hearing began may take a replica:
        the log's view of the others may be stale by the whole outage."""
        if now >= self.grace_until:
            return True
        return self.last_heard.get(node_id, -math.inf) >= self.hearing_since

    def may_change_verdict(self, hb: Heartbeat, policy: HealthPolicy) -> bool:
        """Whether the NodeActor must see this heartbeat: the verdict it implies differs from
        the one the actor holds (or the actor has not said which it holds yet)."""
        held = self.verdicts.get(hb.node_id)
        if held is None:
            return True
        return verdict_changes(hb, held[0], held[1], policy)


def verdict_changes(hb: Heartbeat, health: HealthState, reason: str, policy: HealthPolicy) -> bool:
    """The NodeActor's rule for recording a health change, shared so both sides agree."""
    verdict = evaluate(hb.gpus, hb.probe_error, health, reason, policy)
    return verdict.state != health or (verdict.state != "healthy" and verdict.reason != reason)


def heartbeat_event(hb: Heartbeat) -> NodeHeartbeat:
    return NodeHeartbeat(
        node_id=hb.node_id,
        seq=hb.seq,
        sent_at_ns=hb.sent_at_ns,
        gpus=hb.gpus,
        probe_error=hb.probe_error,
        running=tuple(
            f"{r.replica_id}@{r.epoch}" for r in hb.replicas if r.state in ("starting", "ready")
        ),
    )


class HeartbeatRecorder:
    def __init__(self, env: Env, lost: LossReport, *, max_pending: int = MAX_PENDING) -> None:
        self._env = env
        self._lost = lost
        self._max_pending = max_pending
        # node id -> its heartbeats waiting, oldest first; nodes in the order they came in
        self._pending: dict[str, list[Heartbeat]] = {}
        self._count = 0  # heartbeats in `_pending`
        self._wake = asyncio.Event()
        self._streams: dict[str, str] = {}  # node id -> its heartbeat stream (checked once)
        self._versions: dict[str, int] = {}  # heartbeat stream -> its version, as we wrote it
        self.recorded = 0

    def offer(self, hb: Heartbeat) -> bool:
        """Queue a heartbeat for the next commit; False when the backlog is full."""
        if self._count >= self._max_pending:
            return False
        beats = self._pending.get(hb.node_id)
        if beats is None:
            self._pending[hb.node_id] = [hb]
        else:
            beats.append(hb)
        self._count += 1
        self._wake.set()
        return True

    async def run(self) -> None:
        """Record what is offered until cancelled; its owner (the controller) cancels it."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self.record_pending()

    async def record_pending(self) -> None:
        """Record everything offered so far, including what arrives while it writes."""
        while self._pending:
            await self._record(self._turn())

    def _turn(self) -> list[Heartbeat]:
        """The oldest heartbeat of each node waiting. One event per stream per append: an
        append of one event is a single conditional publish on JetStream, a turn's all in
        flight together, where an append of several is an atomic batch, of which the server
        takes at most 50 in flight on the whole log. A node's second heartbeat in one turn
        (only a store slower than the node's interval makes one) waits one commit instead of
        making the whole turn slow."""
        pending = self._pending
        turn: list[Heartbeat] = []
        emptied: list[str] = []
        for node_id, beats in pending.items():
            turn.append(beats.pop(0))
            if not beats:
                emptied.append(node_id)
        if len(emptied) == len(pending):
            pending.clear()
        else:
            for node_id in emptied:
                del pending[node_id]
        self._count -= len(turn)
        return turn

    async def _record(self, turn: list[Heartbeat]) -> None:
        env = self._env
        streams = self._streams
        appends: list[tuple[str, list[NewEvent], int]] = []
        versions = self._versions
        try:
            for hb in turn:
                stream = streams.get(hb.node_id)
                if stream is None:
                    stream = streams[hb.node_id] = stream_name("heartbeat", hb.node_id)
                appends.append((stream, [env.new_event(heartbeat_event(hb))], 0))
            missing = [stream for stream, _, _ in appends if stream not in versions]
            if missing:  # first heartbeats since this controller started: ask side by side
                await self._learn_versions(missing)
            appends = [(stream, events, versions[stream]) for stream, events, _ in appends]
            results = await env.store.append_many(appends)
        except EventStoreError as exc:
            self._lost("store_error", len(turn), str(exc))
            return
        for (stream, _, _), result in zip(appends, results, strict=True):
            if isinstance(result, list):
                versions[stream] += 1
                self.recorded += 1
            elif isinstance(result, ConcurrencyConflict):
                # Someone else wrote this stream: go on from where it is now. This heartbeat
                # is lost; the node's next one, a heartbeat interval away, is recorded.
                versions[stream] = result.actual
                self._lost("conflict", 1, str(result))
            else:
                self._lost("store_error", 1, str(result))

    async def _learn_versions(self, streams: list[str]) -> None:
        """Each stream's version from the store, `_VERSION_READS` reads in flight at a time:
        one after another, a controller starting under a fleet's heartbeats spent a store
        round trip per node (2,000 on JetStream R3: seconds) before its first append."""
        store = self._env.store
        for start in range(0, len(streams), _VERSION_READS):
            chunk = streams[start : start + _VERSION_READS]
            found = await asyncio.gather(
                *(store.stream_version(stream) for stream in chunk), return_exceptions=True
            )
            for stream, version in zip(chunk, found, strict=True):
                if isinstance(version, BaseException):
                    raise version
                self._versions[stream] = version
