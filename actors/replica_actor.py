"""ReplicaActor: one per replica slot. Owns `replica/<id>`; every placement raises the epoch.

Agents report what they run; a report is folded into an event only at the current epoch on the
node that holds it. A report of an older epoch, or from another node, is a superseded replica
(a node back from a partition): the actor tells that node to stop it and records nothing, so
nothing can route to it.

A sharded replica (docs/sharding.md) is a group of pipeline stages on several nodes, placed in
one event. Its workers (ranks >= 1) are started first; each one's "ready" is recorded
(`ReplicaStageReady`) with the address the head connects to, and once every worker is up the
head (rank 0) is started with their addresses. The replica is ready when its head is. Any
stage failing, restarting or stopping on its own fails the whole group, and every stage is
told to stop: a pipeline missing a stage cannot serve, and its survivors hold GPUs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from events import (
    Candidate,
    ClusterSpec,
    DomainEvent,
    ReplicaFailed,
    ReplicaPlaced,
    ReplicaReady,
    ReplicaStageReady,
    ReplicaStarting,
    ReplicaStopped,
    ReplicaStopping,
    ReplicaSuspected,
    StagePlacement,
    stream_name,
)
from events.contract.messages import ReplicaState, StageLaunch, StartReplica, StopReplica
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
    stages: tuple[StagePlacement, ...] = ()  # a sharded replica's pipeline, the head first
    stage_addresses: dict[int, str] = {}  # workers up at this epoch: rank -> host:port


@dataclass(frozen=True, slots=True)
class Place:
    spec: ClusterSpec
    node_id: str
    gpu_indices: tuple[int, ...]
    why: str
    candidates: tuple[Candidate, ...] = field(default=())
    revision: int = 0  # the cluster spec's revision this placement runs
    stages: tuple[StagePlacement, ...] = ()  # a sharded replica's, all placed at once


@dataclass(frozen=True, slots=True)
class Report:
    node_id: str
    replica: ReplicaState


@dataclass(frozen=True, slots=True)
class Fail:
    reason: FailureReason
    detail: str = ""
    stop_on_node: bool = False  # the node still answers: make sure the workload dies
    node_id: str = ""  # the node at fault, when known


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


def start_command_id(replica_id: str, epoch: int, rank: int = 0) -> str:
    # Deterministic, so a re-send after a controller crash is deduplicated, never doubled. A
    # worker stage's carries its rank: the command queue drops a repeated id whatever the node.
    return f"start-{replica_id}-{epoch}" + (f"-r{rank}" if rank else "")


def stop_command_id(replica_id: str, epoch: int, rank: int = 0) -> str:
    return f"stop-{replica_id}-{epoch}" + (f"-r{rank}" if rank else "")


NodeHost = Callable[[str], str]


def _no_host(node_id: str) -> str:
    return ""


class ReplicaActor(EventSourcedActor[ReplicaMsg, SlotState]):
    snapshot_type = SlotState

    def __init__(
        self,
        replica_id: str,
        commands: CommandQueue,
        spec: ClusterSpec | None,
        *,
        secrets: SecretKeeper | None = None,
        node_host: NodeHost = _no_host,
    ) -> None:
        self.replica_id = replica_id
        self.commands = commands
        self.spec = spec
        self.secrets = secrets  # seals a spec's secrets to the node (None: sends none)
        self.node_host = node_host  # a node's registered address: a pipeline's {head_host}
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
                state.stages = payload.stages
                state.stage_addresses = {}
            case ReplicaStageReady(epoch=e) if e == state.epoch:
                state.stage_addresses = {**state.stage_addresses, payload.rank: payload.address}
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
            await self._stop_everywhere(state, "stopping")

    async def handle(self, ctx: ActorContext[ReplicaMsg], msg: ReplicaMsg) -> object:
        match msg:
            case Place():
                return await self._place(ctx, msg)
            case Report(node_id=node_id, replica=report):
                return await self._report(ctx, node_id, report)
            case Fail(reason=reason, detail=detail, stop_on_node=stop, node_id=at_fault):
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
                            node_id=at_fault,
                        )
                    ],
                )
                if stop or state.stages:
                    # A pipeline's surviving stages hold GPUs and cannot serve: stop them all.
                    await self._stop_everywhere(state, reason)
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
                await self._stop_everywhere(state, reason)
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
                    stages=msg.stages,
                )
            ],
        )
        ctx.log.info(
            "replica_placed",
            node=msg.node_id,
            epoch=epoch,
            why=msg.why,
            stages=[s.node_id for s in msg.stages],
        )
        why = await self._send_start(self.state)
        if why:
            positions += await self._fail_unsent(ctx, epoch, why)
        return positions

    async def _send_start(self, state: SlotState) -> str:
        """Send StartReplica (to a pipeline's workers not up yet, and to its head once they
        all are); '' once sent, else why it cannot be (its secrets cannot go to the node: an
        older agent would start the workload without them)."""
        if not state.stages:
            return await self._start_on(state.node_id, state.gpu_indices, None, state.epoch)
        for stage in state.stages[1:]:
            if stage.rank not in state.stage_addresses:
                why = await self._start_on(
                    stage.node_id, stage.gpu_indices, self._launch(state, stage), state.epoch
                )
                if why:
                    return why
        return await self._start_head_when_ready(state)

    async def _start_head_when_ready(self, state: SlotState) -> str:
        workers = state.stages[1:]
        if any(stage.rank not in state.stage_addresses for stage in workers):
            return ""  # the head connects to every worker as it starts: it waits for them
        head = state.stages[0]
        return await self._start_on(
            head.node_id, head.gpu_indices, self._launch(state, head), state.epoch
        )

    def _launch(self, state: SlotState, stage: StagePlacement) -> StageLaunch:
        stages = state.stages
        return StageLaunch(
            rank=stage.rank,
            world_size=len(stages),
            first_layer=stage.first_layer,
            last_layer=stage.last_layer,
            total_layers=max(s.last_layer for s in stages),
            split=tuple(s.last_layer - s.first_layer for s in stages),
            head_host=self.node_host(stages[0].node_id),
            peers=tuple(state.stage_addresses[s.rank] for s in stages[1:])
            if stage.rank == 0
            else (),
            peer_nodes=tuple(s.node_id for s in stages[1:]) if stage.rank == 0 else (),
            head_node=stages[0].node_id,
            overlay=self.spec is not None
            and self.spec.sharding is not None
            and self.spec.sharding.stage_links == "overlay",
        )

    async def _start_on(
        self, node_id: str, gpu_indices: tuple[int, ...], stage: StageLaunch | None, epoch: int
    ) -> str:
        assert self.spec is not None
        sealed = None
        if self.secrets is not None:
            try:
                sealed = await self.secrets.seal_for(node_id, self.replica_id, epoch, self.spec)
            except SecretsUnavailable as exc:
                return exc.reason
        elif self.spec.secret_env:
            return "this controller was given no secret store: the secrets cannot be sent"
        await self.commands.send(
            node_id,
            StartReplica(
                command_id=start_command_id(self.replica_id, epoch, stage.rank if stage else 0),
                replica_id=self.replica_id,
                epoch=epoch,
                spec=self.spec,
                gpu_indices=gpu_indices,
                secrets=sealed,
                stage=stage,
            ),
        )
        return ""

    async def _fail_unsent(self, ctx: ActorContext[ReplicaMsg], epoch: int, why: str) -> list[int]:
        ctx.log.warning("replica_not_started", epoch=epoch, why=why)
        failed = ReplicaFailed(
            replica_id=self.replica_id, epoch=epoch, reason="start_failed", detail=why
        )
        positions = await self.persist(ctx, [failed])
        if self.state.stages:
            await self._stop_everywhere(self.state, "a stage could not be started")
        return positions

    async def _stop_everywhere(self, state: SlotState, reason: str) -> None:
        """Stop the replica on its node, or every stage of a pipeline on theirs."""
        if not state.stages:
            await self._send_stop(state.node_id, state.epoch, reason)
            return
        for stage in state.stages:
            await self._send_stop(stage.node_id, state.epoch, reason, stage.rank)

    async def _send_stop(self, node_id: str, epoch: int, reason: str, rank: int = 0) -> None:
        await self.commands.send(
            node_id,
            StopReplica(
                command_id=stop_command_id(self.replica_id, epoch, rank),
                replica_id=self.replica_id,
                epoch=epoch,
                reason=reason,
            ),
        )

    async def _report(
        self, ctx: ActorContext[ReplicaMsg], node_id: str, report: ReplicaState
    ) -> list[int]:
        state = self.state
        rank = _rank_on(state, node_id) if report.epoch == state.epoch else 0
        if report.state == "failed":
            # The agent lists a failed replica until told to stop it: clear it (idempotent).
            await self._send_stop(node_id, report.epoch, "failed", rank or 0)
        if rank:
            return await self._stage_report(ctx, state, rank, node_id, report)
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
                    replica_id=rid,
                    epoch=epoch,
                    reason=reason,
                    detail=report.detail,
                    node_id=node_id,
                )
            case "stopped" if state.status != "stopped":
                event = ReplicaStopped(replica_id=rid, epoch=epoch, exit_code=report.exit_code)
            case _:
                pass
        if event is None:
            return []
        positions = await self.persist(ctx, [event])
        if state.stages and isinstance(event, ReplicaFailed | ReplicaStopped):
            await self._stop_everywhere(state, f"the head {report.state}")
        return positions

    async def _stage_report(
        self,
        ctx: ActorContext[ReplicaMsg],
        state: SlotState,
        rank: int,
        node_id: str,
        report: ReplicaState,
    ) -> list[int]:
        """A worker stage's report at the current epoch (the head's is the replica's own)."""
        rid, epoch = self.replica_id, state.epoch
        if state.status not in ACTIVE:
            return []  # failed or stopping: every stage was told to stop already
        up = rank in state.stage_addresses
        failure = ""
        match report.state:
            case "ready" if not up:
                positions = await self.persist(
                    ctx,
                    [
                        ReplicaStageReady(
                            replica_id=rid,
                            epoch=epoch,
                            rank=rank,
                            node_id=node_id,
                            address=report.address,
                        )
                    ],
                )
                ctx.log.info("stage_ready", rank=rank, node=node_id, address=report.address)
                why = await self._start_head_when_ready(self.state)
                if why:
                    positions += await self._fail_unsent(ctx, epoch, why)
                return positions
            case "starting" if up:
                # The head held state in it (weights, KV cache): a restart in place loses it.
                failure = f"restarted ({report.detail or 'it exited'})"
            case "failed":
                failure = report.detail or "it failed"
            case "stopped":
                failure = f"stopped ({report.detail or 'not asked to'})"
            case _:
                return []
        reason: FailureReason = (
            "readiness_timeout" if "readiness" in report.detail else "workload_exited"
        )
        detail = f"stage {rank} on {node_id}: {failure}"
        ctx.log.warning("stage_failed", rank=rank, node=node_id, detail=detail)
        positions = await self.persist(
            ctx,
            [
                ReplicaFailed(
                    replica_id=rid, epoch=epoch, reason=reason, detail=detail, node_id=node_id
                )
            ],
        )
        await self._stop_everywhere(state, f"stage {rank} failed")
        return positions


def _rank_on(state: SlotState, node_id: str) -> int | None:
    """The rank of this epoch's stage on `node_id`: None when none runs there, 0 for the head
    (and for a replica on one node)."""
    if not state.stages:
        return 0 if node_id == state.node_id else None
    for stage in state.stages:
        if stage.node_id == node_id:
            return stage.rank
    return None
