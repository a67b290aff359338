"""An in-process fleet on virtual time: the real controller, scripted agents, in-memory parts.

The agents here are deliberately simple scripts (register, heartbeat, obey commands) so a test
can make a node die, hang, overheat or lie exactly when it wants. The real node agent is tested
in tests/nodeagent/ and end to end in tests/integration/.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import msgspec

from actors.controller import Controller, ControllerConfig
from events import GpuInfo, GpuMetrics, MemoryEventStore
from events.contract import subjects
from events.contract.messages import (
    ApiReply,
    Heartbeat,
    PullImage,
    Register,
    RegisterReply,
    ReplicaReport,
    ReplicaState,
    StartReplica,
    StopReplica,
)
from nodeagent.gpu import FakeGpuProbe
from projections import FleetState
from runtime.env import Env, NoResponders, RequestTimeout
from sim import sim_env
from sim.bus import MemoryBus
from sim.commands import MemoryCommandQueue


@dataclass
class ScriptedAgent:
    node_id: str
    bus: MemoryBus
    commands: MemoryCommandQueue
    gpus: int = 2
    region: str = "eu-west"
    temperature: float = 50.0
    probe_error: str = ""
    probe: FakeGpuProbe | None = None  # when set, heartbeats carry its readings instead
    heartbeating: bool = True  # False: hung or partitioned (SIGSTOP)
    gate: asyncio.Event = field(default_factory=asyncio.Event)  # clear: commands pile up
    crash_on_start: bool = False  # every start exits at once (crash loop)
    start_delay: float = 0.5
    running: dict[str, ReplicaState] = field(default_factory=dict)
    started: list[tuple[str, int]] = field(default_factory=list)
    start_commands: list[StartReplica] = field(default_factory=list)  # each, as received
    stopped: list[tuple[str, int]] = field(default_factory=list)
    images: tuple[str, ...] = ()  # what it registers as held (the docker driver's listing)
    pulled: list[str] = field(default_factory=list)  # each cmd.pull.v1's image

    def freeze(self) -> None:
        """SIGSTOP: no heartbeats, no commands handled."""
        self.heartbeating = False
        self.gate.clear()

    def thaw(self) -> None:
        """SIGCONT: carries on with what it was running."""
        self.heartbeating = True
        self.gate.set()

    async def run(self) -> None:
        self.gate.set()
        await self._register()
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._heartbeats())
            tg.create_task(self._obey())

    async def _register(self) -> None:
        reg = Register(
            node_id=self.node_id,
            address="127.0.0.1",
            region=self.region,
            gpus=self.probe.gpus
            if self.probe is not None
            else tuple(
                GpuInfo(index=i, uuid=f"{self.node_id}-{i}", model="RTX4090", vram_mib=24_576)
                for i in range(self.gpus)
            ),
            replicas=tuple(self.running.values()),
            images=self.images,
        )
        while True:
            try:
                reply = await self.bus.request(
                    subjects.register(self.node_id), msgspec.json.encode(reg), timeout=1.0
                )
            except (NoResponders, RequestTimeout):
                await asyncio.sleep(0.2)
                continue
            if msgspec.json.decode(reply.data, type=RegisterReply).accepted:
                return

    async def _heartbeats(self) -> None:
        seq = 0
        while True:
            if self.heartbeating:
                seq += 1
                hb = Heartbeat(
                    node_id=self.node_id,
                    seq=seq,
                    probe_error=self.probe_error,
                    gpus=await self.probe.sample()
                    if self.probe is not None
                    else tuple(
                        GpuMetrics(index=i, temperature_c=self.temperature)
                        for i in range(self.gpus)
                    ),
                    replicas=tuple(self.running.values()),
                )
                await self.bus.publish(subjects.heartbeat(self.node_id), msgspec.json.encode(hb))
            await asyncio.sleep(1.0)

    async def _obey(self) -> None:
        async for delivery in self.commands.consume(self.node_id):
            await self.gate.wait()
            match delivery.command:
                case StartReplica(replica_id=rid, epoch=epoch):
                    self.started.append((rid, epoch))
                    self.start_commands.append(delivery.command)
                    await self._report(
                        ReplicaState(replica_id=rid, epoch=epoch, state="starting", port=9000)
                    )
                    await asyncio.sleep(self.start_delay)
                    if self.crash_on_start:
                        await self._report(
                            ReplicaState(
                                replica_id=rid, epoch=epoch, state="failed", detail="crash loop"
                            )
                        )
                        self.running.pop(rid, None)
                    else:
                        await self._report(
                            ReplicaState(
                                replica_id=rid,
                                epoch=epoch,
                                state="ready",
                                port=9000,
                                address=f"http://{self.node_id}:9000",
                            )
                        )
                case PullImage(image=image):
                    self.pulled.append(image)
                case StopReplica(replica_id=rid, epoch=epoch):
                    current = self.running.get(rid)
                    if current is not None and current.epoch == epoch:
                        self.stopped.append((rid, epoch))
                        self.running.pop(rid)
                        await self._report(
                            ReplicaState(replica_id=rid, epoch=epoch, state="stopped", exit_code=0)
                        )
            await delivery.ack()

    async def _report(self, state: ReplicaState) -> None:
        if state.state in ("starting", "ready"):
            self.running[state.replica_id] = state
        await self.bus.publish(
            subjects.report(self.node_id),
            msgspec.json.encode(ReplicaReport(node_id=self.node_id, replica=state)),
        )


@dataclass
class Fleet:
    env: Env
    bus: MemoryBus
    commands: MemoryCommandQueue
    store: MemoryEventStore
    controller: Controller
    agents: dict[str, ScriptedAgent]
    tasks: asyncio.TaskGroup
    agent_tasks: dict[str, asyncio.Task[None]]

    @property
    def state(self) -> FleetState:
        return self.controller.live.state

    async def api(self, verb: str, body: object = None) -> ApiReply:
        data = msgspec.json.encode(body) if body is not None else b"{}"
        reply = await self.bus.request(subjects.api(verb), data, timeout=30.0)
        return msgspec.json.decode(reply.data, type=ApiReply)

    async def until(self, what: Callable[[], bool], *, within: float, why: str = "") -> float:
        """Wait (virtual time) until `what()` holds; return how long it took."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while not what():
            if loop.time() - start > within:
                raise AssertionError(f"not within {within} s: {why}")
            await asyncio.sleep(0.05)
        return loop.time() - start

    def ready(self, cluster: str) -> list[str]:
        return sorted(
            r.replica_id
            for r in self.state.replicas.replicas.values()
            if r.cluster == cluster and r.status == "ready"
        )

    def kill(self, node_id: str) -> None:
        """Power loss: the agent process and its workloads vanish."""
        self.agent_tasks.pop(node_id).cancel()

    async def start_agent(self, agent: ScriptedAgent) -> None:
        self.agents[agent.node_id] = agent
        self.agent_tasks[agent.node_id] = self.tasks.create_task(agent.run())
        await self.until(
            lambda: agent.node_id in self.state.nodes.nodes,
            within=10,
            why=f"{agent.node_id} registers",
        )


@asynccontextmanager
async def fleet(
    nodes: int = 3,
    *,
    seed: int = 1,
    store: MemoryEventStore | None = None,
    config: ControllerConfig | None = None,
    **agent_args: object,
) -> AsyncIterator[Fleet]:
    bus = MemoryBus()
    commands = MemoryCommandQueue()
    store = store if store is not None else MemoryEventStore()
    env = sim_env(seed, store, bus=bus)
    controller = Controller(env, commands, config)
    async with asyncio.TaskGroup() as tg:
        controller_task = tg.create_task(controller.run())
        await controller.ready.wait()
        f = Fleet(env, bus, commands, store, controller, {}, tg, {})
        for i in range(nodes):
            await f.start_agent(ScriptedAgent(f"n{i}", bus, commands, **agent_args))  # type: ignore[arg-type]
        try:
            yield f
        finally:
            for task in f.agent_tasks.values():
                task.cancel()
            controller_task.cancel()
