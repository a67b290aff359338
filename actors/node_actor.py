"""NodeActor: one per node. Records registrations and decides health.

Heartbeats themselves are recorded by the controller's HeartbeatRecorder, in their own stream;
the actor sees only those that could change its verdict (actors/heartbeat_recorder.py).

Silence is measured on the loop clock from the last heartbeat the controller took in, or from
this incarnation's start if later: after a controller restart every node gets a fresh grace
period instead of being declared offline for the time the controller itself was down.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from events import (
    DomainEvent,
    NodeCordoned,
    NodeDrained,
    NodeHealthChanged,
    NodeRegistered,
    NodeRemoved,
    NodeUncordoned,
    NodeUndrained,
    stream_name,
)
from events.contract.messages import Heartbeat, Register, RegisterReply
from events.node import HealthState
from runtime.actor import ActorContext
from runtime.errors import ActorStopped, MailboxFull
from runtime.event_sourced import EventSourcedActor

from .errors import ControllerError
from .health import HealthPolicy, evaluate, missed_heartbeats
from .heartbeat_recorder import NodeLiveness, verdict_changes
from .silence_watch import SilenceWatch


class NodeState(msgspec.Struct, kw_only=True):
    registered: bool = False
    registration: NodeRegistered | None = None
    health: HealthState = "healthy"
    reason: str = "registered"
    drained: bool = False
    leaving: bool = False  # drained because its agent said it was going away
    removed: bool = False
    cordoned: bool = False  # a cordon recorded and not lifted (it may have ended since)


@dataclass(frozen=True, slots=True)
class Beat:
    heartbeat: Heartbeat


@dataclass(frozen=True, slots=True)
class Join:
    register: Register


@dataclass(frozen=True, slots=True)
class CheckSilence:
    pass


@dataclass(frozen=True, slots=True)
class Drain:
    reason: str = ""
    leaving: bool = False  # its agent is going away: back when it registers again


@dataclass(frozen=True, slots=True)
class Undrain:
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Cordon:
    """No new replicas on the node until `until_ns` (wall clock ns; 0: until uncordoned)."""

    until_ns: int = 0
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Uncordon:
    reason: str = ""


@dataclass(frozen=True, slots=True)
class Remove:
    """Take the node out of the fleet's listings: only an offline node (its replicas have
    already moved); its agent registering again brings it back."""

    reason: str = ""
    asked: bool = True  # an operator's: a node not offline is an error to say, not to ignore


class NotRemovable(ControllerError):
    """The node is not offline: its replicas would have nowhere recorded to go."""


@dataclass(frozen=True, slots=True)
class LookFailed:
    """The silence look raised: crash this incarnation, as a failing task of its own would."""

    error: Exception


NodeMsg = Beat | Join | CheckSilence | Drain | Undrain | Cordon | Uncordon | Remove | LookFailed


class NodeActor(EventSourcedActor[NodeMsg, NodeState]):
    snapshot_type = NodeState

    def __init__(
        self,
        node_id: str,
        policy: HealthPolicy,
        silence: SilenceWatch,
        liveness: NodeLiveness | None = None,
    ) -> None:
        self.node_id = node_id
        self.policy = policy
        self.silence = silence
        self.liveness = liveness if liveness is not None else NodeLiveness()
        self._stop_watching: Callable[[], None] | None = None
        self._at_deadline = False  # the next look is at a threshold: check the silence
        self._limit = policy.offline_after  # the threshold that look is for, in heartbeats
        self._stream = stream_name("node", node_id)
        self._grace_from = 0.0  # silence counts from here at the earliest
        self._suspect_for: float | None = None  # the last_seen a suspicion was logged for
        self.cut_off_at: float | None = None  # when this controller lost its bus, if it has
        self._check_pending = False  # a CheckSilence told and not yet handled

    @property
    def last_seen(self) -> float:
        """Silence counts from here. A node not heard from since this controller began to hear
        heartbeats may still serve on a lease kept while nobody took them in: for it, from
        the end of such a lease at the earliest (NodeLiveness.leases_end)."""
        liveness = self.liveness
        heard = liveness.last_heard.get(self.node_id, 0.0)
        if heard < liveness.hearing_since:
            heard = max(heard, liveness.leases_end)
        return max(self._grace_from, heard)

    def _in_grace(self, now: float) -> bool:
        """No verdict on silence yet: this controller began to hear too recently, and has not
        heard this node since (the grace: HealthPolicy.grace_s)."""
        liveness = self.liveness
        heard = liveness.last_heard.get(self.node_id, -1.0)
        return now < liveness.grace_until and heard < liveness.hearing_since

    @property
    def suspect_logged(self) -> bool:
        # A heartbeat since the suspicion moves last_seen on, and a new silence may be logged.
        return self._suspect_for == self.last_seen

    @property
    def stream(self) -> str:
        return self._stream

    def initial_state(self) -> NodeState:
        return NodeState()

    def evolve(self, state: NodeState, payload: DomainEvent) -> NodeState:
        match payload:
            case NodeRegistered():
                state.registered = True
                state.registration = payload
                state.removed = False
            case NodeHealthChanged(state=health, reason=reason):
                state.health = health
                state.reason = reason
            case NodeDrained(leaving=leaving):
                state.drained = True
                state.leaving = leaving
            case NodeUndrained():
                state.drained = False
                state.leaving = False
            case NodeCordoned():
                state.cordoned = True
            case NodeUncordoned():
                state.cordoned = False
            case NodeRemoved():
                state.removed = True
                state.cordoned = False  # as the registry: registering again starts afresh
            case _:
                pass
        return state

    async def on_recovered(self, ctx: ActorContext[NodeMsg]) -> None:
        self._check_pending = False  # a crash dropped whatever was in the mailbox
        now = ctx.env.clock.monotonic()
        self._grace_from = now
        self._share_verdict()
        self._at_deadline = False
        self._stop_watching = self.silence.watch(
            self.node_id,
            now,
            lambda at: self._look(ctx, at),
            on_error=lambda exc: self._tell_failed_look(ctx, exc),
        )

    async def on_stop(self, ctx: ActorContext[NodeMsg]) -> None:
        if self._stop_watching is not None:
            self._stop_watching()

    def _look(self, ctx: ActorContext[NodeMsg], now: float) -> float | None:
        """The fleet's SilenceWatch calls this when this node's next look is due: check the
        silence if a threshold came up, and say when to look next.

        The next look is when the next threshold (suspect, then offline) would be crossed if no
        heartbeat came, rather than on a fixed tick: a heartbeat in between only moves that
        moment, and the watch finds it moved when it gets there.
        """
        if ctx.self_ref.stopped:
            return None
        interval = self.policy.heartbeat_interval
        if self._check_pending:
            # The last check is still in the mailbox (a loop that lags behind a flood): telling
            # it again every few milliseconds only lengthens the queue (seen under 20,000
            # heartbeats/s, docs/performance.md). Look again once it has had a chance to run.
            return now + interval / 16
        if not self.liveness.hearing:
            return now + interval  # the controller takes no heartbeats in yet: nothing to judge
        if self._at_deadline:
            self._at_deadline = False
            if not _connected(ctx):
                if self.cut_off_at is None:
                    self._tell(ctx, CheckSilence())  # it records the cut-off
                # The Bus protocol has no reconnect event to wait for: look again shortly.
                return now + interval / 4
            if self.cut_off_at is not None or (
                missed_heartbeats(now, self.last_seen, self.policy) >= self._limit
            ):
                self._check_pending = self._tell(ctx, CheckSilence())
        if not self.state.registered or self.state.removed:
            return now + interval
        if self.state.health == "offline":
            # Looked at each interval still: a heartbeat that brings it back must find the
            # next silence watched from there.
            retention = self.policy.remove_offline_after_s
            if retention > 0 and now - self.last_seen >= retention:
                reason = f"offline for over {retention:g} s (--remove-offline-after)"
                self._tell(ctx, Remove(reason, asked=False))
            return now + interval
        limit = self.policy.offline_after
        if not self.suspect_logged:
            limit = min(limit, self.policy.suspect_after)
        self._limit = limit
        self._at_deadline = True
        deadline = self.last_seen + limit * interval
        # Float rounding can leave a deadline a hair short of the threshold: never wait less.
        return now + max(deadline - now, interval / 64)

    def _tell_failed_look(self, ctx: ActorContext[NodeMsg], exc: Exception) -> None:
        self._tell(ctx, LookFailed(exc))

    def _tell(self, ctx: ActorContext[NodeMsg], msg: NodeMsg) -> bool:
        # A full mailbox is busy with this node already: the next look, at most a quarter
        # interval later, asks again. (The per-node task this replaced crashed the actor.)
        try:
            ctx.self_ref.try_tell(msg)
        except (MailboxFull, ActorStopped):
            return False
        return True

    async def handle(self, ctx: ActorContext[NodeMsg], msg: NodeMsg) -> object:
        try:
            return await self._handle(ctx, msg)
        finally:
            self._share_verdict()  # also after a failed persist, which reloads state

    def _share_verdict(self) -> None:
        self.liveness.verdicts[self.node_id] = (self.state.health, self.state.reason)

    async def _handle(self, ctx: ActorContext[NodeMsg], msg: NodeMsg) -> object:
        match msg:
            case Beat(heartbeat=hb):
                return await self._on_heartbeat(ctx, hb)
            case Join(register=reg):
                return await self._on_register(ctx, reg)
            case CheckSilence():
                self._check_pending = False
                return await self._on_check(ctx)
            case LookFailed(error=error):
                raise RuntimeError(f"the silence look failed: {error!r}") from error
            case Drain(reason=reason, leaving=leaving):
                if not self.state.drained:
                    drained = NodeDrained(node_id=self.node_id, reason=reason, leaving=leaving)
                    return await self.persist(ctx, [drained])
                return []
            case Undrain(reason=reason):
                if self.state.drained:
                    return await self.persist(
                        ctx, [NodeUndrained(node_id=self.node_id, reason=reason)]
                    )
                return []
            case Cordon(until_ns=until_ns, reason=reason):
                # Recorded again, a cordon replaces the one before (a new end, a new reason).
                cordon = NodeCordoned(node_id=self.node_id, until_ns=until_ns, reason=reason)
                ctx.log.info("node_cordoned", until_ns=until_ns, reason=reason)
                return await self.persist(ctx, [cordon])
            case Uncordon(reason=reason):
                if self.state.cordoned:
                    return await self.persist(
                        ctx, [NodeUncordoned(node_id=self.node_id, reason=reason)]
                    )
                return []
            case Remove(reason=reason, asked=asked):
                if self.state.removed or not self.state.registered:
                    return []
                if self.state.health != "offline":
                    if not asked:
                        return []  # heard from again since the retention look
                    raise NotRemovable(
                        f"node {self.node_id} is {self.state.health}, not offline: stop its "
                        "agent (or drain it and wait for its replicas to move) first"
                    )
                ctx.log.info("node_removed", reason=reason)
                return await self.persist(ctx, [NodeRemoved(node_id=self.node_id, reason=reason)])

    async def _on_register(self, ctx: ActorContext[NodeMsg], reg: Register) -> RegisterReply:
        self._grace_from = max(self._grace_from, ctx.env.clock.monotonic())
        event = NodeRegistered(
            node_id=reg.node_id,
            hostname=reg.hostname,
            address=reg.address,
            region=reg.region,
            zone=reg.zone,
            labels=reg.labels,
            gpus=reg.gpus,
            driver_version=reg.driver_version,
            cuda_version=reg.cuda_version,
            agent_version=reg.agent_version,
            price_per_hour=reg.price_per_hour,
            sealing_key=reg.sealing_key,
            model_cache=reg.model_cache,
            cached_models=reg.cached_models,
            images=reg.images,
        )
        if self.state.registration != event or self.state.removed:
            await self.persist(ctx, [event])
            ctx.log.info("node_registered", gpus=len(reg.gpus), region=reg.region)
        if self.state.drained and self.state.leaving:
            back = NodeUndrained(node_id=self.node_id, reason="registered again after leaving")
            await self.persist(ctx, [back])
        return RegisterReply(accepted=True, heartbeat_interval_s=self.policy.heartbeat_interval)

    async def _on_heartbeat(self, ctx: ActorContext[NodeMsg], hb: Heartbeat) -> list[int]:
        """A heartbeat the controller judged could change the verdict (already recorded, or
        being recorded, by the HeartbeatRecorder): decide on this actor's own state."""
        state = self.state
        if not verdict_changes(hb, state.health, state.reason, self.policy):
            return []  # the verdict it was passed on for has already been reached
        verdict = evaluate(hb.gpus, hb.probe_error, state.health, state.reason, self.policy)
        ctx.log.info(
            "node_health_changed",
            state=verdict.state,
            reason=verdict.reason,
            detail=verdict.detail,
        )
        return await self.persist(
            ctx,
            [
                NodeHealthChanged(
                    node_id=self.node_id,
                    state=verdict.state,
                    reason=verdict.reason,
                    detail=verdict.detail,
                )
            ],
        )

    async def _on_check(self, ctx: ActorContext[NodeMsg]) -> list[int]:
        if not self.state.registered or self.state.health == "offline":
            return []
        if not self.liveness.hearing:
            return []
        now = ctx.env.clock.monotonic()
        if not _connected(ctx):
            # The controller cannot hear anyone: a silence now says nothing about the node.
            # Declaring the fleet offline would move every replica for an outage of our own.
            if self.cut_off_at is None:
                self.cut_off_at = now
                ctx.log.warning(
                    "controller_cut_off", last_seen_s_ago=round(now - self.last_seen, 3)
                )
            return []
        if self.cut_off_at is not None:
            # Back: count missed heartbeats from now, as after a controller restart.
            ctx.log.info("controller_reconnected", cut_off_s=round(now - self.cut_off_at, 3))
            self.cut_off_at = None
            self._grace_from = max(self._grace_from, now)
            return []
        missed = missed_heartbeats(now, self.last_seen, self.policy)
        if missed >= self.policy.offline_after:
            ctx.log.warning("node_offline", missed=missed)
            return await self.persist(
                ctx,
                [
                    NodeHealthChanged(
                        node_id=self.node_id,
                        state="offline",
                        reason="missed_heartbeats",
                        detail=f"{missed} heartbeats missed",
                    )
                ],
            )
        if (
            missed >= self.policy.suspect_after
            and not self.suspect_logged
            and not self._in_grace(now)
        ):
            self._suspect_for = self.last_seen
            ctx.log.warning("node_suspect", missed=missed)
            # Only a healthy node becomes suspect: a degraded or unhealthy verdict says more
            # (an unhealthy node's replicas are unroutable; suspect ones would route again).
            if self.state.health == "healthy":
                # Shared before the write, so a heartbeat that lands meanwhile is passed on to
                # this actor and clears the suspicion rather than being judged no change.
                self.liveness.verdicts[self.node_id] = ("suspect", "missed_heartbeats")
                return await self.persist(
                    ctx,
                    [
                        NodeHealthChanged(
                            node_id=self.node_id,
                            state="suspect",
                            reason="missed_heartbeats",
                            detail=f"{missed} heartbeats missed",
                        )
                    ],
                )
        return []


def _connected(ctx: ActorContext[NodeMsg]) -> bool:
    """Whether this controller's bus is connected: while it is not, it hears nobody."""
    return ctx.env.bus.is_connected
