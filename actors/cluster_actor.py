"""ClusterActor: one per cluster. Owns `cluster/<name>` and reconciles toward the desired spec.

Reconciling reads the live fleet state (a fold of the log) and acts through ReplicaActors:
  1. replicas on offline, unhealthy or removed nodes fail (the unhealthy node is told to stop);
  2. while fewer than `replicas` are in service on good nodes (healthy or suspect, not
     drained), failed slots are placed again at a higher epoch, then new slots are added;
  3. replicas on degraded or drained nodes keep serving until enough replicas are ready on good
     nodes, and are stopped only then: the replacement is ready first;
  4. extras beyond `replicas` are stopped, not-ready ones first.
Each step waits until its own events are folded into live state before the next decision.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from events import (
    ClusterCreated,
    ClusterDeleted,
    ClusterScaled,
    ClusterSpec,
    ClusterSpecChanged,
    ClusterUnschedulable,
    DomainEvent,
    stream_name,
)
from projections.views import NodeView, ReplicaView
from runtime.actor import ActorContext
from runtime.env import RandomSource
from runtime.event_sourced import EventSourcedActor
from runtime.system import ActorRef

from .errors import ControllerError
from .live_state import LiveState
from .replica_actor import ACTIVE, Fail, Place, ReplicaMsg, Stop
from .scheduler import RELEASED, NoFit, Placement, schedule


class ClusterError(ControllerError, ValueError):
    """A control request that cannot be honoured (exists already, unknown, deleted)."""


class ClusterState(msgspec.Struct, kw_only=True):
    spec: ClusterSpec | None = None
    deleted: bool = False
    unschedulable: str = ""


@dataclass(frozen=True, slots=True)
class Create:
    spec: ClusterSpec


@dataclass(frozen=True, slots=True)
class Update:
    spec: ClusterSpec


@dataclass(frozen=True, slots=True)
class Scale:
    replicas: int


@dataclass(frozen=True, slots=True)
class Delete:
    pass


@dataclass(frozen=True, slots=True)
class Reconcile:
    pass


ClusterMsg = Create | Update | Scale | Delete | Reconcile


class Fleet(Protocol):
    """What a ClusterActor needs from its controller."""

    live: LiveState
    placement_lock: asyncio.Lock

    async def replica(self, replica_id: str, spec: ClusterSpec) -> ActorRef[ReplicaMsg]: ...

    def scheduler_rng(self) -> RandomSource: ...

    def placeable(self, node_id: str) -> bool:
        """Whether a placement may use this node now (not while the controller's grace says
        its view of the node may be stale)."""
        ...


def _good(node: NodeView | None) -> bool:
    # A suspect node's replicas still count as serving: moving them on two missed heartbeats
    # would churn the fleet for every hiccup. The scheduler gives it no new ones; if it goes
    # offline its replicas fail and move then.
    return node is not None and node.health in ("healthy", "suspect") and not node.drained


def _lost(node: NodeView | None) -> bool:
    return node is None or node.health in ("offline", "unhealthy")


class ClusterActor(EventSourcedActor[ClusterMsg, ClusterState]):
    snapshot_type = ClusterState

    def __init__(self, name: str, fleet: Fleet) -> None:
        self.name = name
        self.fleet = fleet
        self._stream = stream_name("cluster", name)

    @property
    def stream(self) -> str:
        return self._stream

    def initial_state(self) -> ClusterState:
        return ClusterState()

    def evolve(self, state: ClusterState, payload: DomainEvent) -> ClusterState:
        match payload:
            case ClusterCreated(spec=spec) | ClusterSpecChanged(spec=spec):
                state.spec = spec
                state.deleted = False
            case ClusterScaled(replicas=replicas) if state.spec is not None:
                state.spec = msgspec.structs.replace(state.spec, replicas=replicas)
            case ClusterDeleted():
                state.deleted = True
            case ClusterUnschedulable(reason=reason):
                state.unschedulable = reason
            case _:
                pass
        return state

    @property
    def exists(self) -> bool:
        return self.state.spec is not None and not self.state.deleted

    async def handle(self, ctx: ActorContext[ClusterMsg], msg: ClusterMsg) -> object:
        match msg:
            case Create(spec=spec):
                if self.exists:
                    raise ClusterError(f"cluster {self.name!r} already exists")
                return await self._persist_and_wait(ctx, [ClusterCreated(spec=spec)])
            case Update(spec=spec):
                self._require()
                return await self._persist_and_wait(ctx, [ClusterSpecChanged(spec=spec)])
            case Scale(replicas=replicas):
                spec = self._require()
                return await self._persist_and_wait(
                    ctx, [ClusterScaled(name=self.name, replicas=replicas, previous=spec.replicas)]
                )
            case Delete():
                self._require()
                return await self._persist_and_wait(ctx, [ClusterDeleted(name=self.name)])
            case Reconcile():
                return await self._reconcile(ctx)

    def _require(self) -> ClusterSpec:
        if not self.exists or self.state.spec is None:
            raise ClusterError(f"unknown cluster {self.name!r}")
        return self.state.spec

    async def _persist_and_wait(
        self, ctx: ActorContext[ClusterMsg], events: Sequence[DomainEvent]
    ) -> list[int]:
        positions = await self.persist(ctx, events)
        await self.fleet.live.wait_for(positions[-1])
        return positions

    async def _reconcile(self, ctx: ActorContext[ClusterMsg]) -> int:
        """One pass; returns how many actions it took (0 means converged or blocked)."""
        spec = self.state.spec
        if spec is None:
            return 0
        async with self.fleet.placement_lock:
            replicas = self.fleet.live.state.replicas.replicas
            mine = sorted((r for r in replicas.values() if r.cluster == self.name), key=_ordinal)
            if self.state.deleted:
                return await self._stop_active(spec, mine)
            failed = await self._fail_on_lost_nodes(spec, mine)
            mine = [replicas[r.replica_id] for r in mine]
            placed, mine = await self._bring_up(ctx, spec, mine)
            stopped = await self._retire(spec, mine)
            return failed + placed + stopped

    async def _stop_active(self, spec: ClusterSpec, mine: list[ReplicaView]) -> int:
        actions = last = 0
        for r in mine:
            if r.status in ACTIVE:
                last = max(last, await self._tell(r, Stop("cluster deleted"), spec))
                actions += 1
        await self.fleet.live.wait_for(last)
        return actions

    async def _fail_on_lost_nodes(self, spec: ClusterSpec, mine: list[ReplicaView]) -> int:
        """Step 1: replicas whose node is gone or broken have failed."""
        nodes = self.fleet.live.state.nodes.nodes
        actions = last = 0
        for r in mine:
            node = nodes.get(r.node_id)
            if r.status in ACTIVE and _lost(node):
                unhealthy = node is not None and node.health == "unhealthy"
                fail = Fail(
                    "node_unhealthy" if unhealthy else "node_offline",
                    f"node {r.node_id} is {node.health if node else 'removed'}",
                    stop_on_node=unhealthy,
                )
                last = max(last, await self._tell(r, fail, spec))
                actions += 1
        await self.fleet.live.wait_for(last)
        return actions

    async def _bring_up(
        self, ctx: ActorContext[ClusterMsg], spec: ClusterSpec, mine: list[ReplicaView]
    ) -> tuple[int, list[ReplicaView]]:
        """Step 2: bring the count in service on good nodes up to the desired number. Returns
        how many were placed, and `mine` as it is afterwards (new replicas last)."""
        fleet = self.fleet.live.state
        nodes = fleet.nodes.nodes
        serving = [r for r in mine if r.status in ACTIVE and _good(nodes.get(r.node_id))]
        missing = spec.replicas - len(serving)
        if missing <= 0:
            return 0, mine
        retry = [r for r in mine if r.status == "failed"]
        placed, blocked = await self._place(ctx, spec, missing, retry, mine)
        if blocked is not None and blocked.reason != self.state.unschedulable:
            unschedulable = ClusterUnschedulable(
                name=self.name,
                missing=missing - placed,
                reason=blocked.reason,
                candidates=blocked.candidates,
            )
            await self._persist_and_wait(ctx, [unschedulable])
            ctx.log.warning("cluster_unschedulable", reason=blocked.reason)
        known = {m.replica_id for m in mine}
        refreshed = [fleet.replicas.replicas[r.replica_id] for r in mine]
        added = [
            r
            for r in fleet.replicas.replicas.values()
            if r.cluster == self.name and r.replica_id not in known
        ]
        return placed, refreshed + added

    async def _retire(self, spec: ClusterSpec, mine: list[ReplicaView]) -> int:
        """Steps 3 and 4: replicas on degraded or drained nodes stop once replacements are
        ready; then extras on good nodes stop, not-ready and newest first."""
        nodes = self.fleet.live.state.nodes.nodes
        actions = last = 0
        good_ready = [r for r in mine if r.status == "ready" and _good(nodes.get(r.node_id))]
        if len(good_ready) >= spec.replicas:
            for r in mine:
                node = nodes.get(r.node_id)
                if r.status in ACTIVE and not _good(node) and not _lost(node):
                    why = "node drained" if node and node.drained else "node degraded"
                    last = max(last, await self._tell(r, Stop(why), spec))
                    actions += 1
        serving = [r for r in mine if r.status in ACTIVE and _good(nodes.get(r.node_id))]
        extra = len(serving) - spec.replicas
        if extra > 0:
            order = sorted(serving, key=lambda r: (r.status == "ready", -_ordinal(r)))
            for r in order[:extra]:
                last = max(last, await self._tell(r, Stop("scaled down"), spec))
                actions += 1
        await self.fleet.live.wait_for(last)
        return actions

    async def _place(
        self,
        ctx: ActorContext[ClusterMsg],
        spec: ClusterSpec,
        missing: int,
        retry: list[ReplicaView],
        mine: list[ReplicaView],
    ) -> tuple[int, NoFit | None]:
        live = self.fleet.live
        rng = self.fleet.scheduler_rng()
        next_ordinal = max((_ordinal(r) for r in mine), default=-1) + 1
        placed = 0
        for _ in range(missing):
            slot = retry.pop(0) if retry else None
            avoid = (slot.node_id,) if slot is not None else ()
            fleet = live.state
            # Every replica, all clusters: the scheduler knows which statuses still hold GPUs.
            everyone = list(fleet.replicas.replicas.values())
            nodes = [n for n in fleet.nodes.nodes.values() if self.fleet.placeable(n.node_id)]
            # In the controller's grace some nodes are not heard from yet: a decision that
            # would be different with them (none fits, or one stacks replicas) waits for them.
            waiting = len(nodes) < len(fleet.nodes.nodes)
            decision = schedule(nodes, spec, everyone, rng, avoid=avoid)
            if isinstance(decision, NoFit) and avoid:
                # The node the slot failed on is the only fit: better there than nowhere.
                decision = schedule(nodes, spec, everyone, rng)
            if waiting and (isinstance(decision, NoFit) or _stacks(decision, spec, everyone)):
                return placed, None  # a later pass, once they are heard from, places it
            if isinstance(decision, NoFit):
                return placed, decision
            if slot is not None:
                replica_id = slot.replica_id
            else:
                replica_id = f"{self.name}-{next_ordinal}"
                next_ordinal += 1
            ref = await self.fleet.replica(replica_id, spec)
            positions = await ref.ask(
                Place(
                    spec=spec,
                    node_id=decision.node_id,
                    gpu_indices=decision.gpu_indices,
                    why=decision.why,
                    candidates=decision.candidates,
                ),
                timeout=30.0,
                expect=list,
            )
            await live.wait_for(positions[-1])
            placed += 1
        return placed, None

    async def _tell(self, replica: ReplicaView, msg: ReplicaMsg, spec: ClusterSpec) -> int:
        ref = await self.fleet.replica(replica.replica_id, spec)
        positions = await ref.ask(msg, timeout=30.0, expect=list)
        return max(positions, default=0)


def _stacks(decision: Placement, spec: ClusterSpec, replicas: list[ReplicaView]) -> bool:
    """Whether the decision puts a second live replica of the cluster on one node."""
    return any(
        r.cluster == spec.name and r.node_id == decision.node_id and r.status not in RELEASED
        for r in replicas
    )


def _ordinal(replica: ReplicaView) -> int:
    tail = replica.replica_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0
