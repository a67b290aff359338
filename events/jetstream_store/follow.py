"""Subscriptions: an ordered push consumer per subscriber, from a stream sequence on.

JetStream delivers in sequence order and nats-py's ordered consumer starts again after the
last sequence it delivered when it sees a gap in its own delivery sequence or misses two idle
heartbeats: no gap, no duplicate, and it follows every writer of the stream, not only this
store object. A page ends where the consumer says nothing more is pending, so the messages of
one atomic batch (committed all at once) come out in one page, as `subscribe_batches` wants.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator
from typing import Final

import nats.errors
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext

from events.envelope import Envelope

from . import messages as m
from .jsapi import Api, translated

# How long a page waits for a message the consumer said was pending. Only a compaction that
# deletes pending messages makes it wait this long; the page then ends with what it has.
_STRAGGLER_S: Final = 1.0
_LAST_SEQ: Final = (1 << 63) - 1


class Followers:
    def __init__(self, api: Api) -> None:
        self._api = api
        self._queues: set[asyncio.Queue[Msg | None]] = set()
        self.closed = False

    def close(self) -> None:
        self.closed = True
        for queue in self._queues:
            # A full queue has a subscriber busy with it, which checks `closed` before it
            # waits again.
            with contextlib.suppress(asyncio.QueueFull):
                queue.put_nowait(None)

    async def envelopes(self, from_position: int) -> AsyncGenerator[Envelope, None]:
        async with contextlib.aclosing(self.pages(from_position)) as pages:
            async for page in pages:
                for envelope in page:
                    yield envelope

    async def pages(
        self, from_position: int, page: int = 1000
    ) -> AsyncGenerator[list[Envelope], None]:
        """Ends quietly when the store closes."""
        if self.closed:
            return
        queue: asyncio.Queue[Msg | None] = asyncio.Queue(maxsize=2 * page)
        self._queues.add(queue)
        sub = None
        try:
            sub = await self._subscribe(queue, min(max(1, from_position), _LAST_SEQ))
            while (batch := await self._take(queue, page)) is not None:
                yield [self._envelope(msg) for msg in batch]
        finally:
            self._queues.discard(queue)
            if sub is not None:
                with contextlib.suppress(nats.errors.Error, OSError):
                    await sub.unsubscribe()

    async def _subscribe(
        self, queue: asyncio.Queue[Msg | None], start: int
    ) -> JetStreamContext.PushSubscription:
        options = self._api.options

        async def take(msg: Msg) -> None:
            # Waits when the subscriber lags: nats-py then stops answering the server's flow
            # control, and the server stops sending. Memory stays bounded.
            await queue.put(msg)

        js = self._api.nc.jetstream(timeout=options.request_timeout_s)
        with translated(options):
            return await js.subscribe(
                options.filter,
                stream=options.stream,
                cb=take,
                ordered_consumer=True,
                config=ConsumerConfig(
                    deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
                    opt_start_seq=start,
                    mem_storage=True,
                ),
            )

    async def _take(self, queue: asyncio.Queue[Msg | None], page: int) -> list[Msg] | None:
        if self.closed:
            return None
        msg = await queue.get()
        if msg is None or self.closed:
            return None
        batch = [msg]
        while len(batch) < page:
            if not queue.empty():
                msg = queue.get_nowait()
            elif msg.metadata.num_pending == 0:
                break
            else:
                try:
                    async with asyncio.timeout(_STRAGGLER_S):
                        msg = await queue.get()
                except TimeoutError:
                    break
            if msg is None:
                break
            batch.append(msg)
        return batch

    def _envelope(self, msg: Msg) -> Envelope:
        stream = self._api.options.stream_of(msg.subject)
        return m.envelope(stream, msg.metadata.sequence.stream, msg.headers or {}, msg.data)
