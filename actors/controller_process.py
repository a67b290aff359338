"""One `gpumesh controller` process: it campaigns for the lease, leads a term with its state
ready, and stands by between terms.

Where the log lives decides how ready a standby is:

- `jetstream` (the log of record on a replicated JetStream stream, events/jetstream_store/):
  the process opens the log once and folds it as it is written, leader or not. A standby's
  state is a fold of the log up to a moment ago, so taking over is catching up on what the
  old leader wrote since (milliseconds), not replaying the log. Controllers on different hosts
  share nothing but NATS. Each keeps its fold in a local SQLite read model with the log
  position it applied (`read_model`, written every few seconds: projections/projector.py), and
  a restart folds only what the log gained since.
- `sqlite` (the single-machine log, one file): a standby opens the file when it takes over and
  rebuilds from it, as a restarted controller does. Both controllers must then see the same
  file: the same machine, the same data directory.

Every term begins with its record in the log and writes through the lease
(actors/fenced_store.py): once this controller's own expiry has passed it appends nothing and
sends no command, and steps down; on JetStream the server also refuses every append of the term
once a newer term is recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

from events.controller import LeaderTermBegan
from events.errors import EventStoreError
from events.secret_store import SecretStore
from events.store import EventStore
from projections import FleetState
from projections.projector import ReadModelError, load_checkpoint, save_checkpoint
from runtime.command_queue import CommandQueue, Delivery
from runtime.env import Clock
from runtime.errors import BusError
from wire.crl_share import CrlPublisher
from wire.nats_bus import NatsBus

from .controller import Controller, ControllerConfig
from .errors import ControllerError
from .fenced_store import Deposed, LeaseGuard, fenced
from .leader_kv import KvLease
from .leadership import Leadership, LeaseTiming
from .live_state import LiveState
from .roster import Roster, RosterEntry

T = TypeVar("T")
LogKind = Literal["sqlite", "jetstream"]
LOG_KINDS: tuple[LogKind, ...] = ("sqlite", "jetstream")
REPORT_EVERY_S = 1.0
CHECKPOINT_EVERY_S = 5.0


@dataclass(frozen=True, slots=True)
class ProcessConfig:
    controller: ControllerConfig
    log: LogKind = "sqlite"
    events_db: Path = Path("events.db")
    timing: LeaseTiming = field(default_factory=LeaseTiming)
    # jetstream only: the local read model and the position it applied (None: keep none)
    read_model: Path | None = None
    # The CA's revocation list, published to the nodes while this process leads (None: a
    # stack without TLS, or a CA kept elsewhere; wire/crl_share.py).
    crl: Path | None = None


class FencedCommands:
    """The command queue behind the lease: a deposed leader sends nothing."""

    def __init__(self, inner: CommandQueue, guard: LeaseGuard) -> None:
        self._inner = inner
        self._guard = guard

    async def send(self, node_id: str, command: Any) -> None:
        if not self._guard.holds_lease():
            reason = "the lease may have expired; this controller sends no more commands"
            self._guard.deposed(reason)
            raise Deposed(reason)
        await self._inner.send(node_id, command)

    def consume(self, node_id: str) -> AsyncIterator[Delivery]:
        return self._inner.consume(node_id)


class ControllerProcess:
    def __init__(
        self, bus: NatsBus, clock: Clock, config: ProcessConfig, *, log: Any = None
    ) -> None:
        self.bus = bus
        self._clock = clock
        self.config = config
        self.controller_id = config.controller.controller_id
        self.leadership = Leadership(
            KvLease(bus), clock, self.controller_id, timing=config.timing, log=log
        )
        self.roster = Roster(bus)
        self.live: LiveState | None = None  # the state a standby keeps (jetstream only)
        self.controller: Controller | None = None  # the one leading a term, if any
        self._log = log
        self._store: EventStore | None = None
        self._follower: asyncio.Task[None] | None = None
        self._checkpointed = 0

    async def run(self) -> None:
        """Until cancelled: follow, campaign, lead, stand by again."""
        try:
            if self.config.log == "jetstream":
                await self._open_until_it_answers()
                self._follow()
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self._report_loop(), name="roster")
                tasks.create_task(self.leadership.run(self._lead), name="leadership")
                if self.live is not None and self.config.read_model is not None:
                    tasks.create_task(self._checkpoint_loop(), name="read-model")
        finally:
            await self._stop_following()
            if self.live is not None and self.config.read_model is not None:
                with contextlib.suppress(ReadModelError):
                    await self._checkpoint()  # a clean stop restarts from right here
            if self._store is not None:
                await self._store.close()

    # -- a term ------------------------------------------------------------------------

    async def _lead(self, term: int) -> None:
        from runtime.real_env import real_env
        from wire.nats_commands import JetStreamCommandQueue
        from wire.routing_log import ensure_routing_log

        from .outbox import OutboxPublisher

        await self._stop_following()
        opened: EventStore | None = None
        store: EventStore
        if self._store is None:
            from events.sqlite_store import SqliteEventStore

            opened = store = await SqliteEventStore.open(self.config.events_db)
        else:
            store = self._store
        guarded = fenced(store, self.leadership, term=term)
        try:
            env = real_env(guarded, bus=self.bus)
            record = env.new_event(LeaderTermBegan(controller_id=self.controller_id, term=term))
            at = await self._until_done(lambda: guarded.begin_term(record), "the term record")
            self._say("term_recorded", term=term, position=at)
            queue = await self._until_done(
                lambda: JetStreamCommandQueue.create(self.bus), "the command stream"
            )
            commands = FencedCommands(queue, self.leadership)
            await self._until_done(lambda: ensure_routing_log(self.bus), "the routing stream")
            config = replace(self.config.controller, term=term)
            state = self.live.state if self.live is not None else None
            controller = Controller(
                env,
                commands,
                config,
                state=state,
                guard=self.leadership,
                secrets=self._secret_store(),
            )
            self.controller = controller
            extra = [OutboxPublisher(guarded, self.bus).run]
            if self.config.crl is not None:
                extra.append(CrlPublisher(self.bus, self.config.crl, env.log).run)
            await controller.run(extra=extra)
        except Exception:
            # The leadership says in one line why the term ended; the whole story here.
            if self._log is not None:
                self._log.exception("term_failed", controller=self.controller_id, term=term)
            raise
        finally:
            self.controller = None
            guarded.end_term()
            if opened is not None:
                await opened.close()
            elif self.live is not None:
                # The term's fold is still a fold of the log: stand by from where it is.
                self._follow()

    def _secret_store(self) -> SecretStore:
        """Where secret values live (docs/security.md, Secrets): beside a SQLite log, in a
        file of their own; with the log on JetStream, in the bucket every controller reaches."""
        if self._store is None:
            from events.secret_store import SqliteSecretStore

            return SqliteSecretStore.beside(self.config.events_db)
        from wire.secret_kv import JetStreamSecretStore

        return JetStreamSecretStore(self.bus)

    async def _until_done(self, make: Callable[[], Awaitable[T]], what: str) -> T:
        """A setup step of the term, asked again while NATS cannot take it (a stream electing
        its leader after a server died answers nothing for a few seconds); given up, and the
        term with it, only once the lease may have lapsed."""
        attempt = 0
        while True:
            attempt += 1
            try:
                return await make()
            except (BusError, ControllerError, EventStoreError) as exc:
                if not self.leadership.holds_lease():
                    raise
                self._say("term_setup_retry", what=what, attempt=attempt, error=str(exc))
                await asyncio.sleep(0.25)

    # -- standing by -------------------------------------------------------------------

    def _follow(self) -> None:
        if self.live is not None and self._follower is None:
            # The store learns what the leader writes too, so that on taking over its appends
            # find each stream where it is (events/jetstream_store/store.py, observe).
            observe = getattr(self._store, "observe", None)
            self._follower = asyncio.create_task(
                self._follow_until_stopped(self.live, observe), name="follow-log"
            )

    async def _follow_until_stopped(self, live: LiveState, observe: Any) -> None:
        """Follow the log, and again after a read fails: a standby cut off from NATS for a
        while (its reads time out) must follow again once NATS answers, or it would take
        over from a state long behind (seen after a 20 s partition, gpumesh chaos)."""
        attempt = 0
        while True:
            try:
                await live.run(observe)
                return  # the store closed
            except EventStoreError as exc:
                attempt += 1
                self._say("follow_failed", attempt=attempt, position=live.position, error=str(exc))
                await asyncio.sleep(min(2.0, 0.25 * attempt))

    async def _stop_following(self) -> None:
        task, self._follower = self._follower, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _open_until_it_answers(self) -> None:
        """Open the log and fold it, trying again while NATS cannot answer: a controller that
        starts while a server of the cluster is down, or a stream elects its leader, waits
        for it rather than exiting (there is nothing it could do without its log)."""
        attempt = 0
        while True:
            attempt += 1
            try:
                self._store = await self._open_jetstream()
                restored = await self._restore(self._store)
                self.live = LiveState(self._store, restored)
                await self.live.catch_up()
            except EventStoreError as exc:
                if self._store is not None:
                    await self._store.close()
                self._store, self.live = None, None
                self._say("log_unavailable", attempt=attempt, error=str(exc))
                await asyncio.sleep(min(5.0, 0.5 * attempt))
                continue
            self._say(
                "log_followed",
                position=self.live.position,
                from_read_model=restored.position if restored is not None else 0,
                attempts=attempt,
            )
            return

    async def _restore(self, store: EventStore) -> FleetState | None:
        """The read model's state, if it is one of this log: a checkpoint past the log's head
        belongs to a log since deleted, and is folded again from the start."""
        path = self.config.read_model
        if path is None:
            return None
        try:
            state = await load_checkpoint(path)
        except ReadModelError as exc:
            self._say("read_model_unreadable", error=str(exc))
            return None
        if state is None:
            return None
        head = await store.head()
        if state.position > head:
            self._say("read_model_ahead_of_log", read_model=state.position, head=head)
            return None
        return state

    async def _checkpoint(self) -> None:
        live = self.controller.live if self.controller is not None else self.live
        path = self.config.read_model
        if live is None or path is None or live.position == self._checkpointed:
            return
        self._checkpointed = await save_checkpoint(path, live.state)

    async def _checkpoint_loop(self) -> None:
        while True:
            await asyncio.sleep(CHECKPOINT_EVERY_S)
            try:
                await self._checkpoint()
            except ReadModelError as exc:  # the log is untouched; said, and tried again
                self._say("read_model_not_written", error=str(exc))

    async def _open_jetstream(self) -> EventStore:
        from events.jetstream_store import JetStreamEventStore, JetStreamOptions

        options = JetStreamOptions(replicas=self.bus.stream_replicas)
        return await JetStreamEventStore.open(self.bus.client, options)

    # -- the roster --------------------------------------------------------------------

    def entry(self, wall_ns: int) -> RosterEntry:
        leading = self.controller
        live = leading.live if leading is not None else self.live
        applied = live.position if live is not None else 0
        # By the lease, not by the role: a leader woken past its lease has not yet noticed.
        leads = self.leadership.holds_lease()
        return RosterEntry(
            controller_id=self.controller_id,
            role="leader" if leads else "standby",
            term=self.leadership.term if leads else 0,
            applied=applied,
            head=applied,
            log=self.config.log,
            follows=self.live is not None,
            reported_ns=wall_ns,
        )

    async def _report_loop(self) -> None:
        while True:
            try:
                await self.roster.report(self.entry(self._clock.wall_ns()))
            except (ControllerError, BusError) as exc:
                self._say("roster_report_failed", error=str(exc))
            await asyncio.sleep(REPORT_EVERY_S)

    def _say(self, event: str, **fields: object) -> None:
        if self._log is not None:
            self._log.info(event, controller=self.controller_id, **fields)
