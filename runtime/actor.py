"""The Actor base class and the context the runtime hands to its hooks."""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Coroutine, Mapping
from typing import TYPE_CHECKING, Any, Generic, Protocol, TypeVar, final

from .env import Env

if TYPE_CHECKING:
    from .system import ActorRef, ActorSystem

MsgT = TypeVar("MsgT")


class _Runtime(Protocol):
    """What a context needs from the runtime cell that runs its actor."""

    def create_task(
        self, coro: Coroutine[Any, Any, object], *, name: str, incarnation: int
    ) -> asyncio.Task[None]: ...

    def begin_stop(self) -> None: ...


@final
class ActorContext(Generic[MsgT]):
    """Who the actor is and what it may use: passed to every hook. Built by the runtime.

    One context per incarnation: a restarted actor gets a fresh instance and a fresh context
    (with `incarnation` one higher) but keeps its mailbox and its ActorRef.
    """

    __slots__ = ("_context", "_env", "_incarnation", "_name", "_runtime", "_self_ref", "_system")

    def __init__(
        self,
        *,
        name: str,
        env: Env,
        self_ref: ActorRef[MsgT],
        system: ActorSystem,
        context: Mapping[str, object],
        incarnation: int,
        runtime: _Runtime,
    ) -> None:
        self._name = name
        self._env = env
        self._self_ref = self_ref
        self._system = system
        self._context = context
        self._incarnation = incarnation
        self._runtime = runtime

    @property
    def name(self) -> str:
        return self._name

    @property
    def env(self) -> Env:
        return self._env

    @property
    def log(self) -> Any:
        """The Env's logger; inside the actor's tasks every line carries the actor's context."""
        return self._env.log

    @property
    def self_ref(self) -> ActorRef[MsgT]:
        return self._self_ref

    @property
    def system(self) -> ActorSystem:
        return self._system

    @property
    def context(self) -> Mapping[str, object]:
        """The spawn `context` (node, cluster, replica...) bound into every log line."""
        return self._context

    @property
    def incarnation(self) -> int:
        """0 for the first instance, then one more per restart."""
        return self._incarnation

    def create_task(
        self, coro: Coroutine[Any, Any, object], *, name: str = "task"
    ) -> asyncio.Task[None]:
        """Run `coro` beside the message loop (timers, subscriptions), owned by the system.

        The task is cancelled when this incarnation ends or the actor starts stopping. If it
        raises, the actor crashes at its next message boundary and is supervised as usual.
        Raises ActorStopped if the actor is already stopping.
        """
        return self._runtime.create_task(coro, name=name, incarnation=self._incarnation)

    def stop(self) -> None:
        """Stop this actor gracefully: close its mailbox, finish what is queued, run on_stop."""
        self._runtime.begin_stop()


class Actor(ABC, Generic[MsgT]):
    """Subclass and override `handle`, and optionally `on_start` and `on_stop`. Nothing else
    of this class is meant to be overridden. Never run an actor yourself: pass a factory to
    `ActorSystem.spawn`, which builds a fresh instance for every (re)start.

    - `on_start(ctx)`: runs before the first message; `spawn` returns once it has completed,
      and raises what it raised on the first start. Good for timers (`ctx.create_task`).
    - `handle(ctx, msg)`: one message at a time, in mailbox order. Its return value answers an
      `ask`. An exception goes to the asker on `ask` (the actor lives on); on `tell` it
      crashes the actor and the supervision policy decides on a restart.
    - `on_stop(ctx)`: runs after a graceful stop (mailbox closed and drained) and after a
      crash, before any restart. It does not run when the actor is cancelled (phase 2 of
      shutdown, or the system failing), so it must not be the only guard of an invariant.
    """

    async def on_start(self, ctx: ActorContext[MsgT]) -> None:
        """Prepare the actor; the default does nothing."""

    @abstractmethod
    async def handle(self, ctx: ActorContext[MsgT], msg: MsgT) -> object:
        """Process one message; the result answers an ask (ignored for a tell)."""

    async def on_stop(self, ctx: ActorContext[MsgT]) -> None:
        """Release what on_start took; the default does nothing."""
