"""A bounded, closable, observable mailbox on top of asyncio.Queue.

The queue itself is unbounded and the bound is kept here: asyncio.Queue (before 3.13) cannot
wake senders that wait for space when the receiver goes away, so they would hang on close.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Generic, TypeVar, final

from .errors import MailboxClosed, MailboxFull

T = TypeVar("T")


@final
class _Wake:
    """Queued by close() and interrupt() to wake a receiver blocked on an empty queue."""


_WAKE = _Wake()


@final
@dataclass(frozen=True, slots=True)
class MailboxStats:
    size: int
    capacity: int
    peak: int  # the largest size seen: how close this mailbox came to backpressure
    waiting_senders: int
    closed: bool


@final
class Mailbox(Generic[T]):
    """FIFO of at most `capacity` items with one receiver.

    `send` waits while full (backpressure), `try_send` raises MailboxFull instead. After
    `close()` every send raises MailboxClosed, waiting senders included, while the receiver
    still gets everything queued before the close; then `receive` raises MailboxClosed and
    iteration ends.
    """

    def __init__(self, capacity: int = 1000, *, name: str = "") -> None:
        if capacity < 1:
            raise ValueError(f"mailbox capacity must be at least 1, got {capacity}")
        self._name = name
        self._capacity = capacity
        self._queue: asyncio.Queue[T | _Wake] = asyncio.Queue()
        self._size = 0  # real items only; _WAKE markers are not counted
        self._peak = 0
        self._senders: deque[asyncio.Future[None]] = deque()
        self._closed = False
        self._closed_event = asyncio.Event()
        self._interrupt: Exception | None = None

    @property
    def name(self) -> str:
        return self._name

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> MailboxStats:
        return MailboxStats(
            size=self._size,
            capacity=self._capacity,
            peak=self._peak,
            waiting_senders=sum(1 for f in self._senders if not f.done()),
            closed=self._closed,
        )

    def __len__(self) -> int:
        return self._size

    @property
    def full(self) -> bool:
        return self._size >= self._capacity

    async def send(self, item: T) -> None:
        while True:
            if self._closed:
                raise MailboxClosed(self._name)
            if self._size < self._capacity:
                self._put(item)
                return
            await self._wait_for_space()

    def try_send(self, item: T) -> None:
        if self._closed:
            raise MailboxClosed(self._name)
        if self._size >= self._capacity:
            raise MailboxFull(self._name, self._capacity)
        self._put(item)

    async def receive(self) -> T:
        while True:
            if self._interrupt is not None:
                exc, self._interrupt = self._interrupt, None
                raise exc
            if self._closed and self._size == 0:
                raise MailboxClosed(self._name)
            item = await self._queue.get()
            if isinstance(item, _Wake):
                continue
            self._size -= 1
            self._wake_one_sender()
            return item

    def __aiter__(self) -> Mailbox[T]:
        return self

    async def __anext__(self) -> T:
        try:
            return await self.receive()
        except MailboxClosed:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Refuse further sends; the receiver drains what is already queued. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._closed_event.set()
        self._queue.put_nowait(_WAKE)
        while self._senders:
            waiter = self._senders.popleft()
            if not waiter.done():
                waiter.set_result(None)  # it re-checks, sees the close and raises

    async def wait_closed(self) -> None:
        await self._closed_event.wait()

    def interrupt(self, exc: Exception) -> None:
        """Make the receiver's next (or current) `receive` raise `exc`; queued items stay."""
        self._interrupt = exc
        self._queue.put_nowait(_WAKE)

    def clear_interrupt(self) -> None:
        """Drop an interrupt nobody received yet (its receiver already ended)."""
        self._interrupt = None

    def drain_nowait(self) -> list[T]:
        """Take everything queued without waiting (used once the receiver is gone for good)."""
        items: list[T] = []
        while not self._queue.empty():
            item = self._queue.get_nowait()
            if not isinstance(item, _Wake):
                items.append(item)
        self._size = 0
        self._wake_one_sender()
        return items

    def _put(self, item: T) -> None:
        self._queue.put_nowait(item)
        self._size += 1
        self._peak = max(self._peak, self._size)

    async def _wait_for_space(self) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._senders.append(waiter)
        woken = False
        try:
            await waiter
            woken = True
        finally:
            if not woken:
                if waiter in self._senders:
                    self._senders.remove(waiter)
                # Woken for a free slot but cancelled before taking it: pass the slot on.
                if waiter.done() and not waiter.cancelled():
                    self._wake_one_sender()

    def _wake_one_sender(self) -> None:
        if self._size >= self._capacity:
            return
        while self._senders:
            waiter = self._senders.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
