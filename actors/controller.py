"""The controller: node, cluster and replica actors over the live fleet state, fed by the bus.

It owns every task it starts (one TaskGroup, one ActorSystem). Messages from agents are
decoded at the edge; garbage is counted, logged and dropped, and never reaches an actor.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from events import ClusterCreated, ClusterSpec, ClusterSpecChanged, stream_name, stream_of
from events.contract import subjects
from events.contract.messages import (
    CanarySplit,
    Command,
    GatewayLoad,
    Heartbeat,
    HeartbeatAck,
    Leaving,
    LeavingReply,
    PullImage,
    Register,
    RegisterReply,
    ReplicaLease,
    ReplicaReport,
    ReplicaSuspicion,
    RoutingUpdate,
)
from events.controller import ControllerGrace, GraceReason
from events.errors import EventStoreError
from events.secret_store import MemorySecretStore, SecretStore
from projections import FleetState
from runtime.command_queue import CommandQueue, Delivery
from runtime.env import BusError, Env, Msg, RandomSource
from runtime.supervision import SupervisionPolicy
from runtime.system import ActorRef, ActorSystem
from wire.sealing import EphemeralSource

from .autoscaler import EVALUATE_EVERY_S, Autoscaler, Decision
from .cluster_actor import Autoscale, ClusterActor, ClusterMsg, Reconcile
from .fenced_store import FencedBus, LeaseGuard
from .health import HealthPolicy
from .heartbeat_recorder import HeartbeatRecorder, NodeLiveness
from .intake_limit import IntakeLimiter
from .link_survey import LinkSurvey
from .live_state import LiveState
from .node_actor import Beat, Drain, Join, NodeActor, NodeMsg
from .replica_actor import Fail, ReplicaActor, ReplicaMsg, Report, Suspect
from .scheduler import could_host, image_ref
from .secret_keeper import SecretKeeper
from .silence_watch import SilenceWatch

if TYPE_CHECKING:
    from .metrics import LogMetrics

T = TypeVar("T")
_N = TypeVar("_N", Register, Leaving, ReplicaReport)  # what a node sends on its own subjects

LEASE_INDEX_REFRESH_S = 0.25

# Actors restart on a crash; a run of crashes escalates and stops the controller loudly.
ACTOR_POLICY = SupervisionPolicy(max_restarts=5, window=60.0)


@dataclass(frozen=True, slots=True)
class ControllerConfig:
    health: HealthPolicy = field(default_factory=HealthPolicy)
    reconcile_interval: float = 1.0  # a periodic pass catches anything a signal missed
    compact_heartbeats_after: float | None = None  # seconds; None keeps every heartbeat
    # Routing updates are plain publishes (at most once): re-send the table this often so a
    # gateway that missed one converges without waiting for the next change.
    routing_refresh_interval: float = 5.0
    # A node may send this many heartbeats per heartbeat interval on average, and this many at
    # once (an agent flushing what it buffered through a short outage); the rest are dropped.
    heartbeat_rate_per_interval: float = 4.0
    heartbeat_burst: float = 20.0
    drop_log_interval: float = 1.0  # at most one "message_dropped" line per kind this often
    controller_id: str = "controller"  # names its stream, `controller/<id>`
    # The leadership term this controller runs in (actors/leadership.py); 0 when it holds no
    # lease. Its commands and leases carry it, and agents drop those of older terms.
    term: int = 0
    # Counts what the live state folds, for Prometheus (actors/metrics.py); None: nothing.
    metrics: LogMetrics | None = None
    # While some cluster allows pipeline stages across nodes, their candidate nodes measure
    # their links this often (actors/link_survey.py); 0: never.
    link_survey_interval: float = 30.0


class Controller:
    def __init__(
        self,
        env: Env,
        commands: CommandQueue,
        config: ControllerConfig | None = None,
        *,
        state: FleetState | None = None,
        guard: LeaseGuard | None = None,
        secrets: SecretStore | None = None,
        ephemeral: EphemeralSource | None = None,
    ) -> None:
        """`state`: a fold of the log already made (a standby's), which `run` only brings up
        to date instead of rebuilding. `guard`: the leadership this controller runs under;
        once it no longer holds the lease, nothing is published (actors/fenced_store.py,
        FencedBus), which the store and the commands must be fenced for by their owner."""
        if guard is not None:
            env = dataclasses.replace(env, bus=FencedBus(env.bus, guard))
        self.env = env
        self.config = config or ControllerConfig()
        in_term = _InTerm(commands, self.config.term) if self.config.term else commands
        self.commands = _Persistent(in_term, log=env.log)
        self.live = LiveState(env.store, state)
        # Secret values live in `secrets`, never in the log (actors/secret_keeper.py). `ephemeral`:
        # the sealing's one-time keys (None: from the OS; the simulator passes seeded ones).
        self.secrets = SecretKeeper(
            secrets if secrets is not None else MemorySecretStore(),
            lambda node_id: self.live.state.nodes.nodes.get(node_id),
            ephemeral=ephemeral,
        )
        self.placement_lock = asyncio.Lock()
        self._tasks: asyncio.TaskGroup | None = None  # while serving: its own tasks' owner
        self.dropped: Counter[str] = Counter()  # garbage and unroutable messages, by kind
        self._drop_logged: dict[str, tuple[float, int]] = {}  # kind -> (when, total then)
        self._lease_index: dict[str, tuple[ReplicaLease, ...]] = {}
        self._leases_at = float("-inf")
        health = self.config.health
        self._heartbeat_limit = IntakeLimiter(
            env.clock,
            rate_per_s=self.config.heartbeat_rate_per_interval / health.heartbeat_interval,
            burst=self.config.heartbeat_burst,
        )
        self.liveness = NodeLiveness()
        # The node actors' silence deadlines, on one timer; closed when run() ends.
        self.silence = SilenceWatch(retry_s=health.heartbeat_interval / 4)
        self.heartbeats = HeartbeatRecorder(env, self._heartbeats_lost)
        self.ready = asyncio.Event()
        self._system: ActorSystem | None = None
        self._rng = env.derive_rng("scheduler")
        self._spawn_lock = asyncio.Lock()
        # The cluster actors by name, so a reconcile pass need not scan every actor (nodes
        # included: O(fleet) per pass, most of a 10,000-node registration storm).
        self._cluster_refs: dict[str, ActorRef[ClusterMsg]] = {}
        # The node actors by id: every heartbeat looks its node's up, and the actor system's
        # lookup by name (a coroutine, a closure and a dict per call) was 6% of the
        # controller's CPU per heartbeat (py-spy, bench/heartbeats.py --store jetstream-r3).
        self._node_refs: dict[str, ActorRef[NodeMsg]] = {}
        self._last_routes: tuple[Any, ...] | None = None
        self.autoscaler = Autoscaler(env.clock, self._specs)
        self.log = env.log.bind(component="controller")
        self.link_survey = LinkSurvey(
            env,
            self.live,
            interval_s=self.config.link_survey_interval,
            log=env.log.bind(component="link_survey"),
        )

    # -- what the actors see (cluster_actor.Fleet) ------------------------------------------

    def scheduler_rng(self) -> RandomSource:
        return self._rng

    async def replica(self, replica_id: str, spec: ClusterSpec | None) -> ActorRef[ReplicaMsg]:
        return await self._get_or_spawn(
            f"replica:{replica_id}",
            lambda: ReplicaActor(
                replica_id, self.commands, spec, secrets=self.secrets, node_host=self._node_host
            ),
            {"replica": replica_id},
        )

    def _node_host(self, node_id: str) -> str:
        node = self.live.state.nodes.nodes.get(node_id)
        return node.address if node is not None else ""

    async def node(self, node_id: str) -> ActorRef[NodeMsg]:
        ref = await self._get_or_spawn(
            f"node:{node_id}",
            lambda: NodeActor(node_id, self.config.health, self.silence, self.liveness),
            {"node": node_id},
        )
        self._node_refs[node_id] = ref
        return ref

    async def cluster(self, name: str) -> ActorRef[ClusterMsg]:
        ref = await self._get_or_spawn(
            f"cluster:{name}", lambda: ClusterActor(name, self), {"cluster": name}
        )
        self._cluster_refs[name] = ref
        return ref

    async def _get_or_spawn(
        self, name: str, factory: Callable[[], Any], context: dict[str, Any]
    ) -> ActorRef[Any]:
        system = self._require_system()
        existing = system.get(name)
        if existing is not None and not existing.stopped:
            return existing
        async with self._spawn_lock:
            existing = system.get(name)
            if existing is not None and not existing.stopped:
                return existing
            return await system.spawn(factory, name, policy=ACTOR_POLICY, context=context)

    def _require_system(self) -> ActorSystem:
        if self._system is None:
            raise RuntimeError("the controller is not running")
        return self._system

    # -- running --------------------------------------------------------------------------

    async def run(
        self, *, extra: list[Callable[[], Coroutine[Any, Any, None]]] | None = None
    ) -> None:
        """Rebuild live state from the log, start the actors, serve until cancelled."""
        await self.live.catch_up()
        self.log.info(
            "controller_recovered",
            position=self.live.position,
            nodes=len(self.live.state.nodes.nodes),
            clusters=len(self.live.state.clusters.clusters),
        )
        try:
            await self._serve_all(extra)
        finally:
            self.silence.close()
            self.env.bus.remove_reconnect_callback(self._on_bus_back)

    async def _serve_all(self, extra: list[Callable[[], Coroutine[Any, Any, None]]] | None) -> None:
        async with ActorSystem(self.env) as system, asyncio.TaskGroup() as tasks:
            self._system = system
            self._tasks = tasks
            observe = self.config.metrics.observe if self.config.metrics is not None else None
            tasks.create_task(self.live.run(observe), name="live-state")
            tasks.create_task(self.heartbeats.run(), name="heartbeats")
            await self._respawn()
            bus = self.env.bus
            subscriptions = [
                (subjects.HEARTBEAT_ALL, self._on_heartbeat),
                (subjects.REGISTER_ALL, self._on_register),
                (subjects.REPORT_ALL, self._on_report),
                (subjects.LEAVING_ALL, self._on_leaving),
                (subjects.SUSPECT, self._on_suspicion),
                (subjects.LOAD, self._on_load),
            ]
            for subject, handler in subscriptions:
                # No queue group: while a leader frozen past its lease still holds its
                # subscriptions, a queue group would hand it a share of every node's heartbeats
                # and the new leader would not hear those nodes. Every leader hears everything;
                # a deposed one can act on none of it (its writes and publishes are fenced).
                sub = await bus.subscribe(subject)
                tasks.create_task(self._serve(sub, handler), name=f"serve:{subject}")
            await self._begin_hearing("started")
            bus.add_reconnect_callback(self._on_bus_back)
            from .control_api import ControlApi

            api = ControlApi(self)
            api_sub = await bus.subscribe(subjects.API_ALL)
            tasks.create_task(self._serve(api_sub, api.handle), name="serve:api")
            tasks.create_task(self._reconcile_loop(), name="reconcile")
            tasks.create_task(self._routing_loop(), name="routing")
            tasks.create_task(self._autoscale_loop(), name="autoscale")
            if self.config.link_survey_interval > 0:
                tasks.create_task(self.link_survey.run(), name="link-survey")
            if self.config.compact_heartbeats_after is not None:
                tasks.create_task(self._compaction_loop(), name="compaction")
            for job in extra or []:
                tasks.create_task(job())
            self.ready.set()
            self.log.info("controller_ready")

    async def _begin_hearing(self, reason: GraceReason) -> None:
        """Heartbeats come in from now: start the grace (HealthPolicy.grace_s) and record it."""
        health = self.config.health
        self.liveness.begin_hearing(self.env.clock.monotonic(), health)
        grace = ControllerGrace(
            controller_id=self.config.controller_id,
            reason=reason,
            grace_s=health.grace_s,
            lease_s=health.lease_s,
        )
        self.log.info("controller_grace", reason=reason, grace_s=health.grace_s)
        stream = stream_of(grace)
        try:
            version = await self.env.store.stream_version(stream)
            await self.env.store.append(stream, [self.env.new_event(grace)], version)
        except EventStoreError as exc:  # the grace holds whether or not it could be written
            self.log.warning("controller_grace_not_recorded", error=str(exc))

    async def _revisions(self, cluster: str) -> dict[int, ClusterSpec]:
        """Every revision's spec of `cluster`, from its stream (the live state keeps only the
        current one). A count changed by a scale is not part of what a replica runs."""
        specs: dict[int, ClusterSpec] = {}
        revision = 0
        for envelope in await self.env.store.read_stream(stream_name("cluster", cluster)):
            match envelope.payload:
                case ClusterCreated(spec=spec):
                    revision = 1
                    specs = {1: spec}
                case ClusterSpecChanged(spec=spec, revision=number):
                    revision = number or revision + 1
                    specs[revision] = spec
                case _:
                    pass
        return specs

    async def _on_bus_back(self) -> None:
        await self._begin_hearing("reconnected")

    def placeable(self, node_id: str) -> bool:
        """Whether a placement may use this node now (NodeLiveness.placeable)."""
        return self.liveness.placeable(node_id, self.env.clock.monotonic())

    async def secrets_unavailable(self, spec: ClusterSpec) -> str:
        """Why `spec`'s secrets can go to no node ('' when they can: SecretKeeper)."""
        return await self.secrets.unavailable(spec) if spec.secret_env else ""

    async def prepull(self, spec: ClusterSpec, position: int) -> list[str]:
        """A `[docker] prepull` spec was recorded at log `position`: tell every node that
        could host one of its replicas (scheduler.could_host) and does not list its image to
        pull it now, ahead of any placement; the nodes asked. Best effort, in a task of the
        controller's own (the cluster's request is answered at once, and a NATS outage costs
        only the pulls); nothing is recorded: what a node pulled shows in its next registration
        (`images`), which placement then prefers. The command id carries the spec's position,
        so a cluster deleted and created again under its name is asked again."""
        if not (spec.docker.prepull and spec.image):
            return []
        image = image_ref(spec.image)
        now_ns = self.env.clock.wall_ns()
        nodes = self.live.state.nodes.nodes
        asked = [
            node_id
            for node_id, node in sorted(nodes.items())
            if image not in node.images and could_host(node, spec, now_ns=now_ns)
        ]
        self.log.info("prepull_requested", cluster=spec.name, image=image, nodes=len(asked))
        if asked:
            work = self._send_pulls(spec.name, image, position, asked)
            if self._tasks is None:
                await work
            else:
                self._tasks.create_task(work, name=f"prepull:{spec.name}")
        return asked

    async def _send_pulls(self, cluster: str, image: str, position: int, nodes: list[str]) -> None:
        for node_id in nodes:
            command = PullImage(
                command_id=f"pull:{cluster}:{position}:{node_id}", image=image, cluster=cluster
            )
            try:
                await self.commands.send(node_id, command)
            except Exception as exc:  # best effort: a replica placed there pulls at its start
                self.log.warning("prepull_not_sent", cluster=cluster, node=node_id, error=str(exc))

    async def _respawn(self) -> None:
        """After a restart: actors for every known node (silence detection restarts with a
        grace period), cluster, and replica still in flight (they re-send their commands)."""
        state = self.live.state
        for node_id in sorted(state.nodes.nodes):
            await self.node(node_id)
        for name in sorted(state.clusters.clusters):
            await self.cluster(name)
        revisions: dict[str, dict[int, ClusterSpec]] = {}  # cluster -> its specs, when needed
        for replica_id, view in sorted(state.replicas.replicas.items()):
            if view.status in ("placed", "starting", "ready", "stopping"):
                cluster = state.clusters.clusters.get(view.cluster)
                spec = cluster.spec if cluster else None
                if cluster is not None and (view.revision or 1) != cluster.revision:
                    # Placed under an earlier revision (a rollout was under way): a start it
                    # sends again must be that revision's, not the current spec under the old
                    # revision's number (the rollout replaces it in its turn).
                    if view.cluster not in revisions:
                        revisions[view.cluster] = await self._revisions(view.cluster)
                    spec = revisions[view.cluster].get(view.revision or 1, spec)
                await self.replica(replica_id, spec)

    async def _serve(self, sub: Any, handler: Callable[[Msg], Awaitable[None]]) -> None:
        try:
            async for msg in sub:
                try:
                    await handler(msg)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    self._drop("garbage", msg, str(exc))
                except EventStoreError as exc:
                    # A full disk refuses the write this message needed (a registration);
                    # the sender retries, and serving everything else goes on.
                    self._drop("store_error", msg, str(exc))
        finally:
            # The connection may outlive this controller (a leader that steps down keeps
            # its process): a subscription left behind would swallow heartbeats that must
            # now find nobody, so that agents keep their lease.
            with contextlib.suppress(BusError):
                await sub.unsubscribe()

    def _heartbeats_lost(self, kind: str, count: int, detail: str) -> None:
        self._drop(f"heartbeat_{kind}", None, detail, count)

    def _drop(self, kind: str, msg: Msg | None, detail: str, count: int = 1) -> None:
        self.dropped[kind] += count
        # A flood of bad messages must not become a flood of log lines (each costs more than
        # dropping the message): one line per kind per interval, with what it left out.
        now = self.env.clock.monotonic()
        when, total_then = self._drop_logged.get(kind, (-1e18, 0))
        if now - when < self.config.drop_log_interval:
            return
        self._drop_logged[kind] = (now, self.dropped[kind])
        self.log.warning(
            "message_dropped",
            kind=kind,
            subject=msg.subject if msg is not None else "",
            detail=detail[:200],
            total=self.dropped[kind],
            not_logged=max(0, self.dropped[kind] - total_then - count),
        )

    # -- agent traffic ------------------------------------------------------------------

    async def _on_heartbeat(self, msg: Msg) -> None:
        # Cheap checks on the subject first: a flood costs a lookup per message, not a decode.
        sender = subjects.node_of(msg.subject)
        if sender not in self.live.state.nodes.nodes:
            self._drop("unregistered", msg, f"node {sender!r} has not registered")
            return
        now = self.env.clock.monotonic()
        if not self._heartbeat_limit.admit(sender, now):
            self._drop("rate_limited", msg, f"node {sender} is over its heartbeat rate")
            return
        if self._heartbeat_limit.oversized(msg.data):
            self._drop("oversized", msg, f"a heartbeat of {len(msg.data)} bytes from {sender}")
            return
        hb = msgspec.json.decode(msg.data, type=Heartbeat)
        if hb.node_id != sender:
            self._drop("impersonation", msg, f"heartbeat for {hb.node_id} on {msg.subject}")
            return
        ref = self._node_refs.get(sender)
        if ref is None or ref.stopped:
            ref = await self.node(sender)
        if not self.heartbeats.offer(hb):
            self._drop("backlog", msg, "the heartbeat recorder's backlog is full")
            return
        self.liveness.heard(hb.node_id, now)
        if self.liveness.may_change_verdict(hb, self.config.health):
            if ref.full:
                # A flooding node fills only its own mailbox; everyone else's heartbeats go on.
                self._drop("flood", msg, f"node {hb.node_id} mailbox full")
                return
            ref.try_tell(Beat(hb))
        for replica in hb.replicas:
            await self._route_report(hb.node_id, replica)
        if msg.reply:
            await self._ack(msg.reply, hb)

    async def _ack(self, reply: str, hb: Heartbeat) -> None:
        """The node's lease: which of its replicas are current, and for how long it may serve
        them without hearing from us again (docs/security.md, Fencing)."""
        health = self.config.health
        ack = HeartbeatAck(
            node_id=hb.node_id,
            seq=hb.seq,
            lease_s=health.lease_s,  # HealthPolicy.lease_s: why it ends before a replacement
            term=self.config.term,
            replicas=self._leases().get(hb.node_id, ()),
        )
        try:
            await self.env.bus.publish(reply, msgspec.json.encode(ack))
        except BusError as exc:  # the agent asks again with its next heartbeat
            self.log.debug("lease_not_sent", node=hb.node_id, error=str(exc))

    def _leases(self) -> dict[str, tuple[ReplicaLease, ...]]:
        # One pass over the replicas per refresh for every node, not one per heartbeat; a lease
        # list at most a refresh old only delays a new replica's first tunnelled request.
        now = self.env.clock.monotonic()
        if now - self._leases_at >= LEASE_INDEX_REFRESH_S:
            index: dict[str, list[ReplicaLease]] = {}
            for view in self.live.state.replicas.replicas.values():
                if view.status in ("placed", "starting", "ready"):
                    lease = ReplicaLease(replica_id=view.replica_id, epoch=view.epoch)
                    for node_id in view.node_ids:  # a pipeline's every stage
                        index.setdefault(node_id, []).append(lease)
            self._lease_index = {node: tuple(leases) for node, leases in index.items()}
            self._leases_at = now
        return self._lease_index

    def _from_its_node(self, msg: Msg, kind: type[_N], what: str) -> _N | None:
        """A node's message decoded, or None (dropped, and counted) when it is too large or
        names a node other than its subject's."""
        if self._heartbeat_limit.oversized(msg.data):
            self._drop("oversized", msg, f"a {what} of {len(msg.data)} bytes")
            return None
        decoded = msgspec.json.decode(msg.data, type=kind)
        if decoded.node_id != subjects.node_of(msg.subject):
            self._drop("impersonation", msg, f"{what} for {decoded.node_id} on {msg.subject}")
            return None
        return decoded

    async def _on_register(self, msg: Msg) -> None:
        reg = self._from_its_node(msg, Register, "registration")
        if reg is None:
            return
        ref = await self.node(reg.node_id)
        self.liveness.heard(reg.node_id, self.env.clock.monotonic())  # it is talking to us
        reply = await ref.ask(Join(reg), timeout=10.0, expect=RegisterReply)
        await self.live.wait_for(await self.env.store.head())
        if msg.reply:
            await self.env.bus.publish(msg.reply, msgspec.json.encode(reply))
        for replica in reg.replicas:
            await self._route_report(reg.node_id, replica)
        await self._fail_missing(reg)

    async def _on_leaving(self, msg: Msg) -> None:
        """An agent going away (SIGTERM): drain its node, so that its replicas are replaced
        elsewhere before they stop; it serves until they are, or until its grace is over."""
        leaving = self._from_its_node(msg, Leaving, "leaving notice")
        if leaving is None:
            return
        self.liveness.heard(leaving.node_id, self.env.clock.monotonic())
        if leaving.node_id not in self.live.state.nodes.nodes:
            reply = LeavingReply(accepted=False, error=f"unknown node {leaving.node_id!r}")
        else:
            why = leaving.reason or "its agent is stopping"
            reason = f"leaving within {leaving.grace_s:g} s: {why}"
            ref = await self.node(leaving.node_id)
            await ref.ask(Drain(reason, leaving=True), timeout=10.0)
            self.log.info("node_leaving", node=leaving.node_id, grace_s=leaving.grace_s)
            reply = LeavingReply(accepted=True)
        if msg.reply:
            await self.env.bus.publish(msg.reply, msgspec.json.encode(reply))

    async def _fail_missing(self, reg: Register) -> None:
        """A (re)registering agent lists everything it runs. A replica we believe starting or
        ready there, at its current epoch, that it does not list is gone (the agent restarted
        and lost it): fail it so it is replaced, instead of routing to nothing."""
        running = {
            (r.replica_id, r.epoch) for r in reg.replicas if r.state in ("starting", "ready")
        }
        state = self.live.state
        for replica_id, view in sorted(state.replicas.replicas.items()):
            if (
                view.status not in ("placed", "starting", "ready")
                or reg.node_id not in view.node_ids
                or (replica_id, view.epoch) in running
            ):
                continue
            if reg.node_id == view.node_id and view.status == "placed":
                continue  # its head is not started yet (it waits for the workers)
            if reg.node_id != view.node_id and view.stage_addresses.keys().isdisjoint(
                s.rank for s in view.stages if s.node_id == reg.node_id
            ):
                continue  # a worker stage not reported up yet: its start may still be queued
            cluster = state.clusters.clusters.get(view.cluster)
            ref = await self.replica(replica_id, cluster.spec if cluster else None)
            await ref.ask(
                Fail(
                    "workload_exited", f"not running on {reg.node_id} after its agent re-registered"
                ),
                timeout=30.0,
            )

    async def _on_report(self, msg: Msg) -> None:
        report = self._from_its_node(msg, ReplicaReport, "report")
        if report is None:
            return
        await self._route_report(report.node_id, report.replica)

    async def _on_suspicion(self, msg: Msg) -> None:
        suspicion = msgspec.json.decode(msg.data, type=ReplicaSuspicion)
        view = self.live.state.replicas.replicas.get(suspicion.replica_id)
        if view is None or view.epoch != suspicion.epoch or view.node_id != suspicion.node_id:
            self._drop("stale_suspicion", msg, f"{suspicion.replica_id}@{suspicion.epoch}")
            return
        cluster = self.live.state.clusters.clusters.get(view.cluster)
        ref = await self.replica(suspicion.replica_id, cluster.spec if cluster else None)
        message = Suspect(
            epoch=suspicion.epoch,
            gateway_id=suspicion.gateway_id[:128],
            reason=suspicion.reason[:64],
            failures=suspicion.failures,
            ejected_for_s=suspicion.ejected_for_s,
        )
        # Evidence, not a command: under load, dropping one beats queueing behind it.
        if not ref.full:
            ref.try_tell(message)

    async def _route_report(self, node_id: str, replica: Any) -> None:
        view = self.live.state.replicas.replicas.get(replica.replica_id)
        if view is None:
            self.log.warning("unknown_replica_reported", node=node_id, replica=replica.replica_id)
            return
        cluster = self.live.state.clusters.clusters.get(view.cluster)
        ref = await self.replica(replica.replica_id, cluster.spec if cluster else None)
        if not ref.full:
            ref.try_tell(Report(node_id, replica))

    # -- loops ------------------------------------------------------------------------

    async def _reconcile_loop(self) -> None:
        changed = self.live.change_signal()
        while True:
            try:
                async with asyncio.timeout(self.config.reconcile_interval):
                    await changed.wait()
            except TimeoutError:
                pass
            changed.clear()
            if self.env.buggify("controller.reconcile.skip"):
                continue
            names = set(self.live.state.clusters.clusters)
            for name, ref in list(self._cluster_refs.items()):
                if ref.stopped:
                    del self._cluster_refs[name]
                else:
                    names.add(name)  # an actor still running for a deleted cluster
            for name in sorted(names):
                ref = await self.cluster(name)
                # Coalesce: one queued Reconcile is as good as many.
                if ref.stats().size == 0:
                    ref.try_tell(Reconcile())

    async def _routing_loop(self) -> None:
        changed = self.live.change_signal()
        last_sent = -math.inf
        while True:
            routing = self.live.state.routing
            current = (
                dict(routing.routes),
                tuple(sorted(routing.live_clusters)),
                self._cold_start(),
                self._splits(),
            )
            now = self.env.clock.monotonic()
            due = now - last_sent >= self.config.routing_refresh_interval
            if current != self._last_routes or due:
                self._last_routes = current
                last_sent = now
                try:
                    await self.env.bus.publish(subjects.ROUTING, self.routing_update())
                except BusError as exc:  # NATS down: the refresh re-sends once it is back
                    self.log.warning("routing_publish_failed", error=str(exc))
            # asyncio.timeout, not wait_for: on 3.11 wait_for loses a cancellation that lands as
            # the event fires (CPython gh-86296), and the controller would never stop.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.config.routing_refresh_interval):
                    await changed.wait()
            changed.clear()

    def _specs(self) -> dict[str, ClusterSpec]:
        return {name: view.spec for name, view in self.live.state.clusters.clusters.items()}

    async def _on_load(self, msg: Msg) -> None:
        report = msgspec.json.decode(msg.data, type=GatewayLoad)
        cold = self.autoscaler.offer(report)
        if cold:  # requests held at zero replicas: a cold start waits for no tick
            await self._autoscale(self.autoscaler.decide(cold))

    async def _autoscale_loop(self) -> None:
        while True:
            await asyncio.sleep(EVALUATE_EVERY_S)
            await self._autoscale(self.autoscaler.decide())

    async def _autoscale(self, decisions: list[tuple[str, Decision]]) -> None:
        for name, d in decisions:
            ref = await self.cluster(name)
            # Told, not asked: the decision is recorded in the cluster actor's turn, and the
            # next evaluation sees the count it set (or, refused, the count that won).
            ref.try_tell(Autoscale(d.replicas, d.previous, d.cause, d.inputs))

    async def _compaction_loop(self) -> None:
        age = self.config.compact_heartbeats_after
        assert age is not None
        while True:
            # Often enough that the log stays near `age` of heartbeats, rarely enough to be cheap.
            await asyncio.sleep(max(60.0, age / 10))
            cutoff = self.env.clock.wall_ns() - int(age * 1e9)
            try:
                removed = await self.env.store.compact_heartbeats(cutoff)
            except EventStoreError as exc:  # a full disk: try again next round
                self.log.warning("heartbeats_not_compacted", error=str(exc))
                continue
            self.log.info("heartbeats_compacted", removed=removed, older_than_s=age)

    def routing_update(self) -> bytes:
        return msgspec.json.encode(
            RoutingUpdate(
                position=self.live.position,
                routes=dict(self.live.state.routing.routes),
                clusters=tuple(sorted(self.live.state.routing.live_clusters)),
                models=self._models(),
                cold_start=self._cold_start(),
                splits=self._splits(),
            )
        )

    def _models(self) -> dict[str, str]:
        """The model names clients send -> their cluster, where a spec's `model` differs from
        its name. A canary serves its cluster's model name (so that the engine takes the
        requests the split hands it), and is left out: the name stays its cluster's."""
        clusters = self.live.state.clusters.clusters
        canaries = {view.canary for view in clusters.values() if view.canary}
        return {
            view.spec.model: name
            for name, view in sorted(clusters.items())
            if view.spec.model and view.spec.model != name and name not in canaries
        }

    def _splits(self) -> dict[str, CanarySplit]:
        """Clusters with a canary running, and the share of their requests it takes."""
        clusters = self.live.state.clusters.clusters
        return {
            name: CanarySplit(to=view.canary, weight=view.canary_weight)
            for name, view in sorted(clusters.items())
            if view.canary and view.canary in clusters
        }

    def _cold_start(self) -> dict[str, float]:
        """Clusters that scale from zero, and how long a gateway holds a request for one."""
        return {
            name: view.spec.autoscale.cold_start_timeout_s
            for name, view in sorted(self.live.state.clusters.clusters.items())
            if view.spec.autoscale is not None and view.spec.autoscale.min_replicas == 0
        }


class _Persistent:
    """The command queue, a send that NATS cannot take now asked again for a while: while the
    command stream elects a leader (its server died) every publish fails for a few seconds, and
    a command given up then (the replica actor crashing three times on it) was never sent
    again; the replica stayed placed and never started. Command ids are deterministic and
    deduplicated, so a repeat is harmless. A fenced refusal (Deposed) is not retried."""

    def __init__(self, queue: CommandQueue, *, log: Any) -> None:
        self._queue = queue
        self._log = log

    async def send(self, node_id: str, command: Command) -> None:
        wait = _COMMAND_RETRY_FIRST_S
        waited = 0.0
        while True:
            try:
                await self._queue.send(node_id, command)
                return
            except BusError as exc:
                if waited >= _COMMAND_RETRY_FOR_S:
                    raise
                self._log.info(
                    "command_send_retry", node=node_id, command=command.command_id, error=str(exc)
                )
            await asyncio.sleep(wait)
            waited += wait
            wait = min(wait * 2, _COMMAND_RETRY_MAX_S)

    def consume(self, node_id: str) -> AsyncIterator[Delivery]:
        return self._queue.consume(node_id)


_COMMAND_RETRY_FIRST_S = 0.25
_COMMAND_RETRY_MAX_S = 2.0
_COMMAND_RETRY_FOR_S = 20.0  # past a stream's election (5-6 s measured), well short of forever


class _InTerm:
    """The command queue, every command stamped with this controller's term on its way out."""

    def __init__(self, queue: CommandQueue, term: int) -> None:
        self._queue = queue
        self._term = term

    async def send(self, node_id: str, command: Command) -> None:
        await self._queue.send(node_id, msgspec.structs.replace(command, term=self._term))

    def consume(self, node_id: str) -> AsyncIterator[Delivery]:
        return self._queue.consume(node_id)
