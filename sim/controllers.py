"""Hot-standby controllers in a simulated run (`controllers = 2` or more in a scenario).

Each controller is a simulated process: the production `Leadership` (actors/leadership.py) on
the virtual clock, campaigning for the lease on the simulated server's key (sim/lease.py), and
running the production `Controller` for each term it leads, on the shared event log behind the
production `FencedStore` (actors/fenced_store.py: no write once its own lease may have
expired), the shared command queue, and its own NATS connection (`controller-<i>`).

A process can be killed (SIGKILL: nothing it does afterwards reaches anything; its connection
closes, the lease key stays until it expires), frozen and thawed (SIGSTOP and SIGCONT: the
loop holds every callback of the process, `SimEventLoop.freeze`), and restarted as a new
process that campaigns again as a standby.

Every append that reaches the log is reported to the checker with the writer's term
(`one_writer`): a term older than the newest term that has written must never write again.
Each term begins with its record in `leadership/terms` and is fenced on it as the JetStream
log fences it on the server: an append of a term whose record is no longer the last is refused
whole (TermEnded) in the same step as the append, as the server checks it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from actors.controller import Controller, ControllerConfig
from actors.controller_process import FencedCommands
from actors.fenced_store import FencedStore, fenced
from actors.leadership import Leadership
from events import Envelope, MemoryEventStore
from events.contract.messages import Command
from events.controller import TERMS_STREAM, LeaderTermBegan
from events.envelope import NewEvent
from events.errors import EventStoreError, TermEnded
from events.store import Snapshot
from runtime.command_queue import CommandQueue, Delivery
from runtime.env import Env

from .clock import SimClock
from .lease import LeaseKey, SimLease
from .loop import SimEventLoop, process_context

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    from .world import World


async def _forever() -> None:
    """What a dead process's call waits for: nothing will ever answer it."""
    await asyncio.Event().wait()


@dataclass
class ControllerProcess:
    """One controller process (an incarnation of `name`)."""

    name: str
    index: int
    incarnation: int
    lease: SimLease
    leadership: Leadership
    task: asyncio.Task[None] | None = None
    alive: bool = True
    paused: bool = False
    controller: Controller | None = None  # the term it leads now, or led last
    term: int = 0
    taps: list[WriterTap] = field(default_factory=list)
    fences: list[FencedStore] = field(default_factory=list)  # one a term

    @property
    def leading(self) -> bool:
        return self.alive and self.leadership.role == "leader"


class WriterTap:
    """The shared log as one controller's term writes to it: every append that reaches the log
    is reported to the checker with the writer's term; a dead process's writes never arrive."""

    def __init__(self, inner: MemoryEventStore, world: World, writer: str, term: int) -> None:
        self.inner = inner
        self._world = world
        self.writer = writer
        self.term = term
        self.severed = False
        self.fenced_on = 0  # the version of leadership/terms this term's record made; 0: none

    def _wrote(self) -> None:
        self._world.checker.on_append(self.writer, self.term, self._world.now())

    async def fence(self, stream: str) -> int:
        assert stream == TERMS_STREAM, stream
        self.fenced_on = self.inner.version_now(stream)
        return self.fenced_on

    def unfence(self) -> None:
        self.fenced_on = 0

    def _check_term(self) -> None:
        if self.fenced_on and self.inner.version_now(TERMS_STREAM) != self.fenced_on:
            raise TermEnded(f"term {self.term}: a newer term is recorded in leadership/terms")

    async def append(
        self, stream: str, events: Sequence[NewEvent], expected_version: int
    ) -> list[int]:
        if self.severed:
            await _forever()
        self._check_term()
        positions = await self.inner.append(stream, events, expected_version)
        self._wrote()
        return positions

    async def append_many(
        self, appends: Sequence[tuple[str, Sequence[NewEvent], int]]
    ) -> list[list[int] | EventStoreError]:
        if self.severed:
            await _forever()
        try:
            self._check_term()
        except TermEnded as exc:
            return [exc for _ in appends]
        results = await self.inner.append_many(appends)
        if any(not isinstance(r, EventStoreError) for r in results):
            self._wrote()
        return results

    async def compact_heartbeats(self, older_than_ns: int) -> int:
        if self.severed:
            await _forever()
        return await self.inner.compact_heartbeats(older_than_ns)

    async def save_snapshot(self, snapshot: Snapshot) -> None:
        if self.severed:
            await _forever()
        await self.inner.save_snapshot(snapshot)

    async def read_stream(self, stream: str, from_version: int = 1) -> list[Envelope]:
        return await self.inner.read_stream(stream, from_version)

    async def stream_version(self, stream: str) -> int:
        return await self.inner.stream_version(stream)

    async def read_all(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        return await self.inner.read_all(from_position, limit)

    async def read_for_rebuild(self, from_position: int = 1, limit: int = 1000) -> list[Envelope]:
        return await self.inner.read_for_rebuild(from_position, limit)

    def subscribe(self, from_position: int = 1) -> AsyncGenerator[Envelope, None]:
        return self.inner.subscribe(from_position)

    def subscribe_batches(self, from_position: int = 1) -> AsyncGenerator[list[Envelope], None]:
        return self.inner.subscribe_batches(from_position)

    async def head(self) -> int:
        return await self.inner.head()

    async def load_snapshot(self, stream: str) -> Snapshot | None:
        return await self.inner.load_snapshot(stream)

    async def close(self) -> None:
        return None  # the log outlives every controller


class ProcessQueue:
    """The shared command queue as one process sends to it: a dead one's sends never arrive."""

    def __init__(self, inner: CommandQueue, process: ControllerProcess) -> None:
        self._inner = inner
        self._process = process

    async def send(self, node_id: str, command: Command) -> None:
        if not self._process.alive:
            await _forever()
        await self._inner.send(node_id, command)

    def consume(self, node_id: str) -> AsyncIterator[Delivery]:
        return self._inner.consume(node_id)


class Controllers:
    """The controller processes of a world, and what faults do to them."""

    def __init__(self, world: World, count: int) -> None:
        self.world = world
        self.count = count
        self.key = LeaseKey(world.now)
        self.processes: list[ControllerProcess] = []  # the live incarnation of each
        self.history: list[ControllerProcess] = []  # every incarnation, in start order
        self.first_leader = asyncio.Event()  # set when a controller first leads

    @property
    def names(self) -> list[str]:
        return [f"controller-{i}" for i in range(self.count)]

    def start_all(self) -> None:
        for index in range(self.count):
            self.start(index)

    def start(self, index: int) -> ControllerProcess:
        """Start (or restart) controller `index` as a new process: it campaigns."""
        world = self.world
        name = f"controller-{index}"
        previous = [p for p in self.processes if p.index == index]
        incarnation = previous[-1].incarnation + 1 if previous else 1
        rng = world.derive(f"lease:{name}:{incarnation}")
        lease = SimLease(self.key, world.network, name, rng)
        leadership = Leadership(lease, SimClock(), name, log=world.log.bind(process=name))
        process = ControllerProcess(name, index, incarnation, lease, leadership)
        self.processes = [p for p in self.processes if p.index != index] + [process]
        self.processes.sort(key=lambda p: p.index)
        self.history.append(process)
        world.network.endpoint(name)  # connect (a fresh connection after a kill)

        async def lead(term: int) -> None:
            await self._lead(process, term)

        process.task = world.spawn(
            leadership.run(lead), f"{name}:{incarnation}", context=process_context(name)
        )
        return process

    async def _lead(self, process: ControllerProcess, term: int) -> None:
        world = self.world
        tap = WriterTap(world.store, world, process.name, term)
        process.taps.append(tap)
        endpoint = f"{process.name}:t{term}"
        fence = fenced(tap, process.leadership, term=term)
        process.fences.append(fence)
        env = Env(
            clock=SimClock(),
            rng=world.derive(f"root:{endpoint}"),
            store=fence,
            derive_rng=world.derive,
            bus=world.network.endpoint(process.name),
            log=world.log.bind(process=process.name, term=term),
            buggify=world.buggify,
        )
        config = ControllerConfig(controller_id=process.name, term=term)
        commands = FencedCommands(ProcessQueue(world.queue, process), process.leadership)
        controller = Controller(
            env,
            commands,
            config,
            guard=process.leadership,
            secrets=world.secrets,
            ephemeral=world.sealing,
        )
        process.controller, process.term = controller, term
        world.controller = controller
        self.first_leader.set()
        world.note(f"leader {process.name} (term {term})")
        record = env.new_event(LeaderTermBegan(controller_id=process.name, term=term))
        try:
            await fence.begin_term(record)
        except EventStoreError as exc:  # deposed already: the leadership ends the term
            world.note(f"term {term} of {process.name} not begun: {exc}")
            await _forever()
        await controller.run()

    def leader(self) -> ControllerProcess | None:
        """The live process that leads at the newest term (a paused or cut-off one still
        believes it leads until it finds out)."""
        leading = [p for p in self.processes if p.leading]
        return max(leading, key=lambda p: p.term) if leading else None

    def kill(self, process: ControllerProcess) -> None:
        """SIGKILL: whatever it still does reaches nobody; its connection closes."""
        world = self.world
        process.alive = False
        process.lease.severed = True
        for tap in process.taps:
            tap.severed = True
        _loop().thaw(process.name)  # so that its tasks can be cancelled at all
        process.paused = False
        if process.task is not None:
            process.task.cancel()
            process.task = None
        endpoint = world.network.endpoint(process.name)
        world.spawn(endpoint.close(), f"close:{process.name}:{process.incarnation}")

    def pause(self, process: ControllerProcess) -> None:
        process.paused = True
        _loop().freeze(process.name)

    def resume(self, process: ControllerProcess) -> None:
        if process.paused and process.alive:
            process.paused = False
            _loop().thaw(process.name)

    def report(self) -> list[str]:
        """A line per controller: the terms it led, and the writes its fence refused (those it
        tried after its own expiry: woken from a pause, or cut off)."""
        lines = []
        for process in self.history:
            terms = ", ".join(str(t.term) for t in process.taps) or "none"
            refused = sum(f.refused for f in process.fences)
            lines.append(
                f"{process.name} (incarnation {process.incarnation}): led terms {terms}; "
                f"{refused} write(s) refused after its expiry"
            )
        return lines

    def stop_all(self) -> None:
        for process in self.processes:
            if process.alive:
                self.kill(process)


def _loop() -> SimEventLoop:
    loop = asyncio.get_running_loop()
    if not isinstance(loop, SimEventLoop):
        raise RuntimeError("controller processes need the simulator's loop (run_simulation)")
    return loop


def describe(processes: Sequence[ControllerProcess]) -> list[dict[str, Any]]:
    """Who led which terms, for tests and reports."""
    return [
        {
            "controller": p.name,
            "incarnation": p.incarnation,
            "alive": p.alive,
            "role": p.leadership.role,
            "term": p.term,
            "terms_led": p.leadership.terms_led,
            "stepped_down": list(p.leadership.stepped_down),
        }
        for p in processes
    ]
