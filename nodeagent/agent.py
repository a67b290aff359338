"""The node agent's decision logic: register, heartbeat, obey commands, report, take faults.

Time and randomness come from the Env (and the loop's clock), messaging from env.bus and the
CommandQueue, GPUs from a GpuProbe and processes from a WorkloadDriver: with the fakes of each,
the agent runs unchanged on the simulator's virtual-time loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Hashable
from functools import partial
from typing import Any, cast

import msgspec

from events.cluster import ClusterSpec
from events.contract import subjects
from events.contract.messages import (
    LINKS_MAX_PEERS,
    LINKS_MAX_PINGS,
    LINKS_MAX_PUSH_BYTES,
    Fault,
    FaultReply,
    Heartbeat,
    HeartbeatAck,
    LeaderRecord,
    Leaving,
    LeavingReply,
    LinksReply,
    LinksRequest,
    PullImage,
    Register,
    RegisterReply,
    ReplicaReport,
    ReplicaState,
    StageLaunch,
    StartReplica,
    StopReplica,
)
from events.node import GpuMetrics
from events.secret_store import FILE_PREFIX, is_file
from runtime.command_queue import CommandQueue, Delivery
from runtime.env import BusError, Env, Msg, NoResponders, RequestTimeout, is_no_responders
from wire.crl_share import CrlFollower
from wire.errors import WireError
from wire.sealing import NodeKey, SealingError, aad, open_sealed

from .config import AgentConfig
from .fencing_front import DirectFront, front_path
from .gpu.probe import FaultInjectable, GpuProbe, ProbeError
from .link_probe import LinkProbing, describe, measure
from .metrics import AgentCounters
from .model_cache import CACHE_SCAN_S, cached_models
from .replica import ReplicaRunner, http_address
from .stage import stage_spec
from .stage_link import StageLinkClient, StageLinkServer, StageTarget
from .tunnel import TunnelServer
from .workload.base import WorkloadDriver, WorkloadStartError

_REGISTER_REPLY = msgspec.json.Decoder(RegisterReply)
_LEAVING_REPLY = msgspec.json.Decoder(LeavingReply)
_FAULT = msgspec.json.Decoder(Fault)
_LINKS = msgspec.json.Decoder(LinksRequest)
_LINKS_MAX_TIMEOUT_S = 30.0
_HEARTBEAT_ACK = msgspec.json.Decoder(HeartbeatAck)
_LEASE_SEQS_KEPT = 32  # heartbeats whose ack may still arrive

_PROBE_SHARE = 0.8  # of the heartbeat interval: a hung probe delays a heartbeat, never skips it
_RETRY_S = 1.0  # before re-subscribing after the bus or the command stream failed
_REMEMBERED = 10_000  # command ids and finished replicas kept for idempotency
# Past LEADER_ACTS_S after a renewal was seen, before the lease is read for it: for clock rates.
_ACTS_MARGIN_S = 0.05
_LEADER_RECORD = msgspec.json.Decoder(LeaderRecord)

LeaseReader = Callable[[], Awaitable[LeaderRecord | None]]

ReplicaKey = tuple[str, int]


class _Recent:
    """An insertion-ordered set that forgets its oldest entries beyond `limit`."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._items: dict[Hashable, None] = {}

    def add(self, item: Hashable) -> None:
        self._items[item] = None
        if len(self._items) > self._limit:
            del self._items[next(iter(self._items))]

    def __contains__(self, item: object) -> bool:
        return item in self._items


CacheLister = Callable[[str], Awaitable[tuple[str, ...]]]


async def _list_in_thread(cache: str) -> tuple[str, ...]:
    return await asyncio.to_thread(cached_models, cache)


class Agent:
    def __init__(
        self,
        env: Env,
        commands: CommandQueue,
        probe: GpuProbe,
        driver: WorkloadDriver,
        config: AgentConfig,
        *,
        read_lease: LeaseReader | None = None,
        key: NodeKey | None = None,
        list_cache: CacheLister | None = None,
        links: LinkProbing | None = None,
    ) -> None:
        """`read_lease`: the leader lease's record now, read through the lease stream's
        leader (wire/lease_read.py; None when nobody holds it). With it, an agent whose
        controller stopped answering and stopped renewing keeps its lease (the stalled
        leader, below); without it, only "no responders" does that. `key`: the node's
        X25519 key pair, which the controller seals a replica's secrets to (wire/sealing.py);
        without one the agent registers as an older agent, and is sent no secrets.
        `list_cache`: what the model cache holds (default: nodeagent/model_cache.py, in a
        thread; the simulator has no threads, so its tests pass their own). `links`: how it
        measures its links to peers and answers theirs (nodeagent/link_probe.py; None: it
        measures none, and does not answer the controller's links requests)."""
        self.key = key
        self.links = links
        self._list_cache = list_cache or _list_in_thread
        self._env = env.bind(node=config.node_id)
        self._read_lease = read_lease
        self._log: Any = self._env.log
        self._rng = env.derive_rng(f"nodeagent/{config.node_id}")
        self._commands = commands
        self._probe = probe
        self._driver = driver
        self.config = config
        self.heartbeat_interval = config.heartbeat_interval
        self._runners: dict[ReplicaKey, ReplicaRunner] = {}
        self._tasks: dict[ReplicaKey, asyncio.Task[None]] = {}
        self._seen_commands = _Recent(_REMEMBERED)
        self._finished = _Recent(_REMEMBERED)
        self._registered = asyncio.Event()
        self._reregister = asyncio.Event()
        self._group: asyncio.TaskGroup | None = None
        self._seq = 0
        self._probe_failing = False
        self.registrations = 0  # accepted registrations, for tests and status
        self.cached_models: tuple[str, ...] = ()  # what the model cache held when registered
        self.images: tuple[str, ...] = ()  # the container images held when registered
        self._holdings_listed = False
        # The overlay transport's end: HTTP requests over NATS to our workloads, which listen
        # where the driver probes them (loopback unless configured otherwise).
        self._local_host = driver.host
        self.tunnel = TunnelServer(
            env.bus, config.node_id, self.local_url, log=self._log, fence=self.fenced
        )
        # Pipeline stages' links over the overlay (docs/sharding.md): a worker's engine carried
        # to heads that the controller named, and a head's local ports to its workers.
        self.stage_links = StageLinkServer(
            env.bus,
            config.node_id,
            self.stage_address,
            fence=self.fenced,
            admit=self._stage_admits,
            log=self._log,
        )
        self.stage_forwards = StageLinkClient(
            env.bus, config.node_id, new_stream_id=env.new_id, log=self._log
        )
        # Heartbeat acks (the lease) come back under this node's own inbox prefix, the only
        # one a node's NATS permissions let it read.
        self._lease_subject = f"{env.bus.new_inbox()}.lease"
        self.front: DirectFront | None = None
        self._front_base = ""
        if config.direct_front:
            loopback = config.address.startswith("127.") or config.address == "localhost"
            self.front = DirectFront(
                config.address if loopback else "0.0.0.0",
                config.front_port,
                self.local_url,
                self.fenced,
                log=self._log,
            )
        self._sent_at: dict[int, float] = {}  # heartbeat seq -> when it was sent
        self._lease_seq = 0
        self._lease_until: float | None = None
        self._lease_s = 0.0  # the length of the last lease a controller granted
        self._leased: frozenset[tuple[str, int]] = frozenset()
        self.controller_absent = False  # heartbeats find no controller (we are connected)
        self.controller_stalled = False  # our leader answers nothing and renews nothing
        self._acked_at = -math.inf  # when the last accepted ack came (monotonic)
        # The last renewal of our leader's lease seen going by, and when (monotonic).
        self._renewal_seen: tuple[LeaderRecord, float] | None = None
        self.term = 0  # the newest leadership term heard of (commands and leases carry it)
        self._lease_changed = asyncio.Event()  # replaced after each new lease
        self._leave = asyncio.Event()  # SIGTERM with a leave grace: go, once replaced
        self._leave_now = asyncio.Event()  # a second SIGTERM: go now
        self._runners_changed = asyncio.Event()  # replaced after each replica stopped here
        self._last_sample: tuple[tuple[GpuMetrics, ...], str] = ((), "")
        self.counters = AgentCounters()  # for Prometheus (nodeagent/metrics.py)

    @property
    def last_sample(self) -> tuple[tuple[GpuMetrics, ...], str, bool]:
        """The probe's last readings and error, and whether it was sampled yet (metrics)."""
        return self._last_sample[0], self._last_sample[1], self._seq > 0

    @property
    def registered(self) -> bool:
        return self._registered.is_set()

    def replicas(self) -> tuple[ReplicaState, ...]:
        """Every replica this node was told to start and not yet told to stop (failed ones
        included, so the controller sees them until it sends StopReplica)."""
        return tuple(runner.state for runner in self._runners.values())

    async def run(self) -> None:
        """Serve until cancelled, or until it has left (`leave`); either way stop every
        workload still running (within the grace period) before returning."""
        self._log.info("agent_starting", interval_s=self.heartbeat_interval)
        # Each ack is a few field updates: taken on arrival, not by a task woken per heartbeat.
        leases = await self._env.bus.subscribe(self._lease_subject, handler=self._on_lease)
        try:
            await self._serve()
        except* _Left:
            pass
        finally:
            with contextlib.suppress(BusError):
                await leases.unsubscribe()

    def leave(self) -> None:
        """This node goes away (SIGTERM: a spot preemption, a reboot): tell the controller,
        serve while it places replacements elsewhere and stops ours, for at most the leave
        grace, then stop. A signal handler may call it."""
        self._leave.set()

    async def _serve(self) -> None:
        async with asyncio.TaskGroup() as group:
            self._group = group
            group.create_task(self._serve_faults(), name="agent faults")
            group.create_task(self.tunnel.run(), name="agent tunnel")
            group.create_task(self.stage_links.run(), name="agent stage links")
            group.create_task(self.stage_forwards.run(), name="agent stage forwards")
            if self.front is not None:
                group.create_task(self.front.run(), name="agent front")
                if self.front.crl is not None:
                    # The CA's list, from the controller, to the file the front reads.
                    follower = CrlFollower(self._env.bus, *self.front.crl, self._log)
                    group.create_task(follower.run(), name="agent revocation list")
                await self.front.listening.wait()  # before any replica is advertised
                self._front_base = http_address(self.config.address, self.front.port)
            if self.links is not None:
                if self.links.responder is not None:
                    group.create_task(self.links.responder.run(), name="agent link responder")
                    await self.links.responder.listening.wait()
                group.create_task(self._serve_links(), name="agent links")
            group.create_task(self._leave_when_told(), name="agent leaving")
            group.create_task(self._registration(), name="agent registration")
            if self.config.model_cache or self._image_lister() is not None:
                group.create_task(self._watch_holdings(), name="agent model cache and images")
            await self._registered.wait()
            group.create_task(self._heartbeats(), name="agent heartbeats")
            group.create_task(self._consume_commands(), name="agent commands")
            if self._read_lease is not None:
                group.create_task(self._watch_stalled_leader(), name="agent leader watch")

    def stage_address(self, replica_id: str, epoch: int, rank: int) -> tuple[str, int] | None:
        """Where this node's worker stage `rank` of `replica_id` at `epoch` listens, for a
        head's link over the overlay; None unless it runs here, starting or ready."""
        runner = self._runners.get((replica_id, epoch))
        if runner is None:
            return None
        stage = runner.command.stage
        if stage is None or stage.rank != rank or rank == 0:
            return None
        if runner.state.state not in ("starting", "ready") or not runner.state.port:
            return None
        return self._local_host, runner.state.port

    def _stage_admits(self, head_node: str, replica_id: str, epoch: int) -> str:
        """'' when `head_node` is the head the controller named for this replica's epoch."""
        runner = self._runners.get((replica_id, epoch))
        stage = runner.command.stage if runner is not None else None
        if stage is None or not stage.head_node:
            return ""  # resolve() refuses what does not run here
        if stage.head_node != head_node:
            return f"{head_node} is not the head of {replica_id}@{epoch} ({stage.head_node} is)"
        return ""

    def local_url(self, replica_id: str, epoch: int) -> str | None:
        """Where this node's replica `replica_id` at `epoch` serves, for the tunnel; None
        unless it runs here (starting or ready) with a port."""
        runner = self._runners.get((replica_id, epoch))
        if runner is None or runner.state.state in ("failed", "stopped") or not runner.state.port:
            return None
        return http_address(self._local_host, runner.state.port)

    def force_stop(self) -> None:
        """Cut the shutdown short (a second SIGTERM): workloads still inside their grace period
        are killed now. Cancelling run() again would not do it: a TaskGroup that is already
        cancelling its tasks does not pass a second cancellation on to them."""
        self._leave_now.set()
        self._runners_changed.set()  # a leaving agent waits for no replacement any more
        for task in self._tasks.values():
            task.cancel()

    async def on_reconnect(self) -> None:
        """Hook for the bus's reconnect callback: the controller may have lost us meanwhile."""
        self._log.info("bus_reconnected")
        self._reregister.set()

    # Registration.

    async def _registration(self) -> None:
        while True:
            self._reregister.clear()
            await self._register_until_accepted()
            self._registered.set()
            await self._reregister.wait()

    async def _register_until_accepted(self) -> None:
        cfg = self.config
        delay = cfg.register_backoff_s
        attempt = 0
        while True:
            attempt += 1
            why = await self._try_register()
            if not why:
                return
            wait = self._rng.uniform(delay / 2, delay)  # jitter: a restarted fleet spreads out
            log = self._log.warning if attempt == 1 else self._log.info
            log("register_retry", attempt=attempt, why=why, retry_in_s=round(wait, 3))
            await asyncio.sleep(wait)
            delay = min(delay * 2, cfg.register_backoff_max_s)

    async def _try_register(self) -> str:
        """'' when the controller accepted us, else why not."""
        try:
            inventory = await self._probe.inventory()
        except ProbeError as exc:
            return f"cannot read the GPU inventory: {exc}"
        cfg = self.config
        if not self._holdings_listed:
            # Once, before the first registration; after that the watcher's last listing, so
            # a registration never waits on a busy docker daemon.
            self.cached_models, self.images = await self._holdings()
            self._holdings_listed = True
        message = Register(
            node_id=cfg.node_id,
            hostname=cfg.hostname,
            address=cfg.address,
            region=cfg.region,
            zone=cfg.zone,
            labels=dict(cfg.labels),
            gpus=inventory.gpus,
            driver_version=inventory.driver_version,
            cuda_version=inventory.cuda_version,
            agent_version=cfg.agent_version,
            price_per_hour=cfg.price_per_hour,
            replicas=self.replicas(),
            sealing_key=self.key.public if self.key is not None else "",
            model_cache=cfg.model_cache,
            cached_models=self.cached_models,
            images=self.images,
        )
        subject = subjects.register(cfg.node_id)
        try:
            answer = await self._env.bus.request(
                subject, msgspec.json.encode(message), timeout=cfg.register_timeout_s
            )
            reply = _REGISTER_REPLY.decode(answer.data)
        except NoResponders:
            return "no controller answers"
        except RequestTimeout:
            return f"no reply within {cfg.register_timeout_s:g} s"
        except BusError as exc:
            return f"bus error: {exc}"
        except msgspec.DecodeError as exc:
            return f"undecodable reply: {exc}"
        if not reply.accepted:
            return f"rejected: {reply.error or 'no reason given'}"
        if reply.heartbeat_interval_s > 0:
            self.heartbeat_interval = reply.heartbeat_interval_s
        self.registrations += 1
        self._log.info(
            "registered",
            gpus=len(inventory.gpus),
            replicas=len(message.replicas),
            interval_s=self.heartbeat_interval,
        )
        return ""

    def _image_lister(self) -> Callable[[], Awaitable[tuple[str, ...] | None]] | None:
        lister = getattr(self._driver, "images", None)  # the docker driver's
        return cast(Callable[[], Awaitable[tuple[str, ...] | None]], lister) if lister else None

    async def _holdings(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """What the node holds on disk for placement: its model cache's listing, its images
        (the last known, when docker cannot list them now)."""
        cache = self.config.model_cache
        models = await self._list_cache(cache) if cache else ()
        lister = self._image_lister()
        images = await lister() if lister is not None else ()
        return models, self.images if images is None else images

    async def _watch_holdings(self) -> None:
        """Register again when the model cache's listing or the images change (a model
        fetched, an image pulled or removed), so placement sees what the node holds now; the
        controller records only a change."""
        while True:
            await asyncio.sleep(CACHE_SCAN_S)
            models, images = await self._holdings()
            changed = (models, images) != (self.cached_models, self.images)
            if changed and self._registered.is_set():
                self._log.info("holdings_changed", models=len(models), images=len(images))
                self.cached_models, self.images = models, images
                self._reregister.set()

    async def _prepull(self, command: PullImage) -> None:
        """Pull an image ahead of placement, in a task of the agent's own; register again
        once it is here. Its failure is logged: a replica placed here later pulls again."""
        log = self._log.bind(command=command.command_id, image=command.image)
        pull = getattr(self._driver, "pull", None)
        if pull is None:
            log.warning("prepull_ignored", why="no docker driver here: images are the docker "
                        "driver's (gpumesh agent --workload-driver docker)")  # fmt: skip
            return
        assert self._group is not None

        async def pull_then_register() -> None:
            try:
                await pull(command.image, "missing", replica=f"prepull:{command.cluster}")
            except Exception as exc:  # a busy daemon's timeout too: never the agent's end
                log.warning("prepull_failed", error=str(exc) or type(exc).__name__)
                return
            log.info("prepulled", cluster=command.cluster)
            self.cached_models, self.images = await self._holdings()
            self._reregister.set()

        self._group.create_task(pull_then_register(), name=f"agent prepull {command.image}")

    # Heartbeats.

    async def _heartbeats(self) -> None:
        loop = asyncio.get_running_loop()
        next_at = loop.time()
        while True:
            if self._env.buggify("agent.heartbeat.late"):
                await asyncio.sleep(0.8 * self.heartbeat_interval)
            await self._heartbeat_once()
            # Scheduled on a grid, so a slow probe does not make the interval drift; beats
            # missed while the loop was stalled are skipped, not sent in a burst.
            next_at = max(next_at + self.heartbeat_interval, loop.time())
            await asyncio.sleep(next_at - loop.time())

    async def _heartbeat_once(self) -> None:
        timeout = _PROBE_SHARE * self.heartbeat_interval
        gpus: tuple[GpuMetrics, ...] = ()
        error = ""
        try:
            async with asyncio.timeout(timeout):
                gpus = await self._probe.sample()
        except ProbeError as exc:
            error = str(exc) or "GPU probe failed"
        except TimeoutError:
            error = f"GPU probe did not answer within {timeout:g} s"
        if bool(error) != self._probe_failing:
            self._probe_failing = bool(error)
            if error:
                self._log.warning("gpu_probe_failing", error=error)
            else:
                self._log.info("gpu_probe_recovered")
        self._last_sample = (gpus, error)
        await self._send_heartbeat(gpus, error)

    async def _send_heartbeat(self, gpus: tuple[GpuMetrics, ...], error: str) -> None:
        self._seq += 1  # here, not before the probe: a lease request may go out meanwhile
        beat = Heartbeat(
            node_id=self.config.node_id,
            seq=self._seq,
            sent_at_ns=self._env.clock.wall_ns(),  # the controller's heartbeat lag metric
            gpus=gpus,
            probe_error=error,
            replicas=self.replicas(),
        )
        # The lease an ack grants runs from now, before the controller saw the beat.
        self._sent_at[self._seq] = self._env.clock.monotonic()
        while len(self._sent_at) > _LEASE_SEQS_KEPT:
            del self._sent_at[next(iter(self._sent_at))]
        await self._publish(
            subjects.heartbeat(self.config.node_id), beat, reply=self._lease_subject
        )

    # Fencing: the controller's lease.

    def _on_lease(self, msg: Msg) -> None:
        if is_no_responders(msg):
            self._on_no_controller()
            return
        try:
            ack = _HEARTBEAT_ACK.decode(msg.data)
        except msgspec.DecodeError as exc:
            self._log.warning("lease_garbage", error=str(exc)[:200])
            return
        sent = self._sent_at.get(ack.seq)
        if ack.node_id != self.config.node_id or sent is None or ack.seq <= self._lease_seq:
            return  # not ours, too old, or overtaken by a newer ack
        if not self._current_term(ack.term):
            return  # a deposed leader's: it may no longer hold these replicas current
        if self._lease_until is None:
            self._log.info("lease_granted", lease_s=ack.lease_s)
        if self.controller_absent or self.controller_stalled:
            self.controller_absent = self.controller_stalled = False
            self._log.info("controller_back", lease_s=ack.lease_s)
        self._acked_at = self._env.clock.monotonic()
        self._lease_seq = ack.seq
        self._lease_until = sent + ack.lease_s
        self._lease_s = ack.lease_s
        self._leased = frozenset((r.replica_id, r.epoch) for r in ack.replicas)
        changed, self._lease_changed = self._lease_changed, asyncio.Event()
        changed.set()

    def _current_term(self, term: int) -> bool:
        """Whether what a controller of `term` says may be acted on: not when a later term has
        been seen (term 0: a controller that holds no lease, whose word always counts)."""
        if term and term < self.term:
            return False
        self.term = max(self.term, term)
        return True

    def _on_no_controller(self) -> None:
        """NATS answered a heartbeat with "no responders": we are connected, and nobody takes
        heartbeats in (the controller is down, or one is taking over). The last lease is kept
        for another term, counted from the heartbeat it answers; a node cut off from NATS hears
        nothing and its lease lapses as before. This is safe because a controller that starts
        declares nobody offline until a full lease plus the offline window after it began to
        take heartbeats in (actors/node_actor.py): every lease kept this way has ended by then.

        A lease that has lapsed stays lapsed. The answer does not say which heartbeat it is
        for; they come in order, so it is for the oldest one still unanswered or a later one,
        and that one's send time is the safe start.
        """
        oldest = next((seq for seq in self._sent_at if seq > self._lease_seq), None)
        if oldest is None or self._lease_until is None:
            return  # nothing sent since the last ack, or never leased: nothing to keep
        if self._env.clock.monotonic() > self._lease_until:
            # Lapsed already (cut off for a while, say): while it was, a controller may have
            # replaced these replicas. Only a controller's own lease revives it.
            return
        sent = self._sent_at.pop(oldest)
        self._lease_until = max(self._lease_until, sent + self._lease_s)
        if not self.controller_absent:
            self.controller_absent = True
            self._log.warning(
                "controller_absent",
                detail="heartbeats find no controller; serving on the last lease until one answers",
                replicas=len(self._leased),
            )

    async def _watch_stalled_leader(self) -> None:
        """A leader frozen past its lease (SIGSTOP, a paused VM) keeps its NATS connection and
        its subscriptions: heartbeats reach it and get no answer, not "no responders", and
        this node cannot tell that from being cut off itself, so its lease would lapse before
        a standby takes over. The leader's renewals go by on `gpumesh.v1.leader.controller`;
        this watches them. When heartbeats go unanswered and the last renewal seen is
        LEADER_ACTS_S old, the lease itself is read, through the lease stream's leader: if it
        still holds that renewal, the leader has stopped acting (it acts at most LEADER_ACTS_S
        after sending a renewal that succeeded, and none succeeded since: it would be stored);
        if the key is gone, no controller holds it. Either way nobody can act against this
        node now, and a successor owes every node the grace (a lease plus the offline window)
        before it declares one offline; once one leads, the lease holds its record and the
        keeping stops. So the last lease is kept, counted from the newest heartbeat, as on
        "no responders". A node cut off from NATS reads nothing: its lease lapses."""
        assert self._read_lease is not None
        sub = await self._env.bus.subscribe(subjects.LEADER, handler=self._on_renewal)
        try:
            every = self.heartbeat_interval / 4
            while True:
                await asyncio.sleep(every)
                if self._may_keep_for_stalled_leader():
                    await self._ask_the_lease()
        finally:
            await sub.unsubscribe()

    def _on_renewal(self, msg: Msg) -> None:
        try:
            record = _LEADER_RECORD.decode(msg.data)
        except msgspec.DecodeError:
            return  # not for us to judge; the controllers keep the key
        if record.term and record.term == self.term:
            self._renewal_seen = (record, self._env.clock.monotonic())

    def _may_keep_for_stalled_leader(self) -> bool:
        now = self._env.clock.monotonic()
        if self.term == 0 or self._lease_until is None or now > self._lease_until:
            return False  # a controller without a lease, never leased, or lapsed already
        if now - self._acked_at < self.heartbeat_interval + self.heartbeat_interval / 4:
            return False  # answered lately
        seen = self._renewal_seen
        return seen is None or now >= seen[1] + subjects.LEADER_ACTS_S + _ACTS_MARGIN_S

    async def _ask_the_lease(self) -> None:
        assert self._read_lease is not None
        try:
            record = await self._read_lease()
        except WireError as exc:
            self._log.debug("lease_unreadable", error=exc.reason)
            return
        seen = self._renewal_seen
        if record is not None:
            if seen is None or record != seen[0] or record.term != self.term:
                return  # a renewal we did not see, or another leader: it answers, or not
            if self._env.clock.monotonic() < seen[1] + subjects.LEADER_ACTS_S + _ACTS_MARGIN_S:
                return
        newest = max(self._sent_at.values(), default=None)
        now = self._env.clock.monotonic()
        if newest is None or self._lease_until is None or now > self._lease_until:
            return
        self._lease_until = max(self._lease_until, newest + self._lease_s)
        if not self.controller_stalled:
            self.controller_stalled = True
            self._log.warning(
                "controller_stalled",
                detail="the leader answers nothing and renews nothing; serving on the last lease "
                "until a controller answers",
                lease="gone" if record is None else "holding the last renewal seen",
                replicas=len(self._leased),
            )

    async def wait_for_lease(self, replica_id: str, epoch: int) -> None:
        """Until the lease covers `replica_id` at `epoch`, asking for a fresh one at once
        rather than at the next heartbeat; at most two heartbeat intervals.

        A workload that starts within a heartbeat interval would otherwise be reported ready,
        and routed to, before the controller's next lease named it, and this node's own
        fence would refuse the first requests. Giving up after the wait reports it ready
        anyway: a controller that grants no lease is one we cannot wait for.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 2 * self.heartbeat_interval
        # At most four requests an interval: a controller that answers at once without this
        # replica must not be asked in a tight loop (its intake limit is four an interval).
        slot = self.heartbeat_interval / 4
        while self.fenced(replica_id, epoch) and loop.time() < deadline:
            changed = self._lease_changed
            next_ask = min(loop.time() + slot, deadline)
            await self._send_heartbeat(*self._last_sample)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(max(0.0, next_ask - loop.time())):
                    await changed.wait()
            if self.fenced(replica_id, epoch):
                await asyncio.sleep(max(0.0, next_ask - loop.time()))
        if self.fenced(replica_id, epoch):
            self._log.warning("ready_without_lease", replica=f"{replica_id}@{epoch}")

    def fenced(self, replica_id: str, epoch: int) -> str:
        """Why this node must not serve `replica_id` at `epoch` now ('' when it may). Until a
        controller has granted a first lease (one that sends none), nothing is fenced."""
        if self._lease_until is None:
            return ""
        if self._env.clock.monotonic() > self._lease_until:
            return "this node's lease lapsed: the controller may have replaced its replicas"
        if (replica_id, epoch) not in self._leased:
            return f"the controller does not hold replica {replica_id}@{epoch} current here"
        return ""

    # Reports.

    async def _report(self, state: ReplicaState) -> None:
        self.counters.reported(state)
        if self._env.buggify("agent.report.lost"):
            return  # as if lost on the wire: the next heartbeat carries the state
        report = ReplicaReport(node_id=self.config.node_id, replica=state)
        await self._publish(subjects.report(self.config.node_id), report)

    async def _publish(self, subject: str, message: msgspec.Struct, *, reply: str = "") -> None:
        try:
            await self._env.bus.publish(subject, msgspec.json.encode(message), reply=reply)
        except BusError as exc:
            # Heartbeats repeat every replica's state, so a lost message heals itself.
            self._log.warning("publish_failed", subject=subject, error=str(exc))

    # Commands.

    async def _consume_commands(self) -> None:
        while True:
            deliveries = self._commands.consume(self.config.node_id)
            try:
                async for delivery in deliveries:
                    await self._handle(delivery)
                self._log.warning("command_stream_ended")
            except Exception:
                # A broken command stream must not take the running workloads down with it.
                self._log.exception("command_stream_failed")
            finally:
                await _aclose(deliveries)
            await asyncio.sleep(_RETRY_S)

    async def _handle(self, delivery: Delivery) -> None:
        try:
            # Typed as object: a queue may hand over anything it managed to decode.
            command = cast(object, delivery.command)
        except Exception as exc:
            # The queue decodes lazily; whatever it raises, the message is garbage to us.
            self._log.error("command_undecodable", error=str(exc))
            command = None
        if isinstance(command, PullImage):
            if not self._current_term(command.term):
                self._log.warning("command_from_old_term", term=command.term, current=self.term)
            elif command.command_id not in self._seen_commands:
                await self._prepull(command)
                self._seen_commands.add(command.command_id)
            await self._ack(delivery)
            return
        if not isinstance(command, StartReplica | StopReplica):
            if command is not None:
                self._log.error("command_unknown", type=type(command).__name__)
            await self._ack(delivery)
            return
        log = self._log.bind(
            command=command.command_id, replica=f"{command.replica_id}@{command.epoch}"
        )
        if not self._current_term(command.term):
            # A deposed leader's: the one that leads now sends what still holds, again.
            log.warning("command_from_old_term", term=command.term, current=self.term)
            await self._ack(delivery)
            return
        if command.command_id in self._seen_commands:
            log.info("command_duplicate")
        elif isinstance(command, StartReplica):
            await self._start(command, log)
        else:
            await self._stop(command, log)
        self._seen_commands.add(command.command_id)
        await self._ack(delivery)

    async def _ack(self, delivery: Delivery) -> None:
        try:
            await delivery.ack()
        except BusError as exc:
            # It will be delivered again, and recognised by its command id.
            self._log.warning("command_ack_failed", error=str(exc))

    async def _start(self, command: StartReplica, log: Any) -> None:
        key = (command.replica_id, command.epoch)
        if key in self._runners or key in self._finished:
            log.info("start_ignored", why="this replica epoch already started here")
            return
        assert self._group is not None
        advertise = ""
        worker = command.stage is not None and command.stage.rank > 0
        forwards: list[tuple[str, int]] = []
        if command.stage is not None:
            stage = command.stage
            if stage.rank == 0 and stage.overlay and stage.peer_nodes:
                # The head reaches each worker at a local port its agent carries over NATS.
                forwards = await self._forward_to_workers(command, stage)
                local = tuple(f"{host}:{port}" for host, port in forwards)
                stage = msgspec.structs.replace(stage, peers=local)
            # One stage of a pipeline: its own command, probe and placeholders.
            command = msgspec.structs.replace(
                command, stage=stage, spec=stage_spec(command.spec, stage)
            )
        if self._front_base and not worker:
            # A worker's engine speaks to the head only, over its own protocol: not fronted.
            advertise = self._front_base + front_path(command.replica_id, command.epoch)
        runner = ReplicaRunner(
            command,
            env=self._env,
            driver=self._driver,
            config=self.config,
            publish=self._report,
            advertise=advertise,
            leased=self.wait_for_lease,
            prepare=partial(self._with_secrets, command) if command.spec.secret_env else None,
            worker=worker,
        )
        self._runners[key] = runner
        self._tasks[key] = self._group.create_task(
            self._run_replica(runner, forwards),
            name=f"replica {command.replica_id}@{command.epoch}",
        )
        log.info(
            "replica_start",
            gpus=command.gpu_indices,
            cluster=command.spec.name,
            stage=command.stage.rank if command.stage is not None else None,
        )
        await runner.launched.wait()

    async def _forward_to_workers(
        self, command: StartReplica, stage: StageLaunch
    ) -> list[tuple[str, int]]:
        await self.stage_forwards.ready.wait()
        return [
            await self.stage_forwards.forward(
                StageTarget(node, command.replica_id, command.epoch, rank)
            )
            for rank, node in enumerate(stage.peer_nodes, start=1)
        ]

    async def _run_replica(self, runner: ReplicaRunner, forwards: list[tuple[str, int]]) -> None:
        try:
            await runner.run()
        finally:
            for address in forwards:
                await self.stage_forwards.unforward(address)

    def _with_secrets(self, command: StartReplica) -> ClusterSpec:
        """The spec the workload gets: `secret_env` holding the values (opened from the
        command's sealed box, or read from the node's files), for its environment only. This
        spec never leaves the node: it is given to the driver and nothing else."""
        spec = command.spec
        if self.key is None:
            raise SecretError("this agent has no sealing key: it cannot take secret_env")
        opened: dict[str, str] = {}
        if command.secrets is not None:
            where = aad(self.config.node_id, command.replica_id, command.epoch)
            try:
                opened = open_sealed(self.key.private, command.secrets, where)
            except SealingError as exc:
                raise SecretError(f"secret_env: {exc.reason}") from None
        values: dict[str, str] = {}
        for name, ref in spec.secret_env.items():
            if is_file(ref):
                values[name] = read_secret_file(name, ref)  # small, local: read at once
            elif name in opened:
                values[name] = opened[name]
            else:
                raise SecretError(f"secret_env.{name}: the command carries no value for it")
        return msgspec.structs.replace(spec, secret_env=values)

    async def _stop(self, command: StopReplica, log: Any) -> None:
        key = (command.replica_id, command.epoch)
        runner = self._runners.get(key)
        if runner is None:
            log.info("stop_ignored", why="this replica epoch does not run here")
            return
        task = self._tasks[key]
        runner.prepare_stop(command.grace_s, command.reason)
        log.info("replica_stop", grace_s=command.grace_s, reason=command.reason)
        if task.done():
            await runner.mark_stopped()  # it had given up: nothing left to stop
        else:
            task.cancel()
            # asyncio.wait, not await: the task's CancelledError is its own, not ours.
            await asyncio.wait({task})
        del self._runners[key], self._tasks[key]
        self._finished.add(key)
        changed, self._runners_changed = self._runners_changed, asyncio.Event()
        changed.set()

    # Leaving.

    async def _leave_when_told(self) -> None:
        await self._leave.wait()
        grace = self.config.leave_grace_s
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        why = await self._announce_leaving(grace)
        if why:
            self._log.warning("leaving_unannounced", why=why, replicas=len(self._runners))
            raise _Left()
        self._log.info("leaving", grace_s=grace, replicas=len(self._runners))
        # The controller replaces our replicas elsewhere, then stops them here (StopReplica).
        while self._runners and not self._leave_now.is_set():
            left = deadline - loop.time()
            if left <= 0:
                self._log.warning("leave_grace_over", replicas=len(self._runners))
                break
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._runners_changed.wait()
        else:
            self._log.info("left", took_s=round(grace - (deadline - loop.time()), 3))
        raise _Left()

    async def _announce_leaving(self, grace: float) -> str:
        """'' once the controller has drained this node, else why not."""
        cfg = self.config
        notice = Leaving(node_id=cfg.node_id, grace_s=grace, reason="the agent got SIGTERM")
        try:
            answer = await self._env.bus.request(
                subjects.leaving(cfg.node_id),
                msgspec.json.encode(notice),
                timeout=min(cfg.register_timeout_s, max(grace, 0.1)),
            )
            reply = _LEAVING_REPLY.decode(answer.data)
        except NoResponders:
            return "no controller answers"
        except RequestTimeout:
            return "no controller answered in time"
        except BusError as exc:
            return f"bus error: {exc}"
        except msgspec.DecodeError as exc:
            return f"undecodable reply: {exc}"
        return "" if reply.accepted else reply.error or "refused"

    # Links (docs/sharding.md, Measuring links).

    async def _serve_links(self) -> None:
        """Answer the controller's links requests on this node's own subject, one at a time."""
        subject = subjects.links(self.config.node_id)
        while True:
            try:
                subscription = await self._env.bus.subscribe(subject)
            except BusError as exc:
                self._log.warning("links_subscribe_failed", error=str(exc))
                await asyncio.sleep(_RETRY_S)
                continue
            try:
                async for msg in subscription:
                    reply = await self.measure_links(msg.data)
                    if msg.reply:
                        try:
                            await self._env.bus.publish(msg.reply, msgspec.json.encode(reply))
                        except BusError as exc:
                            self._log.warning("links_reply_failed", error=str(exc))
            finally:
                await subscription.unsubscribe()

    async def measure_links(self, data: bytes) -> LinksReply:
        """Measure the links a LinksRequest names, one peer after the other; a request that
        does not decode or is out of bounds is refused whole, in one line."""
        node_id = self.config.node_id
        if self.links is None:
            return LinksReply(ok=False, node_id=node_id, error="this agent measures no links")
        try:
            request = _LINKS.decode(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._log.warning("links_request_undecodable", error=str(exc))
            return LinksReply(ok=False, node_id=node_id, error=f"undecodable links request: {exc}")
        bad = _links_out_of_bounds(request)
        if bad:
            self._log.warning("links_request_refused", error=bad)
            return LinksReply(ok=False, node_id=node_id, error=bad)
        responder = self.links.responder
        endpoint = responder.endpoint if responder is not None else ""
        measured = []
        for peer in request.peers:
            measured.append(
                await measure(
                    self.links.dialer,
                    peer,
                    pings=request.pings,
                    push_bytes=request.push_bytes,
                    timeout_s=request.timeout_s,
                )
            )
        failed = sum(1 for m in measured if m.error)
        self._log.info("links_measured", peers=len(measured), failed=failed)
        return LinksReply(
            ok=True,
            node_id=node_id,
            endpoint=endpoint,
            method=describe(self.links.dialer.method, request.pings, request.push_bytes),
            links=tuple(measured),
        )

    # Faults.

    async def _serve_faults(self) -> None:
        subject = subjects.fault(self.config.node_id)
        while True:
            try:
                subscription = await self._env.bus.subscribe(subject)
            except BusError as exc:
                self._log.warning("fault_subscribe_failed", error=str(exc))
                await asyncio.sleep(_RETRY_S)
                continue
            try:
                async for msg in subscription:
                    reply = self.apply_fault(msg.data)
                    if msg.reply:
                        try:
                            await self._env.bus.publish(msg.reply, msgspec.json.encode(reply))
                        except BusError as exc:
                            self._log.warning("fault_reply_failed", error=str(exc))
            finally:
                await subscription.unsubscribe()

    def apply_fault(self, data: bytes) -> FaultReply:
        try:
            fault = _FAULT.decode(data)
        except msgspec.DecodeError as exc:
            self._log.warning("fault_undecodable", error=str(exc))
            return FaultReply(ok=False, error=f"undecodable fault: {exc}")
        if not isinstance(self._probe, FaultInjectable):
            return FaultReply(
                ok=False,
                error="this agent reads real GPUs (NVML); faults can be injected only into "
                "an agent started with --fake-gpus",
            )
        try:
            self._probe.apply_fault(fault)
        except ValueError as exc:
            return FaultReply(ok=False, error=str(exc))
        self._log.warning("fault_injected", kind=fault.kind, value=fault.value, gpu=fault.gpu)
        return FaultReply(ok=True)


def _links_out_of_bounds(request: LinksRequest) -> str:
    """Why a links request is refused ('' when it is within bounds)."""
    if len(request.peers) > LINKS_MAX_PEERS:
        return f"links request: {len(request.peers)} peers, at most {LINKS_MAX_PEERS}"
    if not 1 <= request.pings <= LINKS_MAX_PINGS:
        return f"links request: pings must be 1-{LINKS_MAX_PINGS}, got {request.pings}"
    if not 0 <= request.push_bytes <= LINKS_MAX_PUSH_BYTES:
        return (
            f"links request: push_bytes must be 0-{LINKS_MAX_PUSH_BYTES}, got {request.push_bytes}"
        )
    if not (0 < request.timeout_s <= _LINKS_MAX_TIMEOUT_S):
        return f"links request: timeout_s must be in (0, {_LINKS_MAX_TIMEOUT_S:g}], got " + str(
            request.timeout_s
        )
    return ""


class SecretError(WorkloadStartError):
    """A replica's secrets cannot be had on this node: one line, no value in it."""


def read_secret_file(name: str, ref: str) -> str:
    """A `file:` reference's value: the file's text, one trailing newline dropped."""
    path = ref.removeprefix(FILE_PREFIX)
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except OSError as exc:
        raise SecretError(f"secret_env.{name}: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SecretError(f"secret_env.{name}: {path} is not UTF-8 text") from None
    return text.removesuffix("\n")


class _Left(Exception):
    """Raised by the leaving task to end the agent's serving: the node has left."""


async def _aclose(iterator: AsyncIterator[Any]) -> None:
    """Close an async generator now, rather than whenever it is garbage-collected."""
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()
