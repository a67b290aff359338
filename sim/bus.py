"""An in-memory Bus with NATS subject semantics: `*` and `>` wildcards, queue groups, request/reply.

Deliveries happen in subscription order and queue-group members are chosen round-robin, so a
run is reproducible. Delivery here is instant and lossless; sim/network.py's SimNetwork routes
with the same rules (`route`) and adds per-link latency, loss, partitions and outages.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
from collections import deque
from collections.abc import AsyncIterator, Iterable
from typing import Generic, Protocol, TypeVar

import structlog

from runtime.env import (
    DEFAULT_MAX_PAYLOAD,
    NO_RESPONDERS,
    Msg,
    MsgHandler,
    NoResponders,
    ReconnectCallback,
    RequestTimeout,
)

log = structlog.get_logger(__name__)


@functools.lru_cache(maxsize=65_536)  # a fleet's few patterns and subjects, met over and over
def subject_matches(pattern: str, subject: str) -> bool:
    """NATS matching: `*` is exactly one token, `>` one or more trailing tokens."""
    p_tokens = pattern.split(".")
    s_tokens = subject.split(".")
    for i, token in enumerate(p_tokens):
        if token == ">":
            return len(s_tokens) > i
        if i >= len(s_tokens) or (token != "*" and token != s_tokens[i]):
            return False
    return len(p_tokens) == len(s_tokens)


class SubscriptionOwner(Protocol):
    """What a subscription tells when it is unsubscribed: the bus (or endpoint) it came from."""

    def _remove(self, sub: MemorySubscription) -> None: ...


T = TypeVar("T")


class Inbox(Generic[T]):
    """An unbounded asyncio.Queue with only what a subscription uses (put_nowait, get,
    get_nowait, empty, qsize) and the same semantics: items in order, waiting getters woken in
    order, a getter cancelled after it was woken passes the wake-up on. Every simulated message
    goes through one; asyncio.Queue's bookkeeping for bounds and `join` (half a dozen calls per
    message) bought nothing here."""

    __slots__ = ("_getters", "_items")

    def __init__(self) -> None:
        self._items: deque[T] = deque()
        self._getters: deque[asyncio.Future[None]] = deque()

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item: T) -> None:
        self._items.append(item)
        self._wake_one()

    def get_nowait(self) -> T:
        if not self._items:
            raise asyncio.QueueEmpty
        return self._items.popleft()

    async def get(self) -> T:
        items = self._items
        while not items:
            getter = asyncio.get_running_loop().create_future()
            self._getters.append(getter)
            try:
                await getter
            except BaseException:
                getter.cancel()  # no-op if it was already woken
                try:
                    self._getters.remove(getter)
                except ValueError:
                    pass  # it was woken (and so taken off the list) before it was cancelled
                if items and not getter.cancelled():
                    self._wake_one()  # the wake-up it got, for the next getter
                raise
        return items.popleft()

    def _wake_one(self) -> None:
        getters = self._getters
        while getters:
            getter = getters.popleft()
            if not getter.done():
                getter.set_result(None)
                return


class MemorySubscription:
    def __init__(
        self,
        bus: SubscriptionOwner,
        subject: str,
        queue: str,
        sid: int,
        handler: MsgHandler | None = None,
    ) -> None:
        self.bus = bus
        self.subject = subject
        self.queue = queue
        self.sid = sid
        self.handler = handler
        self._inbox: Inbox[Msg | None] = Inbox()
        self.closed = False

    def deliver(self, msg: Msg) -> None:
        if self.closed:
            return
        if self.handler is None:
            self._inbox.put_nowait(msg)
            return
        try:
            self.handler(msg)
        except Exception:
            # One bad message must not stop the deliveries of everyone after it.
            log.exception("subscription_handler_failed", subject=msg.subject)

    def __aiter__(self) -> AsyncIterator[Msg]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Msg]:
        while True:
            msg = await self._inbox.get()
            if msg is None:
                return
            yield msg

    async def next_msg(self, timeout: float) -> Msg:
        async with asyncio.timeout(timeout):
            msg = await self._inbox.get()
        if msg is None:
            raise asyncio.CancelledError("subscription closed")
        return msg

    async def unsubscribe(self) -> None:
        if not self.closed:
            self.closed = True
            self.bus._remove(self)
            self._inbox.put_nowait(None)


S = TypeVar("S", bound=MemorySubscription)


Plan = tuple[list[S], list[tuple[str, list[S]]]]


def plan(subs: Iterable[S], subject: str) -> Plan[S]:
    """Who a message on `subject` may go to: the matching plain subscriptions in subscription
    order, and the matching queue groups (name, members) in order of first member. `pick`
    picks from it; a caller that routes the same subject to the same subscriptions again and
    again may keep it."""
    plain: list[S] = []
    groups: dict[str, list[S]] = {}  # insertion-ordered: by first member, never by hash
    for sub in subs:
        if not subject_matches(sub.subject, subject):
            continue
        if sub.queue:
            groups.setdefault(sub.queue, []).append(sub)
        else:
            plain.append(sub)
    return plain, list(groups.items())


def pick(planned: Plan[S], turns: dict[str, int]) -> list[S]:
    """The subscriptions one message goes to: every plain one, then one member of each queue
    group, round-robin (`turns` keeps each group's count)."""
    plain, groups = planned
    if not groups:
        return plain
    targets = list(plain)
    for name, members in groups:
        turn = turns.get(name, 0)
        turns[name] = turn + 1
        targets.append(members[turn % len(members)])
    return targets


def route(subs: Iterable[S], subject: str, turns: dict[str, int]) -> list[S]:
    """The subscriptions a message on `subject` goes to, as a NATS server picks them: every
    matching plain subscription, in subscription order, then one member of each matching queue
    group, round-robin (`turns` keeps each group's count), groups in order of first member.

    As in nats-server, a queue group is its name alone: members on overlapping subjects
    (`q.*` and `q.>` in group `g`) share one delivery.
    """
    return list(pick(plan(subs, subject), turns))


class MemoryBus:
    # An in-process hub is never cut off; a test sets this False to stand for a cut-off.
    is_connected: bool = True

    def __init__(self) -> None:
        self._subs: list[MemorySubscription] = []
        self._sids = itertools.count(1)
        self._inboxes = itertools.count(1)
        self._round_robin: dict[str, int] = {}
        self.published = 0

    async def publish(
        self, subject: str, data: bytes, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        msg = Msg(subject=subject, data=data, reply=reply, headers=headers)
        if self.deliver(msg) == 0 and reply:
            # As a NATS server does for a client that asked for it (nats-py does): a message
            # with a reply subject that nobody takes is answered "503, no responders".
            self.deliver(Msg(subject=reply, data=b"", headers={"Status": NO_RESPONDERS}))

    def deliver(self, msg: Msg) -> int:
        """Hand `msg` to every matching subscriber (one per queue group); return how many."""
        self.published += 1
        targets = route(list(self._subs), msg.subject, self._round_robin)
        for sub in targets:
            if sub.handler is None:
                sub.deliver(msg)
            else:  # not in the publisher's context (its bound log fields, for one)
                contextvars.Context().run(sub.deliver, msg)
        return len(targets)

    @property
    def max_payload(self) -> int:
        return DEFAULT_MAX_PAYLOAD

    def new_inbox(self) -> str:
        """A subject no other caller gets (`_INBOX.<n>`, deterministic), for replies to it."""
        return f"_INBOX.{next(self._inboxes)}"

    def add_reconnect_callback(self, callback: ReconnectCallback) -> None:
        pass  # it never disconnects, so there is never a reconnection to tell of

    def remove_reconnect_callback(self, callback: ReconnectCallback) -> None:
        pass

    async def subscribe(
        self, subject: str, *, queue: str = "", handler: MsgHandler | None = None
    ) -> MemorySubscription:
        sub = MemorySubscription(self, subject, queue, next(self._sids), handler)
        self._subs.append(sub)
        return sub

    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        inbox = f"_INBOX.{next(self._inboxes)}"
        sub = await self.subscribe(inbox)
        try:
            if self.deliver(Msg(subject=subject, data=data, reply=inbox, headers=headers)) == 0:
                raise NoResponders(subject)
            try:
                return await sub.next_msg(timeout)
            except TimeoutError:
                raise RequestTimeout(subject, timeout) from None
        finally:
            await sub.unsubscribe()

    def _remove(self, sub: MemorySubscription) -> None:
        self._subs.remove(sub)
