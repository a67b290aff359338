"""An agent on a MemoryBus with a fake controller, for the agent's tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec

from events.cluster import ClusterSpec
from events.contract import subjects
from events.contract.messages import (
    Command,
    Fault,
    FaultReply,
    Heartbeat,
    HeartbeatAck,
    Register,
    RegisterReply,
    ReplicaLease,
    ReplicaReport,
    ReplicaState,
    StartReplica,
    StopReplica,
)
from nodeagent.agent import Agent
from nodeagent.config import AgentConfig
from nodeagent.gpu import FakeGpuProbe, GpuProbe
from nodeagent.workload import WorkloadDriver
from nodeagent.workload.fake import FakeDriver
from runtime.env import Env
from sim.bus import MemoryBus, MemorySubscription
from sim.commands import MemoryCommandQueue
from sim.env import sim_env

NODE = "n1"
SPEC = ClusterSpec(name="chat", command="serve --port {port}")


def start(replica: str = "r1", epoch: int = 1, *, command_id: str = "", **kw: Any) -> StartReplica:
    return StartReplica(
        command_id=command_id or f"start-{replica}-{epoch}",
        replica_id=replica,
        epoch=epoch,
        spec=kw.pop("spec", SPEC),
        **kw,
    )


def stop(replica: str = "r1", epoch: int = 1, *, command_id: str = "", **kw: Any) -> StopReplica:
    return StopReplica(
        command_id=command_id or f"stop-{replica}-{epoch}",
        replica_id=replica,
        epoch=epoch,
        **kw,
    )


class Inbox:
    """Decoded messages from one subscription, awaited one at a time."""

    def __init__(self, sub: MemorySubscription, decode: Callable[[bytes], Any]) -> None:
        self._sub = sub
        self._decode = decode

    async def next(self, timeout: float = 60.0) -> Any:
        return self._decode((await self._sub.next_msg(timeout)).data)

    async def close(self) -> None:
        await self._sub.unsubscribe()

    async def until(self, match: Callable[[Any], bool], timeout: float = 60.0) -> list[Any]:
        """Every message up to and including the first that matches."""
        seen: list[Any] = []
        async with asyncio.timeout(timeout):
            while not seen or not match(seen[-1]):
                seen.append(await self.next(timeout))
        return seen


class Harness:
    def __init__(
        self,
        *,
        driver: FakeDriver | None = None,
        probe: GpuProbe | None = None,
        config: AgentConfig | None = None,
        commands: Any = None,
        seed: int = 7,
    ) -> None:
        self.bus = MemoryBus()
        self.queue = MemoryCommandQueue()
        self.commands = commands if commands is not None else self.queue
        self.fake_probe = FakeGpuProbe.parse("RTX4090:24GiB:2", node_id=NODE)
        self.probe = probe if probe is not None else self.fake_probe
        self.driver: FakeDriver = driver if driver is not None else FakeDriver()
        self.config = config or AgentConfig(node_id=NODE, stop_grace_s=2.0)
        self.env: Env = sim_env(seed, bus=self.bus)
        self.workloads: WorkloadDriver = self.driver
        self.agent = Agent(self.env, self.commands, self.probe, self.workloads, self.config)
        self.registrations: list[tuple[float, Register]] = []
        self.reply = RegisterReply(accepted=True, heartbeat_interval_s=1.0)
        self.leased: set[tuple[str, int]] = set()  # what grant_leases() names in each ack
        self.lease_acks: list[tuple[float, int]] = []  # (when, heartbeat seq) of each ack
        self.lease_s = 10.0  # what grant_leases() grants

    @asynccontextmanager
    async def running(
        self, *, controller: bool = True, watch_heartbeats: bool = True
    ) -> AsyncIterator[Harness]:
        """The agent (and a fake controller answering registrations) until the block ends.
        Without `watch_heartbeats` nobody but grant_leases() takes heartbeats in, so they are
        answered "no responders" while it does not run (`self.heartbeats` is then unset)."""
        self.reports = Inbox(await self.bus.subscribe(subjects.REPORT_ALL), _report)
        if watch_heartbeats:
            self.heartbeats = Inbox(
                await self.bus.subscribe(subjects.HEARTBEAT_ALL), _decoder(Heartbeat)
            )
        async with asyncio.TaskGroup() as group:
            self.group = group
            self.tasks = [group.create_task(self.agent.run(), name="agent")]
            if controller:
                self.start_controller()
            try:
                yield self
            finally:
                for task in self.tasks:
                    task.cancel()

    async def stop_watching_heartbeats(self) -> None:
        await self.heartbeats.close()

    def start_controller(self) -> None:
        self.tasks.append(self.group.create_task(self.controller(), name="controller"))

    async def controller(self) -> None:
        sub = await self.bus.subscribe(subjects.REGISTER_ALL)
        decode = msgspec.json.Decoder(Register).decode
        try:
            async for msg in sub:
                self.registrations.append((asyncio.get_running_loop().time(), decode(msg.data)))
                await self.bus.publish(msg.reply, msgspec.json.encode(self.reply))
        finally:
            await sub.unsubscribe()

    def grant_leases(self) -> asyncio.Task[None]:
        """Answer every heartbeat's lease request, naming the replicas in `self.leased`, until
        the returned task is cancelled."""
        task = self.group.create_task(self._leases(), name="leases")
        self.tasks.append(task)
        return task

    async def _leases(self) -> None:
        sub = await self.bus.subscribe(subjects.HEARTBEAT_ALL)
        decode = msgspec.json.Decoder(Heartbeat).decode
        try:
            async for msg in sub:
                beat = decode(msg.data)
                self.lease_acks.append((asyncio.get_running_loop().time(), beat.seq))
                ack = HeartbeatAck(
                    node_id=beat.node_id,
                    seq=beat.seq,
                    lease_s=self.lease_s,
                    replicas=tuple(ReplicaLease(replica_id=r, epoch=e) for r, e in self.leased),
                )
                await self.bus.publish(msg.reply, msgspec.json.encode(ack))
        finally:
            await sub.unsubscribe()

    async def send(self, *commands: Command) -> None:
        for command in commands:
            await self.queue.send(NODE, command)

    async def acked(self, timeout: float = 60.0) -> None:
        """Until every command sent so far is acknowledged."""
        await wait_until(lambda: not self.queue.pending(NODE), timeout)

    async def fault(self, fault: Fault | bytes) -> FaultReply:
        data = fault if isinstance(fault, bytes) else msgspec.json.encode(fault)
        msg = await self.bus.request(subjects.fault(NODE), data, timeout=5.0)
        return msgspec.json.decode(msg.data, type=FaultReply)

    async def heartbeat_after(self, at: float, timeout: float = 60.0) -> Heartbeat:
        """The first heartbeat sent after loop time `at` (heartbeats are periodic)."""
        loop = asyncio.get_running_loop()
        async with asyncio.timeout(timeout):
            while True:
                beat: Heartbeat = await self.heartbeats.next(timeout)
                if loop.time() > at:
                    return beat

    async def fresh_heartbeat(self) -> Heartbeat:
        return await self.heartbeat_after(asyncio.get_running_loop().time())


async def wait_until(condition: Callable[[], bool], timeout: float = 60.0) -> None:
    """Poll a condition on the (virtual) clock; for state that sends no message."""
    async with asyncio.timeout(timeout):
        while not condition():  # noqa: ASYNC110  (no event exists for these conditions)
            await asyncio.sleep(0.01)


def _decoder(kind: type[Any]) -> Callable[[bytes], Any]:
    return msgspec.json.Decoder(kind).decode


def _report(data: bytes) -> ReplicaState:
    return msgspec.json.decode(data, type=ReplicaReport).replica


def states(reports: Sequence[ReplicaState]) -> list[str]:
    return [r.state for r in reports]
