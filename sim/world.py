"""A simulated world: the real controller, real agents and the gateway's real routing logic on
virtual time, over a faulty in-memory network, with seeded client traffic and faults.

Only what cannot exist here is faked: GPUs (FakeGpuProbe), workload processes (FakeDriver) and
the HTTP hop to a replica (SimTransport, which answers from the fake workload's state). Every
decision (health, placement, routing, retries, ejection) is made by production code.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import math
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import structlog
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
from prometheus_client import CollectorRegistry

from actors.controller import Controller, ControllerConfig
from events import ClusterSpec, GpuRequirement, MemoryEventStore
from events.contract import subjects
from events.contract.messages import ApiReply, Command, RouteEntry, ScaleRequest
from events.secret_store import MemorySecretStore
from gateway.dispatch import AttemptsExhausted, Dispatcher, NoReadyReplica, UnknownCluster
from gateway.feed import RoutingFeed
from gateway.instruments import Instruments
from gateway.load import LoadMeter
from gateway.load_publisher import LoadPublisher
from gateway.retry import RetryPolicy
from gateway.router import Router, RouterConfig
from gateway.transport.base import ConnectFailed, FirstByteTimeout, UpstreamRequest
from nodeagent.agent import Agent
from nodeagent.config import AgentConfig
from nodeagent.gpu import FakeGpuProbe
from nodeagent.link_probe import LinkChannel, LinkProbing, LinkUnreachable
from nodeagent.workload.fake import FakeDriver
from runtime.command_queue import Delivery
from runtime.env import Bus, Env, RandomSource
from wire.sealing import NodeKey, deterministic_ephemeral

from .buggify import Buggify
from .clients import TRAFFIC_AFTER_S, cluster_spec, shaped_traffic
from .clock import SimClock
from .commands import MemoryCommandQueue
from .controllers import Controllers
from .env import SeededStreams
from .invariants import Checker
from .lease import lease_reader
from .loop import process_context
from .network import SimNetwork
from .scenario import FaultKind, FaultPlan, Scenario

N = TypeVar("N")
SERVICE_TIME_S = (0.02, 0.2)  # a replica's answer time, drawn per request
CONNECT_TIMEOUT_S = 1.0  # an unreachable node: the TCP connect gives up after this
# The simulated NATS server hands messages over on a half-millisecond tick (within each link's
# latency bounds: SimNetwork's `tick_s`). Messages then meet at the same instants, so the
# controller takes a fleet's heartbeats a batch per turn instead of a wake-up each, and records
# them a batch per commit (`bench/sim.py --rows 1000:30`: about 1.4x faster).
NETWORK_TICK_S = 0.0005
# Every node's direct link to another carries this much, Gbit/s: a link's measured throughput
# in the simulator (the `slow` fault adds latency, not a narrower pipe).
SIM_LINK_GBPS = 10.0
LINK_PORT = 7400  # the simulated link responders' port, in their endpoints (`node-3:7400`)


class GatedCommands:
    """One node's view of the durable command queue: nothing is consumed while it is cut off
    (JetStream is on the NATS server), and everything waiting arrives when it is back."""

    def __init__(self, queue: MemoryCommandQueue, node_id: str) -> None:
        self._queue = queue
        self._node_id = node_id
        self.open = asyncio.Event()
        self.open.set()

    async def send(self, node_id: str, command: Command) -> None:
        await self._queue.send(node_id, command)

    def consume(self, node_id: str) -> AsyncIterator[Delivery]:
        return self._consume(node_id)

    async def _consume(self, node_id: str) -> AsyncIterator[Delivery]:
        async for delivery in self._queue.consume(node_id):
            await self.open.wait()
            yield delivery


@dataclass
class SimNode:
    node_id: str
    region: str
    probe: FakeGpuProbe
    driver: FakeDriver
    commands: GatedCommands
    bus: Any
    agent: Agent | None = None
    task: asyncio.Task[None] | None = None
    powered: bool = True
    hung: bool = False
    partitioned: bool = False
    nats_cut: bool = False  # its NATS server died; it has not yet reconnected to another
    slow_s: float = 0.0
    incarnation: int = 0
    index: int = 0


@dataclass
class RequestLog:
    sent: int = 0
    ok: int = 0
    failed: dict[str, int] = field(default_factory=dict)


class SimResponse:
    status = 200
    headers: Sequence[tuple[str, str]] = ()

    async def chunks(self) -> AsyncIterator[bytes]:
        yield b"{}"

    async def aclose(self) -> None:
        return None


class SimTransport:
    """The HTTP hop to a replica, answered from the simulated node and its fake workload."""

    name = "sim"

    def __init__(self, world: World) -> None:
        self._world = world
        self._rng = world.derive("transport")

    async def open(self, route: RouteEntry, request: UpstreamRequest) -> SimResponse:
        world = self._world
        world.checker.on_route(route, world.now())
        node = world.nodes.get(route.node_id)
        if node is None or not node.powered:
            await asyncio.sleep(0.001)  # refused at once: nothing listens there
            raise ConnectFailed(route.replica_id, "connection refused")
        if node.partitioned:
            await asyncio.sleep(min(CONNECT_TIMEOUT_S, request.first_byte_timeout))
            raise ConnectFailed(route.replica_id, "connect timed out")
        port = int(route.address.rsplit(":", 1)[1])
        workload = next((w for w in node.driver.running() if w.port == port), None)
        if workload is None:
            await asyncio.sleep(0.001)
            raise ConnectFailed(route.replica_id, "connection refused")
        fenced = node.agent.fenced(route.replica_id, route.epoch) if node.agent else "no agent"
        if fenced:
            # The node's fencing front refuses it before the workload sees it (the gateway
            # takes that as a connect failure: it may try another replica).
            await asyncio.sleep(0.001)
            raise ConnectFailed(route.replica_id, f"fenced: {fenced}")
        world.checker.on_served(route, node.node_id, world.now())
        service = self._rng.uniform(*SERVICE_TIME_S) + node.slow_s
        if service > request.first_byte_timeout:
            await asyncio.sleep(request.first_byte_timeout)
            raise FirstByteTimeout(route.replica_id, "no first byte")
        await asyncio.sleep(service)
        return SimResponse()

    async def close(self) -> None:
        return None


class SimLinkChannel:
    """A direct connection between two simulated nodes: each way takes a delay drawn from the
    network's link between them (its `slow` fault's latency included), and a push its bytes at
    SIM_LINK_GBPS besides."""

    def __init__(self, world: World, src: str, dst: str, rng: RandomSource) -> None:
        self._world, self._src, self._dst, self._rng = world, src, dst, rng

    def _trip(self) -> float:
        net = self._world.network
        there, back = net.link(self._src, self._dst), net.link(self._dst, self._src)
        return self._rng.uniform(*there.latency_s) + self._rng.uniform(*back.latency_s)

    async def _reachable(self) -> None:
        await self._world.link_reachable(self._src, self._dst)

    async def ping(self) -> None:
        await self._reachable()
        await asyncio.sleep(self._trip())

    async def push(self, nbytes: int) -> None:
        await self._reachable()
        await asyncio.sleep(nbytes * 8 / (SIM_LINK_GBPS * 1e9) + self._trip())

    async def close(self) -> None:
        return None


class SimLinkDialer:
    """A node's prober in the simulator (nodeagent/link_probe.py's LinkDialer): the agent's
    own measuring code times these channels on the virtual clock."""

    method = "sim"

    def __init__(self, world: World, node_id: str, rng: RandomSource) -> None:
        self._world, self._node_id, self._rng = world, node_id, rng

    async def dial(self, endpoint: str) -> LinkChannel:
        peer = endpoint.rpartition(":")[0]
        await self._world.link_reachable(self._node_id, peer)
        channel = SimLinkChannel(self._world, self._node_id, peer, self._rng)
        await asyncio.sleep(channel._trip())  # the connection's handshake
        return channel


class SimLinkResponder:
    """A node's link responder in the simulator: only its endpoint, which the dialers read."""

    def __init__(self, node_id: str) -> None:
        self.endpoint = f"{node_id}:{LINK_PORT}"
        self.listening = asyncio.Event()

    async def run(self) -> None:
        self.listening.set()
        await asyncio.Event().wait()  # until cancelled


class World:
    def __init__(self, scenario: Scenario, seed: int, *, log: Any = None) -> None:
        self.scenario = scenario
        self.seed = seed
        self.derive = SeededStreams(seed)
        self.log = log or structlog.get_logger("gpumesh.sim")
        self.network = SimNetwork(self.derive("network"), tick_s=NETWORK_TICK_S)
        self.buggify = Buggify(seed, enabled=scenario.buggify)
        self.store = MemoryEventStore()
        self.queue = MemoryCommandQueue()
        # The controllers' secret store, shared as the JetStream bucket is: a successor seals
        # what its predecessor stored. One-time sealing keys from the seed (never the OS).
        self.secrets = MemorySecretStore()
        self.sealing = deterministic_ephemeral(seeded_bytes(self.derive("sealing")))
        self.nodes: dict[str, SimNode] = {}
        self.requests: dict[str, RequestLog] = {}
        self.timeline: list[str] = []
        self.checker = Checker(self)
        self.controller: Controller | None = None  # the one that runs (leads) now
        self._controller_task: asyncio.Task[None] | None = None
        # With standbys (`controllers` > 1), the controller processes and the lease.
        self.controllers: Controllers | None = None
        if scenario.controllers > 1:
            self.controllers = Controllers(self, scenario.controllers)
        self._cut_for: dict[str, list[str]] = {}  # endpoint -> why it is cut off from NATS
        self._tasks: asyncio.TaskGroup | None = None
        self._node_counter = 0
        self.router = Router(SimClock(), self.derive("router"), RouterConfig())
        # The gateway's load, counted and reported as a real gateway does (autoscaling):
        # created in running(), on its loop.
        self.meter = LoadMeter(SimClock())
        self.load: LoadPublisher | None = None
        self.dispatcher = Dispatcher(
            self.router,
            RetryPolicy(first_byte_timeout_s=5.0, deadline_s=15.0, queue_timeout_s=5.0),
            SimClock(),
            self.derive("dispatch"),
            meter=self.meter,
            holds=_Holds(self),
        )
        self.transport = SimTransport(self)

    # -- plumbing ------------------------------------------------------------------------

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    def env(self, endpoint: str) -> Env:
        return Env(
            clock=SimClock(),
            rng=self.derive(f"root:{endpoint}"),
            store=self.store,
            derive_rng=self.derive,
            bus=self.network.endpoint(endpoint),
            log=self.log.bind(process=endpoint),
            buggify=self.buggify,
        )

    def note(self, text: str) -> None:
        line = f"{self.now():9.3f}  {text}"
        self.timeline.append(line)

    def spawn(
        self, coro: Any, name: str, *, context: contextvars.Context | None = None
    ) -> asyncio.Task[Any]:
        assert self._tasks is not None
        if context is None:
            return self._tasks.create_task(coro, name=name)
        return self._tasks.create_task(coro, name=name, context=context)

    @property
    def controller_names(self) -> list[str]:
        """The controllers' NATS endpoints."""
        return ["controller"] if self.controllers is None else self.controllers.names

    def cut_off(self, endpoint: str, why: str) -> bool:
        """`endpoint` loses NATS for `why` (a fault); True if it was connected until now."""
        reasons = self._cut_for.setdefault(endpoint, [])
        reasons.append(why)
        if len(reasons) == 1:
            self.network.isolate(endpoint)
            return True
        return False

    def cut_ends(self, endpoint: str, why: str) -> bool:
        """`why` no longer cuts `endpoint` off; True if it now reconnects (nothing else does)."""
        reasons = self._cut_for.get(endpoint, [])
        if why in reasons:
            reasons.remove(why)
        if not reasons:
            self._cut_for.pop(endpoint, None)
            self.network.reconnect(endpoint)
            return True
        return False

    # -- the run -------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[World]:
        """The controller, the nodes, the gateway's routing feed and the checker, until the
        block ends; every task belongs to one TaskGroup and is cancelled on the way out."""
        async with asyncio.TaskGroup() as tasks:
            self._tasks = tasks
            if self.controllers is not None:
                self.controllers.start_all()
                await self.controllers.first_leader.wait()
            else:
                self.start_controller()
            assert self.controller is not None
            await self.controller.ready.wait()
            for _ in range(self.scenario.fleet.nodes):
                self.add_node()
            feed = RoutingFeed(
                self.network.endpoint("gateway"), self.router, self.dispatcher, self.log
            )
            self.load = LoadPublisher(
                self.network.endpoint("gateway"),
                self.meter,
                SimClock(),
                Instruments(CollectorRegistry(), self.router),
                "gateway",
                self.log,
            )
            own = [
                tasks.create_task(feed.run(), name="gateway-feed"),
                tasks.create_task(self.checker.run(), name="checker"),
                tasks.create_task(self.load.run(), name="gateway-load"),
            ]
            try:
                yield self
            finally:
                for task in own:
                    task.cancel()
                self.stop_all()

    async def run(self) -> None:
        """The scenario: deploys, traffic and faults on schedule, then settle and check."""
        scenario = self.scenario
        async with self.running():
            if self.buggify.sites:
                self.note(f"buggify on at: {', '.join(self.buggify.sites)}")
            jobs = [self.spawn(self._create_clusters(), "deploys")]
            if scenario.rate_per_s > 0:
                jobs += [
                    self.spawn(self._traffic(c.name, c.at_s), f"traffic:{c.name}")
                    for c in scenario.clusters
                ]
            from .faults import FaultRunner

            faults = FaultRunner(self)
            await faults.run(scenario.faults, until=scenario.duration_s)
            self.note(f"faults over; settling {scenario.settle_s:g} s")
            faults.end_all()
            await asyncio.sleep(max(0.0, scenario.duration_s + scenario.settle_s - self.now()))
            for job in jobs:
                job.cancel()
            await self.checker.finish()
            if self.controllers is not None:
                for line in self.controllers.report():
                    self.note(line)

    def start_controller(self) -> None:
        if self._tasks is not None and self.controller is not None:
            self.checker.controller_up(self.now())
        self.controller = Controller(
            self.env("controller"),
            self.queue,
            ControllerConfig(),
            secrets=self.secrets,
            ephemeral=self.sealing,
        )
        self._controller_task = self.spawn(
            self.controller.run(), "controller", context=process_context("controller")
        )

    def crash_controller(self) -> None:
        if self._controller_task is not None:
            self.checker.controller_down(self.now())
            self._controller_task.cancel()
            self._controller_task = None
            # A crashed process's connection goes with it (its queue-group subscriptions too);
            # the restarted controller connects afresh.
            self.spawn(self.network.endpoint("controller").close(), "close:controller")

    def stop_all(self) -> None:
        if self.controllers is not None:
            self.controllers.stop_all()
        self.crash_controller()
        for node in self.nodes.values():
            if node.task is not None:
                node.task.cancel()

    def add_node(self) -> SimNode:
        index = self._node_counter
        self._node_counter += 1
        node_id = f"node-{index}"
        regions = self.scenario.fleet.regions
        probe = FakeGpuProbe.parse(
            self.scenario.fleet.gpus, rng=self.derive(f"gpu:{node_id}"), node_id=node_id
        )
        node = SimNode(
            node_id=node_id,
            region=regions[index % len(regions)],
            probe=probe,
            driver=FakeDriver(),
            commands=GatedCommands(self.queue, node_id),
            bus=self.network.endpoint(node_id),
            index=index,
        )
        self.nodes[node_id] = node
        self.boot(node)
        return node

    def boot(self, node: SimNode) -> None:
        """Start (or restart after power loss) the node's agent: a fresh process."""
        node.incarnation += 1
        node.powered = True
        # Each incarnation gets its own port range: an old address never reaches a new process.
        node.driver = FakeDriver(first_port=20_000 + 1000 * node.index + 50 * node.incarnation)
        config = AgentConfig(node_id=node.node_id, region=node.region, address="127.0.0.1")
        env = self.env(node.node_id)
        read_lease = None
        if self.controllers is not None:
            read_lease = lease_reader(
                self.controllers.key,
                self.network,
                node.node_id,
                self.derive(f"lease:{node.node_id}:{node.incarnation}"),
            )
        # The node's key pair, the same in every incarnation (it is kept on the node's disk).
        key = X25519PrivateKey.from_private_bytes(
            seeded_bytes(self.derive(f"node-key:{node.node_id}"))(32)
        )
        # Agents measure links where a scenario has a cluster that may run as a pipeline (as
        # `gpumesh agent --no-link-probe` elsewhere): the other scenarios' runs stay as they were.
        links: LinkProbing | None = None
        if any(
            c.sharding is not None and "pipeline" in c.sharding.parallelism
            for c in self.scenario.clusters
        ):
            dialer = SimLinkDialer(
                self, node.node_id, self.derive(f"links:{node.node_id}:{node.incarnation}")
            )
            links = LinkProbing(dialer, SimLinkResponder(node.node_id))
        node.agent = Agent(
            env,
            node.commands,
            node.probe,
            node.driver,
            config,
            read_lease=read_lease,
            key=NodeKey(key),
            links=links,
        )
        node.bus = self.network.endpoint(node.node_id)  # a fresh one after power loss
        node.bus.add_reconnect_callback(node.agent.on_reconnect)
        node.task = self.spawn(node.agent.run(), f"agent:{node.node_id}:{node.incarnation}")

    async def link_reachable(self, src: str, dst: str) -> None:
        """Raise LinkUnreachable, after the time a real connection would take to fail, when
        the direct link from `src` to `dst` is down (a node off, hung or partitioned)."""
        peer = self.nodes.get(dst)
        if peer is None or not peer.powered:
            await asyncio.sleep(0.001)
            raise LinkUnreachable(f"cannot connect to {dst}:{LINK_PORT}: connection refused")
        me = self.nodes.get(src)
        if peer.hung or peer.partitioned or (me is not None and me.partitioned):
            await asyncio.sleep(CONNECT_TIMEOUT_S)
            raise LinkUnreachable(f"cannot connect to {dst}:{LINK_PORT}: connect timed out")

    def power_off(self, node: SimNode) -> None:
        # Cut the wire first: whatever the dying agent still tries to say never arrives.
        self.network.isolate(node.node_id)
        node.commands.open.clear()
        node.powered = False
        if node.task is not None:
            node.task.cancel()
            node.task = None
        # The process's connection dies with it: its subscriptions and reconnect callback too.
        self.spawn(node.bus.close(), f"close:{node.node_id}:{node.incarnation}")
        for workload in node.driver.running():
            workload.crash(-9)  # SIGKILL with its agent: gone, no report from anyone

    def power_on(self, node: SimNode) -> None:
        node.powered = True
        self.rejoin(node)
        self.boot(node)

    def rejoin(self, node: SimNode) -> None:
        """A fault that cut the node off ended: its network is back, unless another fault
        (power, hang, partition) still holds it cut off."""
        if node.powered and not node.hung and not node.partitioned and not node.nats_cut:
            self.network.reconnect(node.node_id)
            node.commands.open.set()

    async def _create_clusters(self) -> None:
        api = self.network.endpoint("client")
        for plan in sorted(self.scenario.clusters, key=lambda c: c.at_s):
            await asyncio.sleep(max(0.0, plan.at_s - self.now()))
            spec = cluster_spec(plan, "serve --port {port}")
            reply = await _api(api, "cluster.create", spec)
            self.note(f"cluster {plan.name} created ({plan.replicas} replicas): {reply.ok}")

    async def _traffic(self, cluster: str, start: float) -> None:
        rng = self.derive(f"traffic:{cluster}")
        log = self.requests.setdefault(cluster, RequestLog())
        await asyncio.sleep(start + TRAFFIC_AFTER_S)

        def request() -> Coroutine[Any, Any, None]:
            log.sent += 1
            return self._request(cluster, log)

        await shaped_traffic(rng, self.scenario.traffic_shape(), self.now, request)

    async def _request(self, cluster: str, log: RequestLog) -> None:
        request = UpstreamRequest(
            method="POST", path="/v1/chat/completions", headers=(), body=b"{}",
            request_id="", first_byte_timeout=0.0,
        )  # fmt: skip

        async def attempt(route: RouteEntry, first_byte_timeout: float) -> SimResponse:
            from dataclasses import replace

            return await self.transport.open(
                route, replace(request, first_byte_timeout=first_byte_timeout)
            )

        # A canary takes its share as the real gateway's proxy gives it (no draw without one).
        cluster = self.dispatcher.pick_cluster(cluster)
        try:
            route, _ = await self.dispatcher.run(cluster, attempt)
        except (NoReadyReplica, AttemptsExhausted, UnknownCluster) as exc:
            kind = type(exc).__name__
            log.failed[kind] = log.failed.get(kind, 0) + 1
            return
        self.dispatcher.finished(cluster, route, "ok")
        log.ok += 1

    # -- driven step by step (tests/sim/test_stateful.py) ---------------------------------

    async def create_cluster(self, name: str, replicas: int, *, gpu_count: int = 1) -> ApiReply:
        """Deploy a cluster through the control API now, as a client would."""
        spec = ClusterSpec(
            name=name,
            replicas=replicas,
            model=name,
            command="serve --port {port}",
            gpu=GpuRequirement(count=gpu_count),
        )
        reply = await _api(self.network.endpoint("client"), "cluster.create", spec)
        self.note(f"cluster {name} created ({replicas} replicas): {reply.ok}")
        return reply

    async def scale(self, name: str, replicas: int) -> ApiReply:
        """Scale a cluster through the control API now."""
        body = ScaleRequest(name=name, replicas=replicas)
        reply = await _api(self.network.endpoint("client"), "cluster.scale", body)
        self.note(f"cluster {name} scaled to {replicas}: {reply.ok}")
        return reply

    def start_traffic(self, cluster: str) -> asyncio.Task[None]:
        """Seeded client traffic to `cluster` at the scenario's rate, from a second from now."""
        return self.spawn(self._traffic(cluster, 0.0), f"traffic:{cluster}")

    def fault(
        self, kind: FaultKind, node_id: str | None = None, **params: Any
    ) -> Callable[[], None]:
        """Apply one fault now, exactly as a scenario would (to `node_id`, for a node fault),
        and return what ends it."""
        from .faults import FaultRunner

        runner = FaultRunner(self)
        plan = FaultPlan(at_s=self.now(), kind=kind, nodes=node_id or "1", duration_s=math.inf,
                         **params)  # fmt: skip
        struck = len(self.checker._pending)
        runner._apply(plan)
        pending = self.checker._pending[struck:]

        def end() -> None:
            # The checker judges detection by how long the fault really lasted.
            for fault in pending:
                fault.lasting = self.now() - fault.at
            runner.end_all()

        return end


class _Holds:
    """The simulated gateway's hold observer: what a real gateway's LoadPublisher is told,
    passed on once the world runs (its publisher is made on the running loop)."""

    def __init__(self, world: World) -> None:
        self._world = world

    def held(self, cluster: str, count: int) -> None:
        if self._world.load is not None:
            self._world.load.held(cluster, count)

    def held_at_zero(self, cluster: str) -> None:
        if self._world.load is not None:
            self._world.load.held_at_zero(cluster)

    def cold_start(self, cluster: str, seconds: float) -> None:
        if self._world.load is not None:
            self._world.load.cold_start(cluster, seconds)


async def _api(bus: Bus, verb: str, body: object) -> ApiReply:
    for _ in range(30):
        with contextlib.suppress(Exception):
            reply = await bus.request(subjects.api(verb), msgspec.json.encode(body), timeout=5.0)
            return msgspec.json.decode(reply.data, type=ApiReply)
        await asyncio.sleep(1.0)
    return ApiReply(ok=False, error=f"{verb}: no answer")


def share(spec: str, population: int, rng: RandomSource) -> int:
    """How many nodes a fault's `nodes` field names: "30%" of the population, or "2"."""
    if spec.endswith("%"):
        return max(1, math.floor(population * float(spec[:-1]) / 100 + 0.5))
    return int(spec)


def draw_victims(
    nodes: Mapping[str, N], spec: str, rng: RandomSource, *, up: Callable[[N], bool]
) -> list[N]:
    """A fault's victims: the names it gives, or a share of the nodes that are `up`, in sorted
    order, shuffled with `rng`. The simulator and `gpumesh chaos` both draw with this, so a seed
    picks the same victims in both."""
    if not (spec.endswith("%") or spec.isdigit()):
        names = [name.strip() for name in spec.split(",")]
        return [nodes[name] for name in names if name in nodes]
    candidates = [node for _, node in sorted(nodes.items()) if up(node)]
    count = min(len(candidates), share(spec, len(nodes), rng))
    order = list(range(len(candidates)))
    rng.shuffle(order)
    return [candidates[i] for i in sorted(order[:count])]


def seeded_bytes(rng: RandomSource) -> Callable[[int], bytes]:
    """`n` bytes at a time from a seeded source: the simulator's keys, repeatable by seed."""
    return lambda n: rng.getrandbits(8 * n).to_bytes(n, "little")
