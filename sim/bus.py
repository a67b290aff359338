"""An in-memory Bus with NATS subject semantics: `*` and `>` wildcards, queue groups, request/reply.

Deliveries happen in subscription order and queue-group members are chosen round-robin, so a
run is reproducible. Delivery here is instant and lossless; sim/network.py's SimNetwork routes
with the same rules (`route`) and adds per-link latency, loss, partitions and outages.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
from collections.abc import AsyncIterator, Iterable
from typing import Protocol, TypeVar

from actors.env import Msg, NoResponders, RequestTimeout


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


class MemorySubscription:
    def __init__(self, bus: SubscriptionOwner, subject: str, queue: str, sid: int) -> None:
        self.bus = bus
        self.subject = subject
        self.queue = queue
        self.sid = sid
        self._inbox: asyncio.Queue[Msg | None] = asyncio.Queue()
        self.closed = False

    def deliver(self, msg: Msg) -> None:
        if not self.closed:
            self._inbox.put_nowait(msg)

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


def route(subs: Iterable[S], subject: str, turns: dict[str, int]) -> list[S]:
    """The subscriptions a message on `subject` goes to, as a NATS server picks them: every
    matching plain subscription, in subscription order, then one member of each matching queue
    group, round-robin (`turns` keeps each group's count), groups in order of first member.

    As in nats-server, a queue group is its name alone: members on overlapping subjects
    (`q.*` and `q.>` in group `g`) share one delivery.
    """
    plain: list[S] = []
    groups: dict[str, list[S]] = {}  # insertion-ordered: by first member, never by hash
    for sub in subs:
        if not subject_matches(sub.subject, subject):
            continue
        if sub.queue:
            groups.setdefault(sub.queue, []).append(sub)
        else:
            plain.append(sub)
    for name, members in groups.items():
        turn = turns.get(name, 0)
        turns[name] = turn + 1
        plain.append(members[turn % len(members)])
    return plain


class MemoryBus:
    def __init__(self) -> None:
        self._subs: list[MemorySubscription] = []
        self._sids = itertools.count(1)
        self._inboxes = itertools.count(1)
        self._round_robin: dict[str, int] = {}
        self.published = 0

    async def publish(
        self, subject: str, data: bytes, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        self.deliver(Msg(subject=subject, data=data, reply=reply, headers=headers))

    def deliver(self, msg: Msg) -> int:
        """Hand `msg` to every matching subscriber (one per queue group); return how many."""
        self.published += 1
        targets = route(list(self._subs), msg.subject, self._round_robin)
        for sub in targets:
            sub.deliver(msg)
        return len(targets)

    def new_inbox(self) -> str:
        """A subject no other caller gets (`_INBOX.<n>`, deterministic), for replies to it."""
        return f"_INBOX.{next(self._inboxes)}"

    async def subscribe(self, subject: str, *, queue: str = "") -> MemorySubscription:
        sub = MemorySubscription(self, subject, queue, next(self._sids))
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
