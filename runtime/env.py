"""The only door from an actor to the outside world.

An actor gets time, randomness, messaging, storage and logging from its Env and from nothing
else; ruff's banned-api rule (pyproject.toml) and tests/test_architecture.py hold this.
The real implementations live in runtime/real_env.py, the simulated ones in sim/.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, MutableSequence, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol, TypeVar

import msgspec
import structlog

from events import DomainEvent, EventStore, NewEvent, new_event
from events.ids import uuid7

# The Bus's errors belong to its protocol: callers take them from here or from runtime.errors.
from .errors import (
    BusError as BusError,
    NoResponders as NoResponders,
    RequestTimeout as RequestTimeout,
)

T = TypeVar("T")


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds on the running loop's clock: virtual in the simulator."""
        ...

    def wall_ns(self) -> int:
        """Nanoseconds since the Unix epoch, for event stamps."""
        ...


class RandomSource(Protocol):
    """The subset of random.Random that actors use. Always seeded, never the module-level one."""

    def random(self) -> float: ...
    def uniform(self, a: float, b: float, /) -> float: ...
    def randint(self, a: int, b: int, /) -> int: ...
    def getrandbits(self, k: int, /) -> int: ...
    def choice(self, seq: Sequence[T], /) -> T: ...
    def shuffle(self, x: MutableSequence[Any], /) -> None: ...


class Msg(msgspec.Struct, frozen=True, kw_only=True):
    """A message as delivered by a Bus (NATS semantics)."""

    subject: str
    data: bytes
    reply: str = ""
    headers: dict[str, str] | None = None


NO_RESPONDERS = "503"
"""The Status header of the answer a Bus delivers, as NATS does, to the reply subject of a
message that nobody subscribed to takes (a request's, and any publish's with a reply)."""


def is_no_responders(msg: Msg) -> bool:
    return not msg.data and msg.headers is not None and msg.headers.get("Status") == NO_RESPONDERS


MsgHandler = Callable[[Msg], None]
"""Takes a message as it arrives (`Bus.subscribe(..., handler=...)`); must not block."""

ReconnectCallback = Callable[[], Awaitable[None]]
"""Awaited after every reconnection of a Bus (`Bus.add_reconnect_callback`)."""


class Subscription(Protocol):
    def __aiter__(self) -> AsyncIterator[Msg]: ...
    async def unsubscribe(self) -> None: ...


class Bus(Protocol):
    """Publish/subscribe/request with NATS subject semantics (`*`, `>`, queue groups), and what
    callers need to know of the connection under it. Every member is required: `check_bus`
    refuses an adapter that lacks one when an Env is built, rather than letting a caller guess
    (a controller that cannot tell it is cut off would declare the whole fleet offline)."""

    @property
    def is_connected(self) -> bool:
        """Whether the connection is up now: while it is down, nothing is heard from anyone."""
        ...

    @property
    def max_payload(self) -> int:
        """The largest message, in bytes, the server takes."""
        ...

    def new_inbox(self) -> str:
        """A subject for replies that nobody else gets, under this identity's inbox prefix
        (the only one its NATS permissions let it read)."""
        ...

    def add_reconnect_callback(self, callback: ReconnectCallback) -> None:
        """Await `callback()` after every reconnection (to ask again for what may have been
        missed while the connection was down)."""
        ...

    def remove_reconnect_callback(self, callback: ReconnectCallback) -> None: ...

    async def publish(
        self, subject: str, data: bytes, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None: ...

    async def subscribe(
        self, subject: str, *, queue: str = "", handler: MsgHandler | None = None
    ) -> Subscription:
        """Messages on `subject` (one member of `queue` each, if given), to iterate over; or,
        with `handler`, each passed to it on arrival, in order, and none to iterate over (the
        iteration ends at `unsubscribe`). A handler suits a consumer whose work per message
        is a few field updates: iterating costs a task wake-up per message, more than the
        work. What a handler raises is logged and the message is dropped."""
        ...

    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg: ...


DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's own default for max_payload

BUS_MEMBERS = (
    "is_connected",
    "max_payload",
    "new_inbox",
    "add_reconnect_callback",
    "remove_reconnect_callback",
    "publish",
    "subscribe",
    "request",
)


def check_bus(bus: object) -> None:
    """Raise TypeError, naming what is missing, if `bus` lacks a member of the Bus protocol."""
    missing = [name for name in BUS_MEMBERS if not hasattr(type(bus), name)]
    if missing:
        raise TypeError(f"{type(bus).__name__} is not a Bus: it lacks {', '.join(missing)}")


class NoBus:
    """A bus for actors that need none: every use says so."""

    @property
    def is_connected(self) -> bool:
        raise RuntimeError("this Env has no bus")

    @property
    def max_payload(self) -> int:
        raise RuntimeError("this Env has no bus")

    def new_inbox(self) -> str:
        raise RuntimeError("this Env has no bus")

    def add_reconnect_callback(self, callback: ReconnectCallback) -> None:
        raise RuntimeError("this Env has no bus")

    def remove_reconnect_callback(self, callback: ReconnectCallback) -> None:
        raise RuntimeError("this Env has no bus")

    async def publish(
        self, subject: str, data: bytes, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        raise RuntimeError("this Env has no bus")

    async def subscribe(
        self, subject: str, *, queue: str = "", handler: MsgHandler | None = None
    ) -> Subscription:
        raise RuntimeError("this Env has no bus")

    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        raise RuntimeError("this Env has no bus")


def never(site: str) -> bool:
    """Production's fault-injection switch: no site ever misbehaves."""
    return False


# Named fault-injection sites (FoundationDB's BUGGIFY): code asks `env.buggify(site)` and, only
# under the simulator, misbehaves when it says so. Each name is documented in
# docs/simulation.md; the simulator decides per run (from the seed) which sites are on.
BUGGIFY_SITES = (
    "agent.heartbeat.late",  # a heartbeat goes out most of an interval late (a stalled host)
    "agent.report.lost",  # a replica report is not sent (the heartbeat must carry the news)
    "controller.reconcile.skip",  # a periodic reconcile pass is skipped
)


@dataclass(frozen=True, slots=True)
class Env:
    """Everything nondeterministic an actor may touch, injected.

    `derive_rng(name)` gives a component its own stream from the root seed, so adding a
    component does not perturb the draws of the others.
    """

    clock: Clock
    rng: RandomSource
    store: EventStore
    derive_rng: Callable[[str], RandomSource]
    bus: Bus = field(default_factory=NoBus)
    log: Any = field(default_factory=lambda: structlog.get_logger("gpumesh"))
    buggify: Callable[[str], bool] = never

    def __post_init__(self) -> None:
        check_bus(self.bus)

    def new_id(self) -> str:
        """A time-ordered UUIDv7 from the injected clock and random source."""
        return uuid7(self.clock.wall_ns(), self.rng)

    def new_event(
        self, payload: DomainEvent, *, correlation_id: str = "", causation_id: str = ""
    ) -> NewEvent:
        return new_event(
            payload,
            wall_ns=self.clock.wall_ns(),
            entropy=self.rng,
            correlation_id=correlation_id,
            causation_id=causation_id,
        )

    def bind(self, **context: object) -> Env:
        """The same Env with a logger that carries extra context (node, cluster, replica)."""
        return replace(self, log=self.log.bind(**context))
