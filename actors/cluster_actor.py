"""ClusterActor: one per cluster. Owns `cluster/<name>` and reconciles toward the desired spec.

Reconciling reads the live fleet state (a fold of the log) and acts through ReplicaActors:
  1. replicas on offline, unhealthy or removed nodes fail (the unhealthy node is told to stop);
  2. while fewer than `replicas` are in service on good nodes (healthy or suspect, not
     drained), failed slots are placed again at a higher epoch, then new slots are added;
  3. replicas on degraded or drained nodes keep serving until enough replicas are ready on good
     nodes, and are stopped only then: the replacement is ready first;
  4. extras beyond `replicas` are stopped, not-ready ones first.
Each step waits until its own events are folded into live state before the next decision.

Revisions: creating a cluster is revision 1; `Apply` and `Rollback` record the next one
(`ClusterSpecChanged` with the whole spec). Replicas record the revision they were placed at;
one whose revision differs from the current in what it runs (anything but `replicas` and
`rollout`) is outdated, and the rollout (`plan_rollout`) replaces outdated replicas within the
spec's `max_surge` and `max_unavailable`: new ones are placed, and an old one is stopped only
while enough others are ready ("replaced by revision N"). When every wanted replica runs the
current revision and is ready, `ClusterRolledOut` records it. If replicas of the revision being
rolled out fail `ROLLBACK_AFTER_FAILURES` times first, the cluster rolls back on its own: the
spec of the last revision that rolled out becomes the next revision, and its reason says why.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import msgspec

from events import (
    AutoscaleInputs,
    ClusterCanaryEnded,
    ClusterCanaryStarted,
    ClusterCreated,
    ClusterDeleted,
    ClusterRolledOut,
    ClusterScaled,
    ClusterSpec,
    ClusterSpecChanged,
    ClusterUnschedulable,
    DomainEvent,
    RolloutPolicy,
    StagePlacement,
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
from .sharding import group_estimate, place_group


class ClusterError(ControllerError, ValueError):
    """A control request that cannot be honoured (exists already, unknown, deleted)."""


# Failures of the workload (readiness, exits, crashes in place) of the revision being rolled
# out, over all its replicas, after which the cluster rolls back to the last rolled-out one.
ROLLBACK_AFTER_FAILURES = 3


class ClusterState(msgspec.Struct, kw_only=True):
    spec: ClusterSpec | None = None
    deleted: bool = False
    unschedulable: str = ""
    revision: int = 0  # the current spec's; 1 once created
    revisions: dict[int, ClusterSpec] = {}  # every revision's spec, as recorded
    rolled_out: int = 0  # the last revision that rolled out whole; 0: none yet
    canary: str = ""  # the canary's cluster while one runs


@dataclass(frozen=True, slots=True)
class Create:
    spec: ClusterSpec


@dataclass(frozen=True, slots=True)
class Apply:
    """Record `spec` as the next revision (or create the cluster: revision 1)."""

    spec: ClusterSpec


@dataclass(frozen=True, slots=True)
class Rollback:
    """Record the spec of an earlier revision (`to`; 0: the one before the current) as the
    next revision, keeping the current replica count and rollout policy."""

    to: int = 0


@dataclass(frozen=True, slots=True)
class Revised:
    """What `Apply` and `Rollback` did: the cluster's revision now, and whether it changed."""

    revision: int
    changed: bool
    message: str


@dataclass(frozen=True, slots=True)
class Scale:
    replicas: int


@dataclass(frozen=True, slots=True)
class Autoscale:
    """The autoscaler's decision (actors/autoscaler.py): recorded only if the count is still
    `previous` (a hand-made scale or an earlier decision may have landed meanwhile)."""

    replicas: int
    previous: int
    cause: str
    inputs: AutoscaleInputs


@dataclass(frozen=True, slots=True)
class StartCanary:
    """Record that `canary` (a cluster already created with the new spec) takes `weight`
    percent of this cluster's requests."""

    canary: str
    weight: int


@dataclass(frozen=True, slots=True)
class EndCanary:
    """Record the canary's end. `promoted`: its spec (named as this cluster) becomes this
    cluster's next revision, keeping this cluster's count, and rolls out as an apply does."""

    outcome: str  # "promoted" or "aborted"
    reason: str = ""
    promoted: ClusterSpec | None = None


@dataclass(frozen=True, slots=True)
class Delete:
    pass


@dataclass(frozen=True, slots=True)
class Reconcile:
    pass


ClusterMsg = (
    Create | Apply | Rollback | Scale | Autoscale | StartCanary | EndCanary | Delete | Reconcile
)


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

    async def secrets_unavailable(self, spec: ClusterSpec) -> str:
        """Why the spec's secrets can reach no node ('' when they can)."""
        ...

    async def prepull(self, spec: ClusterSpec, position: int) -> list[str]:
        """Ask the nodes that could host `spec` (recorded at log `position`) to pull its
        image now (`[docker] prepull`), without waiting for them; the nodes asked."""
        ...


def _good(node: NodeView | None) -> bool:
    # A suspect node's replicas still count as serving: moving them on two missed heartbeats
    # would churn the fleet for every hiccup. The scheduler gives it no new ones; if it goes
    # offline its replicas fail and move then.
    return node is not None and node.health in ("healthy", "suspect") and not node.drained


def _lost(node: NodeView | None) -> bool:
    return node is None or node.health in ("offline", "unhealthy")


def _nodes_of_others(
    spec: ClusterSpec, replicas: list[ReplicaView], slot: ReplicaView | None
) -> frozenset[str]:
    """The nodes the cluster's other live replicas run on (every stage of a pipeline)."""
    mine = slot.replica_id if slot is not None else ""
    return frozenset(
        node_id
        for r in replicas
        if r.cluster == spec.name and r.status not in RELEASED and r.replica_id != mine
        for node_id in r.node_ids
    )


def _at_fault(slot: ReplicaView) -> tuple[str, ...]:
    """The node a failed slot's replacement avoids: the one its failure names (a pipeline's
    failing stage's), else its own node; a pipeline whose failure names none avoids nothing,
    its stages' nodes being as good as any."""
    if slot.failure_node:
        return (slot.failure_node,)
    return () if slot.stages else (slot.node_id,)


def _good_everywhere(nodes: Mapping[str, NodeView], replica: ReplicaView) -> bool:
    """Whether every node the replica runs on is good (a pipeline's, each stage's)."""
    return all(_good(nodes.get(node_id)) for node_id in replica.node_ids)


def template(spec: ClusterSpec) -> ClusterSpec:
    """What a replica runs: the spec without the count and the rollout policy. Two revisions
    with the same template need no replacement between them."""
    return msgspec.structs.replace(spec, replicas=0, rollout=RolloutPolicy())


def describe_change(before: ClusterSpec | None, after: ClusterSpec) -> str:
    """One line: which fields of the spec changed, e.g. `env.GREETING: "a" -> "b"`."""
    if before is None:
        return "created"
    old, new = msgspec.to_builtins(before), msgspec.to_builtins(after)
    parts: list[str] = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        if isinstance(a, dict | None) and isinstance(b, dict | None) and (a or b):
            a, b = a or {}, b or {}
            for sub in sorted(set(a) | set(b)):
                if a.get(sub) != b.get(sub):
                    parts.append(f"{key}.{sub}: {_short(a.get(sub))} -> {_short(b.get(sub))}")
        else:
            parts.append(f"{key}: {_short(a)} -> {_short(b)}")
    return "; ".join(parts) or "no change"


def _short(value: object) -> str:
    if value is None:
        return "(none)"
    text = msgspec.json.encode(value).decode()
    return text if len(text) <= 60 else text[:57] + "..."


@dataclass(frozen=True, slots=True)
class RolloutSlot:
    """A replica in service, as the rollout plan sees it."""

    replica_id: str
    current: bool  # runs the current revision's template
    ready: bool


@dataclass(frozen=True, slots=True)
class RolloutStep:
    place: int = 0  # new replicas of the current revision
    stop_outdated: tuple[str, ...] = ()  # replaced by the current revision
    stop_extra: tuple[str, ...] = ()  # current ones beyond `replicas` (a scale-down meanwhile)


def plan_rollout(
    desired: int, policy: RolloutPolicy, serving: Sequence[RolloutSlot]
) -> RolloutStep:
    """One step of replacing outdated replicas, from the replicas in service (oldest first).

    Bounds, at every step: at most `desired + max_surge` replicas in service once the step's
    placements are made, and at least `desired - max_unavailable` ready once its stops are
    (if that many were ready before). Outdated replicas that are not ready go first: they serve
    nobody. A ready outdated one goes only while enough others are ready, so with
    `max_unavailable = 0` a replacement is ready before an old replica leaves the routing table.
    """
    new = [s for s in serving if s.current]
    old = [s for s in serving if not s.current]
    if not old:
        return RolloutStep()
    extra: list[str] = []
    if len(new) > desired:
        order = sorted(range(len(new)), key=lambda i: (new[i].ready, -i))
        drop = {new[i].replica_id for i in order[: len(new) - desired]}
        extra = [s.replica_id for s in new if s.replica_id in drop]
        new = [s for s in new if s.replica_id not in drop]
    available = sum(s.ready for s in new) + sum(s.ready for s in old)
    floor = desired - policy.max_unavailable
    outdated = [s.replica_id for s in old if not s.ready]
    for s in old:
        if s.ready and available - 1 >= floor:
            outdated.append(s.replica_id)
            available -= 1
    left = len(new) + len(old) - len(outdated)
    place = max(0, min(desired + policy.max_surge - left, desired - len(new)))
    return RolloutStep(place, tuple(outdated), tuple(extra))


class ClusterActor(EventSourcedActor[ClusterMsg, ClusterState]):
    snapshot_type = ClusterState
    snapshot_version = 2  # revisions

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
            case ClusterCreated(spec=spec):
                state.spec = spec
                state.deleted = False
                state.revision = 1
                state.revisions = {1: spec}
                state.rolled_out = 0
            case ClusterSpecChanged(spec=spec, revision=revision):
                state.spec = spec
                state.deleted = False
                state.revision = revision or state.revision + 1
                state.revisions = {**state.revisions, state.revision: spec}
            case ClusterRolledOut(revision=revision):
                state.rolled_out = revision
            case ClusterScaled(replicas=replicas) if state.spec is not None:
                state.spec = msgspec.structs.replace(state.spec, replicas=replicas)
            case ClusterDeleted():
                state.deleted = True
            case ClusterUnschedulable(reason=reason):
                state.unschedulable = reason
            case ClusterCanaryStarted(canary=canary):
                state.canary = canary
            case ClusterCanaryEnded():
                state.canary = ""
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
            case Apply(spec=spec):
                return await self._apply(ctx, spec)
            case Rollback(to=to):
                return await self._rollback(ctx, to)
            case Scale(replicas=replicas):
                spec = self._require()
                return await self._persist_and_wait(
                    ctx, [ClusterScaled(name=self.name, replicas=replicas, previous=spec.replicas)]
                )
            case Autoscale(replicas=replicas, previous=previous, cause=cause, inputs=inputs):
                if not self.exists or self.state.spec is None:
                    return False
                if self.state.spec.replicas != previous or replicas == previous:
                    return False
                scaled = ClusterScaled(
                    name=self.name, replicas=replicas, previous=previous, cause=cause, inputs=inputs
                )
                await self._persist_and_wait(ctx, [scaled])
                ctx.log.info(
                    "cluster_autoscaled", replicas=replicas, previous=previous, cause=cause
                )
                return True
            case StartCanary(canary=canary, weight=weight):
                self._require()
                if self.state.canary:
                    raise ClusterError(
                        f"cluster {self.name!r} already has a canary ({self.state.canary}): "
                        "promote or abort it first"
                    )
                started = ClusterCanaryStarted(name=self.name, canary=canary, weight=weight)
                return await self._persist_and_wait(ctx, [started])
            case EndCanary(outcome=outcome, reason=reason, promoted=promoted):
                return await self._end_canary(ctx, outcome, reason, promoted)
            case Delete():
                self._require()
                if self.state.canary:
                    raise ClusterError(
                        f"cluster {self.name!r} has a canary ({self.state.canary}): "
                        "promote or abort it before deleting the cluster"
                    )
                return await self._persist_and_wait(ctx, [ClusterDeleted(name=self.name)])
            case Reconcile():
                return await self._reconcile(ctx)

    async def _apply(self, ctx: ActorContext[ClusterMsg], spec: ClusterSpec) -> Revised:
        if not self.exists:
            await self._persist_and_wait(ctx, [ClusterCreated(spec=spec)])
            return Revised(1, True, f"created cluster {self.name} (revision 1)")
        current = self._require()
        if spec.autoscale is not None:
            # The autoscaler owns the count: a new revision keeps it, within the new bounds.
            lo, hi = spec.autoscale.min_replicas, spec.autoscale.max_replicas
            spec = msgspec.structs.replace(spec, replicas=min(max(current.replicas, lo), hi))
        if spec == current:
            revision = self.state.revision
            return Revised(revision, False, f"unchanged: the spec is revision {revision}'s")
        revision = self.state.revision + 1
        change = ClusterSpecChanged(spec=spec, revision=revision, reason="applied")
        await self._persist_and_wait(ctx, [*self._rolled_out_now(), change])
        ctx.log.info("cluster_revised", revision=revision, change=describe_change(current, spec))
        return Revised(revision, True, f"recorded revision {revision}")

    async def _end_canary(
        self,
        ctx: ActorContext[ClusterMsg],
        outcome: str,
        reason: str,
        promoted: ClusterSpec | None,
    ) -> Revised:
        current = self._require()
        canary = self.state.canary
        if not canary:
            verb = "promote" if outcome == "promoted" else "abort"
            raise ClusterError(f"cluster {self.name!r} has no canary to {verb}")
        ended = ClusterCanaryEnded(name=self.name, canary=canary, outcome=outcome, reason=reason)
        if promoted is None or template(promoted) == template(current):
            await self._persist_and_wait(ctx, [ended])
            revision = self.state.revision
            return Revised(revision, False, f"canary {canary} {outcome}")
        spec = msgspec.structs.replace(
            promoted,
            name=self.name,
            model=current.model,
            replicas=current.replicas,
            autoscale=current.autoscale,
            rollout=current.rollout,
        )
        revision = self.state.revision + 1
        change = ClusterSpecChanged(
            spec=spec, revision=revision, reason=f"promoted canary {canary}"
        )
        # One append: the revision and the canary's end land together or not at all.
        await self._persist_and_wait(ctx, [*self._rolled_out_now(), change, ended])
        ctx.log.info("canary_promoted", canary=canary, revision=revision)
        return Revised(revision, True, f"canary {canary} promoted: revision {revision}")

    async def _rollback(self, ctx: ActorContext[ClusterMsg], to: int) -> Revised:
        current = self._require()
        revision = self.state.revision
        if to == 0:
            if revision <= 1:
                raise ClusterError(f"cluster {self.name!r} has no revision before {revision}")
            to = revision - 1
        if to == revision:
            raise ClusterError(
                f"revision {to} is the current revision of cluster {self.name!r}: "
                f"nothing to roll back to"
            )
        earlier = self.state.revisions.get(to)
        if earlier is None:
            raise ClusterError(
                f"unknown revision {to} of cluster {self.name!r} (revisions: 1..{revision})"
            )
        spec = msgspec.structs.replace(earlier, replicas=current.replicas, rollout=current.rollout)
        if spec == current:
            return Revised(revision, False, f"unchanged: revision {to}'s spec is the current one")
        change = ClusterSpecChanged(
            spec=spec, revision=revision + 1, reason=f"rollback to revision {to}", rollback_to=to
        )
        await self._persist_and_wait(ctx, [*self._rolled_out_now(), change])
        ctx.log.info("cluster_rolled_back", revision=revision + 1, to=to)
        return Revised(revision + 1, True, f"revision {revision + 1}: the spec of revision {to}")

    def _current(self, replica: ReplicaView) -> bool:
        """Whether a replica runs what the current revision runs (unknown revisions do)."""
        placed = self.state.revisions.get(replica.revision or 1)
        spec = self.state.spec
        return placed is None or spec is None or template(placed) == template(spec)

    def _require(self) -> ClusterSpec:
        if not self.exists or self.state.spec is None:
            raise ClusterError(f"unknown cluster {self.name!r}")
        return self.state.spec

    async def _persist_and_wait(
        self, ctx: ActorContext[ClusterMsg], events: Sequence[DomainEvent]
    ) -> list[int]:
        positions = await self.persist(ctx, events)
        await self.fleet.live.wait_for(positions[-1])
        for event, position in zip(events, positions, strict=True):
            # Recorded first: a controller that fails over before asking asks nobody, and the
            # replicas still start (pulling then, as without prepull).
            if isinstance(event, ClusterCreated | ClusterSpecChanged) and event.spec.docker.prepull:
                await self.fleet.prepull(event.spec, position)
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
            if await self._roll_back_if_failing(ctx, spec, mine):
                return failed + 1  # the next pass rolls out the revision it recorded
            placed, mine = await self._bring_up(ctx, spec, mine)
            rolled, mine = await self._roll(ctx, spec, mine)
            stopped = await self._retire(spec, mine)
            mine = [replicas[r.replica_id] for r in mine]
            await self._note_rolled_out(ctx, spec, mine)
            return failed + placed + rolled + stopped

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
            lost = [n for n in r.node_ids if _lost(nodes.get(n))]
            if r.status in ACTIVE and lost:
                # Any stage's node lost is the whole pipeline's: it cannot serve without it.
                node_id = lost[0]
                node = nodes.get(node_id)
                unhealthy = node is not None and node.health == "unhealthy"
                stage = "" if node_id == r.node_id else " (a pipeline stage's)"
                fail = Fail(
                    "node_unhealthy" if unhealthy else "node_offline",
                    f"node {node_id}{stage} is {node.health if node else 'removed'}",
                    stop_on_node=unhealthy,
                    node_id=node_id,
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
        slow = self._slow_groups(spec, mine)
        serving = self._in_service(mine, slow)
        missing = spec.replicas - len(serving)
        if missing <= 0:
            return 0, mine
        retry = [r for r in mine if r.status == "failed"]
        # A group whose links are now too slow serves on until its replacement is ready.
        because = "; ".join(f"replaces {rid}: {why}" for rid, why in sorted(slow.items()))
        placed, blocked = await self._place(ctx, spec, missing, retry, mine, because=because)
        if blocked is not None and blocked.reason != self._recorded_unschedulable():
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

    async def _roll_back_if_failing(
        self, ctx: ActorContext[ClusterMsg], spec: ClusterSpec, mine: list[ReplicaView]
    ) -> bool:
        """Replicas of the revision being rolled out failed too often: record the spec of the
        last revision that rolled out as the next revision, and say why."""
        state = self.state
        revision, stable = state.revision, state.rolled_out
        if stable in (0, revision):
            return False  # nothing rolls out, or nothing ever rolled out to go back to
        failing = [r for r in mine if r.revision == revision and r.crashes]
        failures = sum(r.crashes for r in failing)
        if failures < ROLLBACK_AFTER_FAILURES:
            return False
        target = state.revisions.get(stable)
        if target is None or template(target) == template(spec):
            return False  # it runs that revision's spec already: going back changes nothing
        last = max(failing, key=lambda r: r.version)
        why = last.failure_reason or "crashed"
        if last.failure_detail:
            why += f": {last.failure_detail}"
        reason = (
            f"automatic rollback to revision {stable}: replicas of revision {revision} failed "
            f"{failures} times during its rollout (last: {last.replica_id} {why})"
        )
        rollback = msgspec.structs.replace(target, replicas=spec.replicas, rollout=spec.rollout)
        change = ClusterSpecChanged(
            spec=rollback, revision=revision + 1, reason=reason, rollback_to=stable
        )
        await self._persist_and_wait(ctx, [change])
        ctx.log.warning("cluster_rolled_back", revision=revision + 1, to=stable, why=reason)
        return True

    async def _roll(
        self, ctx: ActorContext[ClusterMsg], spec: ClusterSpec, mine: list[ReplicaView]
    ) -> tuple[int, list[ReplicaView]]:
        """Replace outdated replicas in service, one `plan_rollout` step."""
        nodes = self.fleet.live.state.nodes.nodes
        serving = [r for r in mine if r.status in ACTIVE and _good_everywhere(nodes, r)]
        slots = [RolloutSlot(r.replica_id, self._current(r), r.status == "ready") for r in serving]
        step = plan_rollout(spec.replicas, spec.rollout, slots)
        if step == RolloutStep():
            return 0, mine
        # Stops first, so the surge bound holds at every event, not only after the step.
        by_id = {r.replica_id: r for r in mine}
        actions = last = 0
        for rid in step.stop_outdated:
            why = f"replaced by revision {self.state.revision}"
            last = max(last, await self._tell(by_id[rid], Stop(why), spec))
            actions += 1
        for rid in step.stop_extra:
            last = max(last, await self._tell(by_id[rid], Stop("scaled down"), spec))
            actions += 1
        await self.fleet.live.wait_for(last)
        if step.place:
            retry = [r for r in mine if r.status == "failed"]  # slots first, as in bring-up
            placed, blocked = await self._place(ctx, spec, step.place, retry, mine)
            actions += placed
            blocked_why = (
                f"rolling out revision {self.state.revision}: {blocked.reason}" if blocked else ""
            )
            if blocked is not None and blocked_why != self._recorded_unschedulable():
                unschedulable = ClusterUnschedulable(
                    name=self.name,
                    missing=step.place - placed,
                    reason=blocked_why,
                    candidates=blocked.candidates,
                )
                await self._persist_and_wait(ctx, [unschedulable])
        replicas = self.fleet.live.state.replicas.replicas
        known = set(by_id)
        refreshed = [replicas[r.replica_id] for r in mine]
        added = [
            r for r in replicas.values() if r.cluster == self.name and r.replica_id not in known
        ]
        return actions, refreshed + added

    def _fully_rolled_out(self, spec: ClusterSpec, mine: list[ReplicaView]) -> bool:
        """Every wanted replica runs the current revision and is ready (and no other runs)."""
        nodes = self.fleet.live.state.nodes.nodes
        active = [r for r in mine if r.status in ACTIVE]
        if not all(self._current(r) for r in active):
            return False
        ready = [r for r in active if r.status == "ready" and _good_everywhere(nodes, r)]
        return len(ready) >= spec.replicas

    def _rolled_out_now(self) -> list[DomainEvent]:
        """`ClusterRolledOut` for the current revision if it has rolled out and that is not
        recorded yet: written with the next revision, so an automatic rollback of that one
        knows where to go back to. (Revision 1 is recorded only then: a cluster that is never
        revised writes nothing more than it did before revisions.)"""
        spec, revision = self.state.spec, self.state.revision
        if spec is None or self.state.rolled_out == revision:
            return []
        mine = [
            r for r in self.fleet.live.state.replicas.replicas.values() if r.cluster == self.name
        ]
        if not self._fully_rolled_out(spec, mine):
            return []
        return [ClusterRolledOut(name=self.name, revision=revision)]

    async def _note_rolled_out(
        self, ctx: ActorContext[ClusterMsg], spec: ClusterSpec, mine: list[ReplicaView]
    ) -> None:
        """A revision after the first has rolled out: record it once."""
        revision = self.state.revision
        if revision <= 1 or self.state.rolled_out == revision:
            return
        if not self._fully_rolled_out(spec, mine):
            return
        await self._persist_and_wait(ctx, [ClusterRolledOut(name=self.name, revision=revision)])
        ctx.log.info("cluster_rolled_out", revision=revision, replicas=spec.replicas)

    def _slow_groups(self, spec: ClusterSpec, mine: list[ReplicaView]) -> dict[str, str]:
        """Pipelines in service whose estimate per token, with their links as measured now,
        is over the spec's `max_token_latency_ms`: replica id -> why."""
        s = spec.sharding
        if s is None or s.max_token_latency_ms <= 0:
            return {}
        fleet = self.fleet.live.state
        slow: dict[str, str] = {}
        for r in mine:
            if r.status not in ACTIVE or len(r.stages) < 2 or not self._current(r):
                continue
            found = group_estimate(spec, r, fleet.nodes.nodes, fleet.links)
            if found is not None and found[1]:
                slow[r.replica_id] = found[1]
        return slow

    def _in_service(self, mine: list[ReplicaView], slow: Mapping[str, str]) -> list[ReplicaView]:
        """Replicas that count as serving: active on good nodes, and not a group whose links
        have become too slow for its spec's bound."""
        nodes = self.fleet.live.state.nodes.nodes
        return [
            r
            for r in mine
            if r.status in ACTIVE and _good_everywhere(nodes, r) and r.replica_id not in slow
        ]

    async def _retire(self, spec: ClusterSpec, mine: list[ReplicaView]) -> int:
        """Steps 3 and 4: replicas on degraded or drained nodes, and groups whose links are
        too slow now, stop once replacements are ready; then extras on good nodes stop,
        not-ready and newest first."""
        nodes = self.fleet.live.state.nodes.nodes
        actions = last = 0
        slow = self._slow_groups(spec, mine)
        good_ready = [r for r in self._in_service(mine, slow) if r.status == "ready"]
        if len(good_ready) >= spec.replicas:
            for r in mine:
                if r.status in ACTIVE and r.replica_id in slow and _good_everywhere(nodes, r):
                    why = f"links too slow: {slow[r.replica_id]}"
                    last = max(last, await self._tell(r, Stop(why), spec))
                    actions += 1
            for r in mine:
                bad = [nodes.get(n) for n in r.node_ids if not _good(nodes.get(n))]
                node = bad[0] if bad else None
                if r.status in ACTIVE and bad and not any(_lost(n) for n in bad):
                    why = "node drained" if node and node.drained else "node degraded"
                    last = max(last, await self._tell(r, Stop(why), spec))
                    actions += 1
        serving = self._in_service(mine, slow)
        # While outdated replicas serve, the rollout's plan decides what leaves: its surge
        # replicas are not extras.
        rolling = not all(self._current(r) for r in serving)
        extra = 0 if rolling else len(serving) - spec.replicas
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
        *,
        because: str = "",
    ) -> tuple[int, NoFit | None]:
        live = self.fleet.live
        if missing and (secrets := await self.fleet.secrets_unavailable(spec)):
            return 0, NoFit(reason=secrets)  # each replica placed would fail at once
        rng = self.fleet.scheduler_rng()
        next_ordinal = max((_ordinal(r) for r in mine), default=-1) + 1
        placed = 0
        for _ in range(missing):
            slot = retry.pop(0) if retry else None
            avoid = _at_fault(slot) if slot is not None else ()
            fleet = live.state
            # Every replica, all clusters: the scheduler knows which statuses still hold GPUs.
            everyone = list(fleet.replicas.replicas.values())
            nodes = [n for n in fleet.nodes.nodes.values() if self.fleet.placeable(n.node_id)]
            # In the controller's grace some nodes are not heard from yet: a decision that
            # would be different with them (none fits, or one stacks replicas) waits for them.
            waiting = len(nodes) < len(fleet.nodes.nodes)
            now_ns = ctx.env.clock.wall_ns()  # a cordon holds until this passes its end
            stages: tuple[StagePlacement, ...] = ()
            if spec.sharding is not None:
                # The model's memory decides the GPUs: a node's, or a pipeline over several,
                # placed in one event or not at all (docs/sharding.md).
                links = fleet.links  # measured; a pair not measured yet is assumed
                # Never two of one cluster on one node when it can be avoided: first away from
                # the nodes its other groups use, then from the node at fault only, then
                # anywhere (better there than nowhere).
                apart = _nodes_of_others(spec, everyone, slot)
                tries = [frozenset(avoid) | apart, frozenset(avoid), frozenset()]
                decision: Placement | NoFit = NoFit(reason="")
                for away in dict.fromkeys(tries):
                    decision, stages = place_group(
                        spec, nodes, everyone, avoid=away, now_ns=now_ns, links=links,
                        because=because,
                    )  # fmt: skip
                    if not isinstance(decision, NoFit):
                        break
            else:
                decision = schedule(nodes, spec, everyone, rng, avoid=avoid, now_ns=now_ns)
                if isinstance(decision, NoFit) and avoid:
                    # The node the slot failed on is the only fit: better there than nowhere.
                    decision = schedule(nodes, spec, everyone, rng, now_ns=now_ns)
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
                    revision=self.state.revision,
                    stages=stages,
                ),
                timeout=30.0,
                expect=list,
            )
            await live.wait_for(positions[-1])
            placed += 1
        return placed, None

    def _recorded_unschedulable(self) -> str:
        """The reason the read model shows now: a placement clears it there, so a cluster
        short again for the same reason records it again (its own last event would not)."""
        view = self.fleet.live.state.clusters.clusters.get(self.name)
        return view.unschedulable if view is not None else ""

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
