"""The invariants a simulated run must keep, checked as it goes, and the timings it reports.

Safety is checked at every step: each event is examined as it is committed (placements against
the state just before them, stream versions), and each request the gateway sends is checked
against the controller's record. Liveness, the rebuild and the command queue are checked once
the faults have stopped and the world has settled (liveness with sim/liveness.py, which
`gpumesh chaos` judges a real stack with too).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

import projections
from actors.scheduler import RELEASED, accepts, eligible_gpus
from events import (
    ClusterScaled,
    ClusterSpec,
    Envelope,
    NodeHealthChanged,
    NodeRegistered,
    NodeRemoved,
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaStageReady,
    ReplicaStarting,
    ReplicaStopped,
    ReplicaStopping,
)
from events.contract.messages import RouteEntry
from events.controller import ControllerGrace
from projections import FleetState
from projections.views import ReplicaView

from .clock import SIM_EPOCH_NS
from .liveness import short_in, unplaced_groups

if TYPE_CHECKING:
    from .world import World

# Faults the node's health must reflect, and how soon: offline after 3 missed 1 s heartbeats,
# plus a heartbeat interval of slack. A fault shorter than that may rightly go unnoticed.
MUST_DETECT = frozenset(
    {"power_loss", "hang", "partition", "one_way_partition", "ecc", "driver", "churn"}
)
DETECTION_WINDOW_S = 5.0
ROUTE_GRACE_S = 1.0  # a gateway's table may lag the controller by one publish: allow this much
LIVENESS_S = 120.0  # after the faults stop, every cluster is whole again within this
# The events that change a replica's view (status, placement, stages).
REPLICA_EVENTS = (
    ReplicaPlaced,
    ReplicaStageReady,
    ReplicaStarting,
    ReplicaReady,
    ReplicaFailed,
    ReplicaStopping,
    ReplicaStopped,
)
# A node's health verdicts that take a replica's node (any of a pipeline's) out of service.
LOST = ("offline", "unhealthy")
# An autoscaler's decision is stamped when its event is recorded, a little after it was made:
# two decisions a window apart may be recorded this much closer together.
AUTOSCALE_SLACK_S = 0.25


class Struck(Protocol):
    """A node a fault struck: a simulated one, or a real one in `gpumesh chaos`."""

    @property
    def node_id(self) -> str: ...


class Violation(NamedTuple):
    at: float
    invariant: str
    detail: str


@dataclass
class _Pending:
    kind: str
    node_id: str
    at: float
    replicas: dict[str, int]  # replica -> epoch it had on the node when the fault struck
    detected: bool = False
    lasting: float | None = None  # None: it never ends


@dataclass
class Timings:
    detection: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    replacement: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))


class Checker:
    def __init__(self, world: World) -> None:
        self.world = world
        self.state = FleetState()
        self.violations: list[Violation] = []
        self.timings = Timings()
        self.events = 0
        self._versions: dict[str, int] = {}
        self._superseded: dict[tuple[str, int], float] = {}  # (replica, epoch) -> when
        self._offline_since: dict[str, float] = {}
        # Nodes known offline, unhealthy or removed (the log says so), and since when.
        self._lost_since: dict[str, float] = {}
        self._sharded_ready: set[str] = set()  # ready replicas with pipeline stages
        self._reported: set[tuple[object, ...]] = set()  # violations reported once
        self._autoscaled: dict[str, tuple[float, bool]] = {}  # cluster -> (when, went up)
        self._gateway_cut_since: float | None = None  # its table is stale from then
        self._gateway_back_at = -math.inf
        self._pending: list[_Pending] = []
        self._controller_down: list[list[float]] = []  # [from, until]; until inf while down
        # one_writer: the newest term that has appended to the log, who wrote it, and when.
        self._newest_term = 0
        self._newest_writer = ""
        self._newest_at = 0.0
        self._stale_writers: set[tuple[str, int]] = set()  # reported once; never iterated
        self.appends_by_term: dict[int, int] = {}
        self._caught_up = asyncio.Event()

    # -- as the run goes -----------------------------------------------------------------

    async def run(self) -> None:
        async with contextlib.aclosing(self.world.store.subscribe_batches(1)) as batches:
            async for batch in batches:
                for envelope in batch:
                    self.check_event(envelope)

    def check_event(self, envelope: Envelope) -> None:
        self.events += 1
        at = (envelope.recorded_at - SIM_EPOCH_NS) / 1e9
        expected = self._versions.get(envelope.stream, 0) + 1
        if envelope.version != expected:
            self._violate(
                at,
                "contiguous_versions",
                f"{envelope.stream}: version {envelope.version}, expected {expected}",
            )
        self._versions[envelope.stream] = envelope.version
        if self._sharded_ready:
            # The pipelines ready until this instant, before this event may fail one.
            self._check_groups_whole(at)
        payload = envelope.payload
        if isinstance(payload, ReplicaPlaced):
            self._check_placement(at, payload)
            previous = self.state.replicas.replicas.get(payload.replica_id)
            if previous is not None and previous.epoch < payload.epoch:
                self._superseded[(payload.replica_id, previous.epoch)] = at
        elif isinstance(payload, NodeHealthChanged):
            if payload.state == "offline":
                self._offline_since.setdefault(payload.node_id, at)
            else:
                self._offline_since.pop(payload.node_id, None)
            if payload.state in LOST:
                self._lost_since.setdefault(payload.node_id, at)
            else:
                self._lost_since.pop(payload.node_id, None)
            # Suspect is a warning, not yet a verdict on the fault: detection is the verdict
            # that moves replicas (offline, unhealthy) or degrades the node.
            if payload.state not in ("healthy", "suspect"):
                for pending in self._pending:
                    if pending.node_id == payload.node_id and not pending.detected:
                        pending.detected = True
                        self.timings.detection[pending.kind].append(at - pending.at)
        elif isinstance(payload, ControllerGrace) and _standbys(self.world):
            # A leader that begins to hear (a new term, or back on NATS) detects nothing it
            # does not hear from until its grace is over: count it as up only from then.
            self.controller_up(at + payload.grace_s)
        elif isinstance(payload, ControllerGrace):
            # The same for the one controller, restarted (its restart already counted it up):
            # a node that lost power while it was down, and is back before the grace ends,
            # is rightly never declared offline (hypothesis found it: tests/sim/test_stateful).
            self._blind(at, at + payload.grace_s)
        elif isinstance(payload, ClusterScaled) and payload.cause.startswith("autoscale"):
            self._check_autoscale(at, payload)
        elif isinstance(payload, ReplicaReady):
            for pending in self._pending:
                old = pending.replicas.get(payload.replica_id)
                if old is not None and payload.epoch > old:
                    del pending.replicas[payload.replica_id]
                    self.timings.replacement[pending.kind].append(at - pending.at)
        elif isinstance(payload, NodeRemoved):
            self._lost_since.setdefault(payload.node_id, at)
        elif isinstance(payload, NodeRegistered) and payload.node_id not in self.state.nodes.nodes:
            self._lost_since.pop(payload.node_id, None)  # removed, and back as a new node
        projections.apply(self.state, envelope)
        if isinstance(payload, REPLICA_EVENTS):
            self._after_replica_event(at, payload.replica_id, payload.epoch)

    def _after_replica_event(self, at: float, replica_id: str, epoch: int) -> None:
        """A replica's view changed (folded already): keep the set of ready pipelines, check
        that one just ready has every worker stage up, and that a replica that holds GPUs
        (placed, or live again) shares none with another."""
        view = self.state.replicas.replicas.get(replica_id)
        if view is None or view.epoch != epoch:
            return  # a stale epoch's event: the fold ignored it
        if view.stages and view.status == "ready":
            if replica_id not in self._sharded_ready:
                self._sharded_ready.add(replica_id)
                self._check_stages_up(at, view)
        else:
            self._sharded_ready.discard(replica_id)
        if view.status not in RELEASED:
            self._check_held_once(at, view)

    def _check_stages_up(self, at: float, view: ReplicaView) -> None:
        """no_partial_group_serving, its first half: a pipeline is ready only once every
        worker stage (rank >= 1) was recorded up at this epoch (replica.stage_ready.v1)."""
        missing = [
            s.rank for s in view.stages if s.rank >= 1 and s.rank not in view.stage_addresses
        ]
        if missing:
            self._violate_once(
                at,
                "no_partial_group_serving",
                view,
                f"{view.replica_id}@{view.epoch} ready with worker stage(s) "
                f"{', '.join(map(str, missing))} never recorded up",
            )

    def _check_groups_whole(self, at: float) -> None:
        """no_partial_group_serving, its second half: no ready pipeline keeps a stage on a node
        known offline, unhealthy or removed for longer than a single-node replica's route may
        (ROUTE_GRACE_S of controller uptime, as route_not_offline allows): the group must have
        been failed by then."""
        replicas = self.state.replicas.replicas
        for replica_id in sorted(self._sharded_ready):
            view = replicas[replica_id]
            # Every stage's node, read from the placement itself rather than through
            # ReplicaView.node_ids, which the controller uses to decide: a bug there must not
            # blind the check of its outcome.
            for node_id in [s.node_id for s in view.stages]:
                since = self._lost_since.get(node_id)
                if since is None or self._watched(since, at) <= ROUTE_GRACE_S:
                    continue
                node = self.state.nodes.nodes.get(node_id)
                health = node.health if node is not None else "removed"
                self._violate_once(
                    at,
                    "no_partial_group_serving",
                    view,
                    f"{replica_id}@{view.epoch} still ready with its stage on {node_id} "
                    f"{health} since {since:.3f}",
                )
                break

    def _check_held_once(self, at: float, view: ReplicaView) -> None:
        """no_gpu_held_twice: no (node, GPU) that this live replica holds (every stage's, for a
        pipeline) is held by another live replica, nor twice by this one."""
        mine: set[tuple[str, int]] = set()
        for node_id, indices in view.holds():
            for index in indices:
                if (node_id, index) in mine:
                    self._violate_once(
                        at,
                        "no_gpu_held_twice",
                        view,
                        f"{view.replica_id}@{view.epoch} holds {node_id} GPU {index} twice",
                    )
                    return
                mine.add((node_id, index))
        for other in sorted(self.state.replicas.replicas.values(), key=lambda r: r.replica_id):
            if other.replica_id == view.replica_id or other.status in RELEASED:
                continue
            for node_id, indices in other.holds():
                both = sorted(i for i in indices if (node_id, i) in mine)
                if both:
                    ours = f"{view.replica_id}@{view.epoch}"
                    theirs = f"{other.replica_id}@{other.epoch}"
                    key = ("no_gpu_held_twice", node_id, both[0], *sorted((ours, theirs)))
                    if key not in self._reported:  # once a pair, whichever moves next
                        self._reported.add(key)
                        self._violate(
                            at,
                            "no_gpu_held_twice",
                            f"{node_id} GPU {both[0]} held by {ours} ({view.status}) and by "
                            f"{theirs} ({other.status})",
                        )
                    return

    def _violate_once(self, at: float, invariant: str, view: ReplicaView, detail: str) -> None:
        """A violation about one replica's epoch, reported the first time only: a state that
        holds for many events is one fault, not one per event."""
        key = (invariant, view.replica_id, view.epoch)
        if key not in self._reported:
            self._reported.add(key)
            self._violate(at, invariant, detail)

    def _check_autoscale(self, at: float, scaled: ClusterScaled) -> None:
        """The autoscaler never goes outside its cluster's bounds, and never reverses a
        decision within that direction's window (docs/autoscaling.md), except for a cold
        start (from zero replicas: requests wait) and for bringing a count made by hand back
        within the bounds."""
        view = self.state.clusters.clusters.get(scaled.name)
        policy = view.spec.autoscale if view is not None else None
        if policy is None:
            self._violate(at, "autoscale_bounds", f"{scaled.name}: autoscaled with no policy")
            return
        lo, hi = policy.min_replicas, policy.max_replicas
        if not lo <= scaled.replicas <= hi:
            self._violate(
                at,
                "autoscale_bounds",
                f"{scaled.name}: {scaled.previous} -> {scaled.replicas} outside {lo}..{hi}",
            )
        self.world.note(
            f"{scaled.name}: autoscaled {scaled.previous} -> {scaled.replicas} "
            f"({scaled.cause.removeprefix('autoscale: ')})"
        )
        up = scaled.replicas > scaled.previous
        before = self._autoscaled.get(scaled.name)
        self._autoscaled[scaled.name] = (at, up)
        if before is None or not lo <= scaled.previous <= hi:
            return
        then, was_up = before
        window = policy.down_window_s if was_up else policy.up_window_s
        cold_start = up and scaled.previous == 0
        if was_up != up and not cold_start and at - then < window - AUTOSCALE_SLACK_S:
            self._violate(
                at,
                "autoscale_no_flapping",
                f"{scaled.name}: {'up' if was_up else 'down'} at {then:.3f}, then "
                f"{scaled.previous} -> {scaled.replicas} after {at - then:.1f} s "
                f"(window {window:g} s)",
            )

    def _check_placement(self, at: float, placed: ReplicaPlaced) -> None:
        state = self.state
        cluster = state.clusters.clusters.get(placed.cluster)
        node = state.nodes.nodes.get(placed.node_id)
        if cluster is None or node is None:
            self._violate(
                at,
                "placement_fits",
                f"{placed.replica_id} placed on unknown {'cluster' if cluster is None else 'node'}",
            )
            return
        spec = cluster.spec
        live = [
            r
            for r in state.replicas.replicas.values()
            if r.status not in RELEASED and r.replica_id != placed.replica_id
        ]
        # Fit: the chosen GPUs exist, match the model and VRAM, and nobody else holds them.
        gpus = {g.index: g for g in node.gpus}
        taken = {i for r in live if r.node_id == node.node_id for i in r.gpu_indices}
        for index in placed.gpu_indices:
            gpu = gpus.get(index)
            if gpu is None or index in taken:
                self._violate(
                    at,
                    "placement_fits",
                    f"{placed.replica_id} on {node.node_id} GPU {index}: "
                    f"{'no such GPU' if gpu is None else 'already taken'}",
                )
            elif not accepts(spec.gpu.models, gpu.model):
                self._violate(
                    at,
                    "placement_fits",
                    f"{placed.replica_id}: {gpu.model} is not one of {spec.gpu.models}",
                )
            elif gpu.vram_mib < spec.gpu.min_vram_mib:
                self._violate(
                    at,
                    "placement_fits",
                    f"{placed.replica_id}: {gpu.vram_mib} MiB < {spec.gpu.min_vram_mib}",
                )
        if spec.sharding is not None:
            # The plan decides the GPUs of a sharded spec (docs/sharding.md), not gpu.count,
            # and has its own order of nodes, not the scheduler's spread.
            self._check_stages_fit(at, placed, spec)
            return
        if len(placed.gpu_indices) != spec.gpu.count:
            self._violate(
                at,
                "placement_fits",
                f"{placed.replica_id}: {len(placed.gpu_indices)} GPUs, spec asks {spec.gpu.count}",
            )
        # Spread: a second replica of the cluster on this node only if no other node could.
        ours = [r for r in live if r.cluster == placed.cluster]
        if any(r.node_id == placed.node_id for r in ours):
            holding = {r.node_id for r in ours}
            # The node this replica was last placed on is not eligible for it: the scheduler
            # avoids it by design (a crash loop there must not be re-placed there).
            before = state.replicas.replicas.get(placed.replica_id)
            if before is not None:
                holding.add(before.node_id)
            for other in sorted(state.nodes.nodes):
                if other in holding or other == placed.node_id:
                    continue
                if eligible_gpus(state.nodes.nodes[other], spec, live) is not None:
                    self._violate(
                        at,
                        "spread",
                        f"{placed.replica_id}: a second replica of {placed.cluster} on "
                        f"{placed.node_id} while {other} had room",
                    )
                    break

    def _check_stages_fit(self, at: float, placed: ReplicaPlaced, spec: ClusterSpec) -> None:
        """placement_fits for a pipeline's stages: the head is the placement's node and GPUs,
        and every worker stage's GPUs exist on a known node and match the model and VRAM.
        (Whether another replica holds them is no_gpu_held_twice's, once it is folded.)"""
        stages = placed.stages
        if not stages:
            return  # a plan on one node: the head's GPUs, checked above
        head = stages[0]
        if (head.rank, head.node_id, head.gpu_indices) != (0, placed.node_id, placed.gpu_indices):
            self._violate(
                at,
                "placement_fits",
                f"{placed.replica_id}: stage 0 is {head.node_id} {head.gpu_indices}, not the "
                f"placement's {placed.node_id} {placed.gpu_indices}",
            )
        for stage in stages[1:]:
            node = self.state.nodes.nodes.get(stage.node_id)
            if node is None:
                self._violate(
                    at,
                    "placement_fits",
                    f"{placed.replica_id} stage {stage.rank} on unknown node {stage.node_id}",
                )
                continue
            gpus = {g.index: g for g in node.gpus}
            for index in stage.gpu_indices:
                gpu = gpus.get(index)
                if gpu is None:
                    why = "no such GPU"
                elif not accepts(spec.gpu.models, gpu.model):
                    why = f"{gpu.model} is not one of {spec.gpu.models}"
                elif gpu.vram_mib < spec.gpu.min_vram_mib:
                    why = f"{gpu.vram_mib} MiB < {spec.gpu.min_vram_mib}"
                else:
                    continue
                self._violate(
                    at,
                    "placement_fits",
                    f"{placed.replica_id} stage {stage.rank} on {stage.node_id} GPU {index}: {why}",
                )

    def gateway_cut(self, at: float) -> None:
        self._gateway_cut_since = at

    def gateway_back(self, at: float) -> None:
        self._gateway_cut_since = None
        self._gateway_back_at = at

    def on_route(self, route: RouteEntry, now: float) -> None:
        """The gateway is about to send a request to `route`. A gateway cut off from NATS
        routes on a table that no longer changes: what it sends is then the nodes' fences' to
        refuse (on_served), not a routing fault."""
        if self._gateway_cut_since is not None or now - self._gateway_back_at <= ROUTE_GRACE_S:
            return
        since = self._superseded.get((route.replica_id, route.epoch))
        if since is not None and now - since > ROUTE_GRACE_S:
            self._violate(
                now,
                "route_current_epoch",
                f"request to {route.replica_id}@{route.epoch}, superseded at {since:.3f}",
            )
        offline = self._offline_since.get(route.node_id)
        if offline is not None and now - offline > ROUTE_GRACE_S:
            self._violate(
                now,
                "route_not_offline",
                f"request to {route.replica_id} on {route.node_id}, offline since {offline:.3f}",
            )

    def on_served(self, route: RouteEntry, node_id: str, now: float) -> None:
        """A node took a request for `route` in (its fence let it through). No other epoch of
        that replica may be routable at the same instant: running on a node a gateway can
        reach, and let through by that node's fence. This is what the lease guarantees,
        whatever the controller, NATS or the network did: it ends on the old node before the
        controller may place a new epoch, and a gateway with a stale table (several gateways,
        one cut off) would otherwise reach both."""
        for other in self.world.nodes.values():
            if other.agent is None or not other.powered or other.partitioned or other.hung:
                continue
            for workload in other.driver.running():
                if (
                    workload.replica_id == route.replica_id
                    and workload.epoch != route.epoch
                    and not other.agent.fenced(workload.replica_id, workload.epoch)
                ):
                    self._violate(
                        now,
                        "one_serving_epoch",
                        f"{route.replica_id}@{route.epoch} served on {node_id} while "
                        f"@{workload.epoch} is routable on {other.node_id}",
                    )
                    return

    def controller_down(self, at: float) -> None:
        self._controller_down.append([at, math.inf])

    def leader_lost(self, at: float) -> None:
        """With standbys: a fault stopped the leader acting (crash, pause, cut-off) at `at`,
        until a leader's next grace event (controller_up) says when one detects again."""
        down = self._controller_down
        if down and down[-1][1] == math.inf:
            return
        if down and down[-1][1] > at:
            down[-1][1] = math.inf  # still in the last one's grace: that one goes on
            return
        down.append([at, math.inf])

    def on_append(self, writer: str, term: int, at: float) -> None:
        """`writer`, leading in `term`, got an append into the log at `at`. No term older than
        the newest that has appended may append again: two leaders would be writing."""
        self.appends_by_term[term] = self.appends_by_term.get(term, 0) + 1
        if term < self._newest_term:
            if (writer, term) not in self._stale_writers:
                self._stale_writers.add((writer, term))
                self._violate(
                    at,
                    "one_writer",
                    f"{writer} appended in term {term} after {self._newest_writer} had "
                    f"appended in term {self._newest_term} (at {self._newest_at:.3f})",
                )
            return
        if term > self._newest_term:
            self._newest_term, self._newest_writer, self._newest_at = term, writer, at

    def _blind(self, since: float, until: float) -> None:
        """No detection possible in [since, until]: merged into the down intervals, so that
        `_watched` never counts a moment twice."""
        down = self._controller_down
        if down and down[-1][1] >= since:
            down[-1][1] = max(down[-1][1], until)
        else:
            down.append([since, until])

    def controller_up(self, at: float) -> None:
        if self._controller_down and self._controller_down[-1][1] == math.inf:
            self._controller_down[-1][1] = at

    def _watched(self, start: float, end: float) -> float:
        """How long the controller was up between `start` and `end`: nobody can detect a
        fault while it is down."""
        down = sum(
            max(0.0, min(end, until) - max(start, since)) for since, until in self._controller_down
        )
        return (end - start) - down

    def fault(
        self, kind: str, node: Struck | None, at: float, lasting: float | None = None
    ) -> None:
        if node is None:
            return
        view = self.state.nodes.nodes.get(node.node_id)
        if view is not None and view.health not in ("healthy", "suspect"):
            return  # already held unhealthy or offline: there is no change left to detect
        replicas = {  # a pipeline's on any of its stages' nodes: it is lost with any
            r.replica_id: r.epoch
            for r in self.state.replicas.replicas.values()
            if r.status not in RELEASED
            and (r.node_id == node.node_id or any(s.node_id == node.node_id for s in r.stages))
        }
        self._pending.append(_Pending(kind, node.node_id, at, replicas, lasting=lasting))

    def _violate(self, at: float, invariant: str, detail: str) -> None:
        self.violations.append(Violation(round(at, 6), invariant, detail))
        self.world.note(f"VIOLATION {invariant}: {detail}")

    # -- after the faults ----------------------------------------------------------------

    async def finish(self) -> None:
        world = self.world
        now = world.now()
        controller = world.controller
        # Let the checker's own subscription catch up with the log.
        while self.events < len(world.store.read_all_now()):  # noqa: ASYNC110 (no event for it)
            await asyncio.sleep(0.01)
        if controller is None:
            self._violate(now, "liveness", "no controller is running at the end")
            return
        log = world.store.read_all_now()
        upto = [e for e in log if e.position <= controller.live.position]
        if projections.rebuild(upto) != controller.live.state:
            self._violate(
                now, "rebuild_equals_live", "a rebuild of the log differs from live state"
            )
        if self.state != projections.rebuild(log):
            self._violate(now, "rebuild_equals_live", "the checker's fold differs from a rebuild")
        for fault in self._pending:
            end = now if fault.lasting is None else min(now, fault.at + fault.lasting)
            long_enough = self._watched(fault.at, end) >= DETECTION_WINDOW_S
            if fault.kind in MUST_DETECT and long_enough and not fault.detected:
                self._violate(
                    now,
                    "detection",
                    f"{fault.kind} of {fault.node_id} at {fault.at:.3f} was never "
                    "reflected in its health",
                )
        live_state = controller.live.state
        for node_id, node in sorted(world.nodes.items()):
            view = live_state.nodes.nodes.get(node_id)
            if not node.powered or view is None or view.health != "healthy":
                continue
            pending = world.queue.pending(node_id)
            if pending:
                ids = ", ".join(c.command_id for c in pending[:3])
                self._violate(
                    now,
                    "no_command_lost",
                    f"{node_id} is healthy but has {len(pending)} unconsumed: {ids}",
                )
        for short in short_in(live_state, settle_s=world.scenario.settle_s):
            self._violate(now, "liveness", short.detail)
        for short in unplaced_groups(live_state, settle_s=world.scenario.settle_s):
            self._violate(now, "group_serving_or_unschedulable", short.detail)
        if self._sharded_ready:
            self._check_groups_whole(now)


def _standbys(world: object) -> bool:
    """Whether `world` runs standby controllers (a simulated World with `controllers`; never
    `gpumesh chaos`'s run, which checks a real stack's log with this checker)."""
    return getattr(world, "controllers", None) is not None
