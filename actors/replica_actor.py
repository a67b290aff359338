"""ReplicaActor: one per replica slot. Owns `replica/<id>`; every placement raises the epoch.

Agents report what they run; a report is folded into an event only at the current epoch on the
node that holds it. A report of an older epoch, or from another node, is a superseded replica
(a node back from a partition): the actor tells that node to stop it and records nothing, so
nothing can route to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from events import (
    Candidate,
    ClusterSpec,
    DomainEvent,
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaStarting,
    ReplicaStopped,
    ReplicaStopping,
    ReplicaSuspected,
    stream_name,
)
from events.contract.messages import ReplicaState, StartReplica, StopReplica
from events.replica import FailureReason
from projections.views import ReplicaStatus
from runtime.actor import ActorContext
from runtime.command_queue import CommandQueue
from runtime.event_sourced import EventSourcedActor

from .secret_keeper import SecretKeeper, SecretsUnavailable

ACTIVE: tuple[ReplicaStatus, ...] = ("placed", "starting", "ready")


class SlotState(msgspec.Struct, kw_only=True):
    cluster: str = ""
    node_id: str = ""
    epoch: int = 0
    status: ReplicaStatus = "pending"  # no placement yet
    gpu_indices: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class Place:
    spec: ClusterSpec
    node_id: str
    gpu_indices: tuple[int, ...]
    why: str
    candidates: tuple[Candidate, ...] = field(default=())
    revision: int = 0  # the cluster spec's revision this placement runs


@dataclass(frozen=True, slots=True)
class Report:
    node_id: str
    replica: ReplicaState


@dataclass(frozen=True, slots=True)
class Fail:
    reason: FailureReason
    detail: str = ""
    stop_on_node: bool = False  # the node still answers: make sure the workload dies


@dataclass(frozen=True, slots=True)
class Stop:
    reason: str


@dataclass(frozen=True, slots=True)
class Suspect:
    """A gateway ejected this replica: recorded as evidence, it changes no state."""

    epoch: int
    gateway_id: str
    reason: str
    failures: int
    ejected_for_s: float


ReplicaMsg = Place | Report | Fail | Stop | Suspect


def start_command_id(replica_id: str, epoch: int) -> str:
    # Deterministic, so a re-send after a controller crash is deduplicated, never doubled.
    return f"start-{replica_id}-{epoch}"


def stop_command_id(replica_id: str, epoch: int) -> str:
    return f"stop-{replica_id}-{epoch}"


class ReplicaActor(EventSourcedActor[ReplicaMsg, SlotState]):
    snapshot_type = SlotState

    def __init__(
        self,
        replica_id: str,
        commands: CommandQueue,
        spec: ClusterSpec | None,
        *,
        secrets: SecretKeeper | None = None,
    ) -> None:
        self.replica_id = replica_id
        self.commands = commands
        self.spec = spec
        self.secrets = secrets  # seals a spec's secrets to the node (None: sends none)
        self._stream = stream_name("replica", replica_id)

    @property
    def stream(self) -> str:
        return self._stream

    def initial_state(self) -> SlotState:
        return SlotState()

    def evolve(self, state: SlotState, payload: DomainEvent) -> SlotState:
        match payload:
            case ReplicaPlaced():
                state.cluster = payload.cluster
                state.node_id = payload.node_id
                state.epoch = payload.epoch
                state.status = "placed"
                state.gpu_indices = payload.gpu_indices
            case ReplicaStarting(epoch=e) if e == state.epoch:
                state.status = "starting"
            case ReplicaReady(epoch=e) if e == state.epoch:
                state.status = "ready"
            case ReplicaFailed(epoch=e) if e == state.epoch:
                state.status = "failed"
            case ReplicaStopping(epoch=e) if e == state.epoch:
                state.status = "stopping"
            case ReplicaStopped(epoch=e) if e == state.epoch:
                state.status = "stopped"
            case _:
                pass
        return state

    async def on_recovered(self, ctx: ActorContext[ReplicaMsg]) -> None:
        # After a controller crash a command may have been recorded but never sent: send again.
        # The command id is deterministic, so a duplicate is dropped by the queue and the agent.
        state = self.state
        if state.epoch == 0:
            return  # a new slot: nothing was ever sent
        if state.status in ("placed", "starting") and self.spec is not None:
            why = await self._send_start(state)
            if why:
                await self._fail_unsent(ctx, state.epoch, why)
        elif state.status == "stopping":
            await self._send_stop(state.node_id, state.epoch, "stopping")

    async def handle(self, ctx: ActorContext[ReplicaMsg], msg: ReplicaMsg) -> object:
        match msg:
            case Place():
                return await self._place(ctx, msg)
            case Report(node_id=node_id, replica=report):
                return await self._report(ctx, node_id, report)
            case Fail(reason=reason, detail=detail, stop_on_node=stop):
                state = self.state
                if state.status not in (*ACTIVE, "stopping"):
                    return []
                positions = await self.persist(
                    ctx,
                    [
                        ReplicaFailed(
                            replica_id=self.replica_id,
                            epoch=state.epoch,
                            reason=reason,
                            detail=detail,
                        )
                    ],
                )
                if stop:
                    await self._send_stop(state.node_id, state.epoch, reason)
                return positions
            case Suspect():
                state = self.state
                if msg.epoch != state.epoch or state.status not in ACTIVE:
                    return []  # an old epoch, or already known to be down
                return await self.persist(
                    ctx,
                    [
                        ReplicaSuspected(
                            replica_id=self.replica_id,
                            epoch=msg.epoch,
                            gateway_id=msg.gateway_id,
                            reason=msg.reason,
                            failures=msg.failures,
                            ejected_for_s=msg.ejected_for_s,
                        )
                    ],
                )
            case Stop(reason=reason):
                state = self.state
                if state.status not in ACTIVE:
                    return []
                positions = await self.persist(
                    ctx,
                    [ReplicaStopping(replica_id=self.replica_id, epoch=state.epoch, reason=reason)],
                )
                await self._send_stop(state.node_id, state.epoch, reason)
                return positions

    async def _place(self, ctx: ActorContext[ReplicaMsg], msg: Place) -> list[int]:
        self.spec = msg.spec
        epoch = self.state.epoch + 1
        positions = await self.persist(
            ctx,
            [
                ReplicaPlaced(
                    replica_id=self.replica_id,
                    cluster=msg.spec.name,
                    node_id=msg.node_id,
                    gpu_indices=msg.gpu_indices,
                    epoch=epoch,
                    why=msg.why,
                    candidates=msg.candidates,
                    revision=msg.revision,
                )
            ],
        )
        ctx.log.info("replica_placed", node=msg.node_id, epoch=epoch, why=msg.why)
        why = await self._send_start(self.state)
        if why:
            positions += await self._fail_unsent(ctx, epoch, why)
        return positions

    async def _send_start(self, state: SlotState) -> str:
        """Send StartReplica; '' once sent, else why it cannot be (its secrets cannot go to
        the node: an older agent would start the workload without them)."""
        assert self.spec is not None
        sealed = None
        if self.secrets is not None:
            try:
                sealed = await self.secrets.seal_for(
                    state.node_id, self.replica_id, state.epoch, self.spec
                )
            except SecretsUnavailable as exc:
                return exc.reason
        elif self.spec.secret_env:
            return "this controller was given no secret store: the secrets cannot be sent"
        await self.commands.send(
            state.node_id,
            StartReplica(
                command_id=start_command_id(self.replica_id, state.epoch),
                replica_id=self.replica_id,
                epoch=state.epoch,
                spec=self.spec,
                gpu_indices=state.gpu_indices,
                secrets=sealed,
            ),
        )
        return ""

    async def _fail_unsent(self, ctx: ActorContext[ReplicaMsg], epoch: int, why: str) -> list[int]:
        ctx.log.warning("replica_not_started", epoch=epoch, why=why)
        failed = ReplicaFailed(
            replica_id=self.replica_id, epoch=epoch, reason="start_failed", detail=why
        )
        return await self.persist(ctx, [failed])

    async def _send_stop(self, node_id: str, epoch: int, reason: str) -> None:
        await self.commands.send(
            node_id,
            StopReplica(
                command_id=stop_command_id(self.replica_id, epoch),
                replica_id=self.replica_id,
                epoch=epoch,
                reason=reason,
            ),
        )

    async def _report(
        self, ctx: ActorContext[ReplicaMsg], node_id: str, report: ReplicaState
    ) -> list[int]:
        state = self.state
        if report.state == "failed":
            # The agent lists a failed replica until told to stop it: clear it (idempotent).
            await self._send_stop(node_id, report.epoch, "failed")
        if report.epoch < state.epoch or (report.epoch == state.epoch and node_id != state.node_id):
            if report.state in ("starting", "ready"):
                ctx.log.warning(
                    "superseded_replica_stopped",
                    node=node_id,
                    epoch=report.epoch,
                    current_epoch=state.epoch,
                )
                await self._send_stop(node_id, report.epoch, "superseded")
            return []
        if report.epoch > state.epoch:
            ctx.log.warning("report_from_the_future", node=node_id, epoch=report.epoch)
            return []
        event: DomainEvent | None = None
        rid, epoch = self.replica_id, state.epoch
        match report.state:
            case "starting" if state.status in ("placed", "ready"):
                # From ready: the workload crashed and restarts in place; not routable until
                # it is ready again.
                event = ReplicaStarting(replica_id=rid, epoch=epoch, port=report.port)
            case "ready" if state.status in ("placed", "starting"):
                event = ReplicaReady(replica_id=rid, epoch=epoch, address=report.address)
            case "failed" if state.status in (*ACTIVE, "stopping"):
                reason: FailureReason = (
                    "readiness_timeout" if "readiness" in report.detail else "workload_exited"
                )
                event = ReplicaFailed(
                    replica_id=rid, epoch=epoch, reason=reason, detail=report.detail
                )
            case "stopped" if state.status != "stopped":
                event = ReplicaStopped(replica_id=rid, epoch=epoch, exit_code=report.exit_code)
            case _:
                pass
        if event is None:
            return []
        return await self.persist(ctx, [event])
