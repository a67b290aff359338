"""ActorSystem: spawns actors into one TaskGroup, supervises them, and shuts them down.

Every task the system starts (supervisors, actor background tasks, the exit-time shutdown)
belongs to its TaskGroup, so nothing runs unowned and an escalated failure cancels the rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Generic, TypeVar, final, overload

import structlog

from events.errors import StoreFull

from .actor import Actor, ActorContext
from .env import Env, RandomSource
from .errors import (
    ActorStopped,
    AskTimeout,
    DuplicateActor,
    MailboxClosed,
    SupervisorGaveUp,
    SystemNotRunning,
)
from .mailbox import Mailbox, MailboxStats
from .supervision import DEFAULT_POLICY, CrashWindow, SupervisionPolicy

M = TypeVar("M")
R = TypeVar("R")

_RESERVED_CONTEXT_KEYS = frozenset({"actor", "incarnation"})


@final
@dataclass(slots=True)
class _Envelope(Generic[M]):
    message: M
    reply: asyncio.Future[object] | None  # None for tell


@final
class ActorRef(Generic[M]):
    """The only handle to a running actor. Built by `ActorSystem.spawn`; survives restarts."""

    __slots__ = ("_mailbox", "_name")

    def __init__(self, name: str, mailbox: Mailbox[_Envelope[M]]) -> None:
        self._name = name
        self._mailbox = mailbox

    @property
    def name(self) -> str:
        return self._name

    @property
    def stopped(self) -> bool:
        """True once the actor stopped or began stopping: tell and ask raise ActorStopped."""
        return self._mailbox.closed

    def stats(self) -> MailboxStats:
        return self._mailbox.stats()

    @property
    def full(self) -> bool:
        """Whether `try_tell` would raise MailboxFull now (cheaper than `stats()`)."""
        return self._mailbox.full

    async def tell(self, msg: M) -> None:
        """Queue `msg`, waiting while the mailbox is full. A handler error crashes the actor."""
        try:
            await self._mailbox.send(_Envelope(msg, None))
        except MailboxClosed:
            raise ActorStopped(self._name) from None

    def try_tell(self, msg: M) -> None:
        """Queue `msg` now or raise MailboxFull (or ActorStopped)."""
        try:
            self._mailbox.try_send(_Envelope(msg, None))
        except MailboxClosed:
            raise ActorStopped(self._name) from None

    @overload
    async def ask(self, msg: M, *, timeout: float = ...) -> object: ...

    @overload
    async def ask(self, msg: M, *, timeout: float = ..., expect: type[R]) -> R: ...

    async def ask(self, msg: M, *, timeout: float = 5.0, expect: type[Any] | None = None) -> Any:
        """Send `msg` and await the handler's result, or raise the handler's exception.

        The timeout covers waiting for mailbox space too; past it, AskTimeout (a TimeoutError).
        `expect=SomeType` checks the result's type at runtime and types the return value.
        """
        reply: asyncio.Future[object] = asyncio.get_running_loop().create_future()
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                try:
                    await self._mailbox.send(_Envelope(msg, reply))
                except MailboxClosed:
                    raise ActorStopped(self._name) from None
                result = await reply
        except TimeoutError:
            if deadline.expired():
                raise AskTimeout(self._name, timeout) from None
            raise  # the handler's own TimeoutError, not ours
        if expect is not None and not isinstance(result, expect):
            raise TypeError(
                f"actor {self._name!r} answered {type(result).__name__}, expected {expect.__name__}"
            )
        return result

    def __repr__(self) -> str:
        return f"<ActorRef {self._name!r}{' stopped' if self.stopped else ''}>"


class _Cell(Generic[M]):
    """The runtime side of one spawned actor: its supervisor loop and its background tasks."""

    def __init__(
        self,
        system: ActorSystem,
        name: str,
        factory: Callable[[], Actor[M]],
        mailbox: Mailbox[_Envelope[M]],
        policy: SupervisionPolicy,
        context: dict[str, object],
    ) -> None:
        self.system = system
        self.name = name
        self.factory = factory
        self.mailbox = mailbox
        self.policy = policy
        self.context = context
        self.ref = ActorRef(name, mailbox)
        self.started: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.task: asyncio.Task[None] | None = None
        self._incarnation = 0
        self._live: int | None = None  # the incarnation allowed to start background tasks
        self._ever_started = False
        self._stopping = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._rng: RandomSource | None = None

    @property
    def env(self) -> Env:
        return self.system.env

    # -- runtime services for ActorContext ---------------------------------------------------

    def create_task(
        self, coro: Coroutine[Any, Any, object], *, name: str, incarnation: int
    ) -> asyncio.Task[None]:
        if self._stopping or incarnation != self._live:
            coro.close()
            raise ActorStopped(self.name)
        task = self.system._group().create_task(
            self._guard(coro, incarnation), name=f"actor:{self.name}:{name}"
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def begin_stop(self) -> None:
        self._stopping = True
        self.mailbox.close()
        self._cancel_tasks()

    async def _guard(self, coro: Coroutine[Any, Any, object], incarnation: int) -> None:
        try:
            await coro
        except Exception as exc:
            # Crash the actor, not the system: the supervisor decides on a restart.
            self.env.log.exception("actor_task_failed", incarnation=incarnation)
            if incarnation == self._live and not self._stopping:
                self.mailbox.interrupt(exc)

    def _cancel_tasks(self) -> None:
        for task in list(self._tasks):
            task.cancel()

    # -- supervision -------------------------------------------------------------------------

    async def run(self) -> None:
        # Start from a clean logging context: the spawner's bindings belong to the spawner.
        structlog.contextvars.clear_contextvars()
        with structlog.contextvars.bound_contextvars(actor=self.name, **self.context):
            await self._supervise()

    async def _supervise(self) -> None:
        crashes = CrashWindow(self.policy.window)
        while True:
            try:
                await self._run_incarnation()
                return
            except Exception as exc:
                if not self._ever_started:
                    if not self.started.done():
                        self.started.set_exception(exc)  # spawn() raises it
                    return
                count = crashes.record(self.env.clock.monotonic())
                if count > self.policy.max_restarts:
                    self.env.log.exception(
                        "actor_crashed", incarnation=self._incarnation, crashes=count, gave_up=True
                    )
                    raise SupervisorGaveUp(self.name, count, self.policy.window) from exc
                delay = self.policy.backoff(count, self._backoff_rng())
                self.env.log.exception(
                    "actor_crashed",
                    incarnation=self._incarnation,
                    crashes=count,
                    restart_in=delay,
                )
            finally:
                self._live = None
                self._cancel_tasks()
                self.mailbox.clear_interrupt()  # a late task failure must not hit the restart
            if await self._stopped_during_backoff(delay):
                return
            self._incarnation += 1

    async def _stopped_during_backoff(self, delay: float) -> bool:
        """Wait out the back-off; a stop request meanwhile ends the actor without a restart."""
        if self.mailbox.closed:
            return True
        try:
            async with asyncio.timeout(delay):
                await self.mailbox.wait_closed()
        except TimeoutError:
            return False
        return True

    def _backoff_rng(self) -> RandomSource:
        # Its own stream, so a crash does not shift the draws of the actor or its siblings.
        if self._rng is None:
            self._rng = self.env.derive_rng(f"supervisor:{self.name}")
        return self._rng

    async def _run_incarnation(self) -> None:
        incarnation = self._incarnation
        actor = self.factory()
        ctx = ActorContext(
            name=self.name,
            env=self.env,
            self_ref=self.ref,
            system=self.system,
            context=self.context,
            incarnation=incarnation,
            runtime=self,
        )
        self._live = incarnation
        with structlog.contextvars.bound_contextvars(incarnation=incarnation):
            await actor.on_start(ctx)
            if not self._ever_started:
                self._ever_started = True
                if not self.started.done():
                    self.started.set_result(None)
            try:
                async for envelope in self.mailbox:
                    await self._deliver(actor, ctx, envelope)
            except Exception:
                self._cancel_tasks()
                await self._on_stop(actor, ctx)
                raise
            self._cancel_tasks()
            await self._on_stop(actor, ctx)

    async def _deliver(self, actor: Actor[M], ctx: ActorContext[M], envelope: _Envelope[M]) -> None:
        reply = envelope.reply
        try:
            result = await actor.handle(ctx, envelope.message)
        except StoreFull as exc:
            # A full disk is not a bug in the actor: persist() folds only after the append
            # succeeded, so its state is still what the log says. An asker gets the error; a
            # tell is dropped (the heartbeat, reconcile or report that caused it comes again)
            # rather than crash-looping the actor into its supervisor's give-up.
            if reply is None:
                self.system._note_disk_full(self.name, exc)
            elif not reply.done():
                reply.set_exception(exc)
        except Exception as exc:
            if reply is None:
                raise  # a tell: crash, the supervisor decides
            if not reply.done():  # done: the asker timed out and cancelled it
                reply.set_exception(exc)
        else:
            if reply is not None and not reply.done():
                reply.set_result(result)
        finally:
            # Reached with an open reply only when the handler was cancelled.
            if reply is not None and not reply.done():
                reply.set_exception(ActorStopped(self.name))

    async def _on_stop(self, actor: Actor[M], ctx: ActorContext[M]) -> None:
        try:
            await actor.on_stop(ctx)
        except Exception:
            # The actor is ending either way; restarting it to stop it again would loop.
            self.env.log.exception("actor_on_stop_failed")

    def on_done(self, task: asyncio.Task[None]) -> None:
        """Runs however the supervisor ended (even cancelled before its first step)."""
        self._stopping = True
        self._live = None
        self.mailbox.close()
        self._cancel_tasks()
        dropped = 0
        for envelope in self.mailbox.drain_nowait():
            if envelope.reply is None:
                dropped += 1
            elif not envelope.reply.done():
                envelope.reply.set_exception(ActorStopped(self.name))
        if not self.started.done():
            self.started.set_exception(ActorStopped(self.name))
        self.system._forget(self)
        how = "cancelled" if task.cancelled() else "failed" if task.exception() else "stopped"
        fields = {**self.context, "actor": self.name, "outcome": how, "dropped_messages": dropped}
        self.env.log.info("actor_stopped", **fields)


@final
class ActorSystem:
    """Owns one TaskGroup and every actor in it. Use as `async with ActorSystem(env) as s:`.

    Leaving the block normally runs `shutdown()`; leaving it with an exception cancels every
    actor and lets the exception through. An actor that exhausts its restarts raises
    SupervisorGaveUp, which fails the TaskGroup: the block ends with an ExceptionGroup.
    """

    def __init__(self, env: Env, *, shutdown_timeout: float = 10.0) -> None:
        self._env = env
        self._shutdown_timeout = shutdown_timeout
        self._tg: asyncio.TaskGroup | None = None
        self._cells: dict[str, _Cell[Any]] = {}  # in spawn order
        self._accepting = False
        self._shutdown_started = False
        self._shutdown_done = asyncio.Event()
        self.writes_refused = 0  # tells dropped because the event store's disk is full
        self._disk_full_logged_at = float("-inf")

    @property
    def env(self) -> Env:
        return self._env

    def _note_disk_full(self, actor: str, exc: StoreFull) -> None:
        self.writes_refused += 1
        now = self._env.clock.monotonic()
        if now - self._disk_full_logged_at >= 1.0:  # one line a second, not one per heartbeat
            self._disk_full_logged_at = now
            self._env.log.error(
                "event_store_full", actor=actor, refused=self.writes_refused, error=str(exc)
            )

    async def __aenter__(self) -> ActorSystem:
        if self._tg is not None:
            raise RuntimeError("an ActorSystem can be entered only once")
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._accepting = True
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        tg = self._group()
        try:
            if exc is None:
                if not self._shutdown_started:
                    tg.create_task(self.shutdown(), name="actor-system:shutdown")
                await tg.__aexit__(None, None, None)
            elif isinstance(exc, asyncio.CancelledError):
                await tg.__aexit__(exc_type, exc, tb)  # the group sorts out whose cancel it was
            else:
                # Cancel the actors ourselves so the body's exception propagates as itself,
                # not wrapped in an ExceptionGroup by the TaskGroup.
                self.force_stop()
                await tg.__aexit__(None, None, None)
        finally:
            self._accepting = False

    def _group(self) -> asyncio.TaskGroup:
        if self._tg is None:
            raise SystemNotRunning("use `async with ActorSystem(env) as system:` first")
        return self._tg

    async def spawn(
        self,
        factory: Callable[[], Actor[M]],
        name: str,
        *,
        mailbox_size: int = 1000,
        policy: SupervisionPolicy = DEFAULT_POLICY,
        context: Mapping[str, object] | None = None,
    ) -> ActorRef[M]:
        """Start an actor and return its ref once its `on_start` has completed.

        `factory` builds a fresh instance for every (re)start. `context` (node, cluster,
        replica...) is bound into every log line of the actor. Raises what the first
        `on_start` raised, DuplicateActor if `name` is taken, SystemNotRunning when the
        system is not running or is shutting down.
        """
        tg = self._group()
        if not self._accepting:
            raise SystemNotRunning("the actor system is shutting down")
        if not name:
            raise ValueError("an actor needs a non-empty name")
        extra = dict(context or {})
        reserved = _RESERVED_CONTEXT_KEYS & extra.keys()
        if reserved:
            raise ValueError(f"context keys {sorted(reserved)} are set by the runtime")
        if name in self._cells:
            raise DuplicateActor(name)
        mailbox: Mailbox[_Envelope[M]] = Mailbox(mailbox_size, name=name)
        cell = _Cell(self, name, factory, mailbox, policy, extra)
        self._cells[name] = cell
        cell.task = tg.create_task(cell.run(), name=f"actor:{name}")
        cell.task.add_done_callback(cell.on_done)
        await cell.started
        return cell.ref

    def get(self, name: str) -> ActorRef[Any] | None:
        cell = self._cells.get(name)
        return cell.ref if cell is not None else None

    def names(self) -> list[str]:
        """Running actors, in spawn order."""
        return list(self._cells)

    def _forget(self, cell: _Cell[Any]) -> None:
        if self._cells.get(cell.name) is cell:
            del self._cells[cell.name]

    async def stop(self, ref: ActorRef[Any], *, timeout: float | None = None) -> bool:
        """Stop one actor gracefully, cancelling it after `timeout`. True if it stopped in time."""
        cell = next((c for c in self._cells.values() if c.ref is ref), None)
        if cell is None or cell.task is None:
            return True
        if asyncio.current_task() is cell.task:
            raise RuntimeError("an actor cannot wait for its own stop: use ctx.stop()")
        cell.begin_stop()
        wait = self._shutdown_timeout if timeout is None else timeout
        done, _ = await asyncio.wait([cell.task], timeout=wait)
        if done:
            return True
        cell.task.cancel(msg=f"actor {cell.name!r} did not stop within {wait} s")
        await asyncio.wait([cell.task])
        return False

    async def shutdown(self, timeout: float | None = None) -> None:
        """Two-phase stop. Phase 1, newest actor first: close its mailbox, let it drain and
        run on_stop, then the next. Phase 2, once `timeout` has passed: cancel whatever is
        still running. `timeout` is one budget for all of phase 1, so an actor that does not
        stop holds up those spawned before it, and phase 2 cancels them all.

        Concurrent calls wait for the first one. From inside an actor, use
        `request_shutdown()` (waiting here would mean waiting for itself).
        """
        current = asyncio.current_task()
        if any(c.task is current for c in self._cells.values()):
            raise RuntimeError("an actor cannot wait for the shutdown: use request_shutdown()")
        if self._shutdown_started:
            await self._shutdown_done.wait()
            return
        self._shutdown_started = True
        self._accepting = False
        budget = self._shutdown_timeout if timeout is None else timeout
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget
        cells = list(self._cells.values())
        self._env.log.info("shutdown_started", actors=len(cells), timeout=budget)
        try:
            for cell in reversed(cells):
                cell.begin_stop()
                remaining = deadline - loop.time()
                if cell.task is not None and remaining > 0:
                    await asyncio.wait([cell.task], timeout=remaining)
            stuck = [c for c in cells if c.task is not None and not c.task.done()]
            if stuck:
                self._env.log.warning("shutdown_forced", actors=[c.name for c in stuck])
                self._cancel(stuck, f"shutdown phase 2: not stopped within {budget} s")
                await asyncio.wait([c.task for c in stuck if c.task is not None])
        finally:
            self._shutdown_done.set()
        self._env.log.info("shutdown_completed")

    def request_shutdown(self, timeout: float | None = None) -> None:
        """Start `shutdown()` in the background (safe from inside an actor)."""
        if not self._shutdown_started:
            self._group().create_task(self.shutdown(timeout), name="actor-system:shutdown")

    def force_stop(self) -> None:
        """Phase 2 now: cancel every actor (a second SIGTERM). A running shutdown completes."""
        self._accepting = False
        self._cancel(list(self._cells.values()), "forced stop")

    @staticmethod
    def _cancel(cells: list[_Cell[Any]], reason: str) -> None:
        for cell in cells:
            cell.begin_stop()
            if cell.task is not None:
                cell.task.cancel(msg=reason)
