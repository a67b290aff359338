"""The overlay transport: each HTTP request tunnelled over NATS to the node's agent.

For nodes that cannot be dialled (a home GPU behind NAT): the agent holds an outbound NATS
connection, and answers requests on `subjects.tunnel(node_id)` by forwarding them to its local
workload (nodeagent/tunnel.py). Framing: events/contract/tunnel.py; contract: docs/subjects.md.

One wildcard subscription, `<inbox>.*`, carries every response frame to this transport; a
reader task routes each to its request's queue by the last subject token. Through the Bus
protocol only, so it runs on the simulator's MemoryBus as on NATS.

Failures before the head, as gateway/transport/base.py wants them:
- nobody subscribed to the node's tunnel subject (NATS answers "no responders"), an ERROR that
  says the workload never saw the request, or no frame at all within `connect_timeout`:
  ConnectFailed (the agent ACKs within 50 ms a request whose head is slow, so silence means
  it never got there);
- ACKed but no HEAD within the request's `first_byte_timeout`: FirstByteTimeout;
- a lost frame, or an ERROR after the workload got the request: ResetBeforeHead.
After the head: an ERROR, a lost frame, or `idle_timeout` without a frame: StreamBroken.

Flow control: each request offers the agent a window of `window_bytes`; as the proxy takes
body chunks (it asks for the next only once it has written the last to its client), CREDIT
frames tell the agent how far it got. A slow client so holds at most about one window of its
body here, not everything the workload can produce.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Sequence
from typing import Final

import structlog

from events.contract import subjects, tunnel as frames
from events.contract.messages import RouteEntry
from events.contract.tunnel import FrameError, TunnelError, TunnelHead, TunnelRequest
from runtime.env import Bus, BusError, Msg, Subscription

from .base import (
    ConnectFailed,
    FirstByteTimeout,
    ResetBeforeHead,
    StreamBroken,
    UpstreamError,
    UpstreamRequest,
)

# NATS's default max_payload; a connected NatsBus reports the server's own.
# Two of the agent's largest frames in flight per request; a CREDIT every quarter of it.
DEFAULT_WINDOW_BYTES: Final = 2 * frames.MAX_FRAME_PAYLOAD
_NO_RESPONDERS: Final = "503"

_log = structlog.get_logger("gpumesh.overlay")


class RequestTooLarge(ConnectFailed):
    """The request does not fit in one NATS message (the server's max_payload). It never left
    the gateway; no replica can take it through the overlay, so a proxy that knows this class
    answers 413 rather than trying another replica."""

    def __init__(self, replica_id: str, size: int, limit: int) -> None:
        super().__init__(
            replica_id,
            f"request of {size} bytes (with its tunnel frame) exceeds the overlay's limit of "
            f"{limit} bytes (the NATS server's max_payload)",
        )
        self.size = size
        self.limit = limit


class OverlayTransport:
    name = "overlay"

    def __init__(
        self,
        bus: Bus,
        *,
        connect_timeout: float = 2.0,
        idle_timeout: float = 60.0,
        max_request_bytes: int = 0,
        inbox: str = "",
        window_bytes: int = DEFAULT_WINDOW_BYTES,
    ) -> None:
        """`idle_timeout`: the longest silence mid-body before the stream counts as broken.
        `max_request_bytes`: 0 takes the NATS server's max_payload (else 1 MiB). `inbox`: the
        reply subject prefix; by default the bus's `new_inbox()`, else a random one.
        `window_bytes`: body bytes the agent may send ahead of this client (0: no limit)."""
        if window_bytes < 0:
            raise ValueError(f"window_bytes must be 0 or more, not {window_bytes}")
        self._bus = bus
        self.window_bytes = window_bytes
        self.connect_timeout = connect_timeout
        self.idle_timeout = idle_timeout
        self._max_request = max_request_bytes
        self._prefix = inbox
        self._ids = itertools.count(1)
        self._streams: dict[str, asyncio.Queue[Msg | None]] = {}
        self._subscription: Subscription | None = None
        self._reader: asyncio.Task[None] | None = None
        self._starting = asyncio.Lock()
        self._closed = False
        self.stray = 0  # frames for requests already finished or abandoned

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def open(self, route: RouteEntry, request: UpstreamRequest) -> OverlayResponse:
        replica = route.replica_id
        if self._closed:
            raise ConnectFailed(replica, "the overlay transport is closed")
        try:
            await self._start()
        except BusError as exc:
            raise ConnectFailed(replica, f"cannot listen for tunnel replies: {exc}") from None
        meta = TunnelRequest(
            request_id=request.request_id,
            replica_id=replica,
            epoch=route.epoch,
            method=request.method,
            path=request.path,
            headers=tuple((k, v) for k, v in request.headers),
            timeout_s=request.first_byte_timeout,
            window=self.window_bytes,
        )
        frame = frames.encode_request(meta, request.body)
        if len(frame) > self._max_request:
            raise RequestTooLarge(replica, len(frame), self._max_request)
        token = str(next(self._ids))
        reply = f"{self._prefix}.{token}"
        subject = subjects.tunnel(route.node_id)
        queue: asyncio.Queue[Msg | None] = asyncio.Queue()
        self._streams[token] = queue
        try:
            await self._bus.publish(subject, frame, reply=reply)
        except BusError as exc:
            self._streams.pop(token, None)
            raise ConnectFailed(replica, f"cannot send to node {route.node_id}: {exc}") from None
        call = _Call(self, token, reply, subject, replica, request.request_id, queue)
        try:
            return await self._await_head(call, queue, route, request.first_byte_timeout)
        except BaseException:
            # Timed out, broken, or our caller gave up (cancelled): the agent may still hold it.
            # (An error the agent reported itself finished the call already: no CANCEL.)
            await call.finish(cancel=True)
            raise

    async def _await_head(
        self,
        call: _Call,
        queue: asyncio.Queue[Msg | None],
        route: RouteEntry,
        first_byte_timeout: float,
    ) -> OverlayResponse:
        replica = route.replica_id
        loop = asyncio.get_running_loop()
        start = loop.time()
        connect_by = start + self.connect_timeout
        head_by = start + first_byte_timeout
        acked = False
        while True:
            if queue.empty():
                deadline = head_by if acked else min(head_by, connect_by)
                try:
                    async with asyncio.timeout_at(deadline):
                        msg = await queue.get()
                except TimeoutError:
                    if not acked and loop.time() >= connect_by:
                        raise ConnectFailed(
                            replica,
                            f"node {route.node_id}'s agent did not acknowledge the request "
                            f"within {self.connect_timeout:g} s",
                            maybe_delivered=True,  # the agent forwards before it acknowledges
                        ) from None
                    raise FirstByteTimeout(
                        replica, f"no response head within {first_byte_timeout:g} s"
                    ) from None
            else:
                msg = queue.get_nowait()
            if msg is None:
                raise ResetBeforeHead(replica, "the overlay transport closed")
            if not msg.data and msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
                await call.finish(cancel=False)
                raise ConnectFailed(
                    replica, f"node {route.node_id}'s agent does not listen on {call.subject}"
                )
            try:
                frame = frames.decode(msg.data)
            except FrameError as exc:
                raise ResetBeforeHead(replica, f"garbage from the agent: {exc}") from None
            kind = frame.kind
            if kind == frames.ACK:
                acked = True
                continue
            if frame.seq != 0:
                raise ResetBeforeHead(
                    replica, f"a tunnel frame was lost (got {frame.kind_name} #{frame.seq} first)"
                )
            meta = frame.meta
            if isinstance(meta, TunnelHead):
                return OverlayResponse(call, meta, frame.payload)
            if isinstance(meta, TunnelError):
                await call.finish(cancel=False)
                raise _error_before_head(replica, meta)
            raise ResetBeforeHead(replica, f"the agent sent {frame.kind_name} before HEAD")

    async def _start(self) -> None:
        if self._reader is not None:
            return
        async with self._starting:
            if self._started():
                return
            if not self._prefix:
                self._prefix = self._bus.new_inbox()
            if not self._max_request:
                self._max_request = self._bus.max_payload
            subscription = await self._bus.subscribe(f"{self._prefix}.*")
            self._subscription = subscription
            self._reader = asyncio.create_task(
                self._demux(subscription), name=f"overlay demux {self._prefix}"
            )

    def _started(self) -> bool:
        return self._reader is not None

    async def _demux(self, subscription: Subscription) -> None:
        skip = len(self._prefix) + 1
        streams = self._streams
        try:
            async for msg in subscription:
                queue = streams.get(msg.subject[skip:])
                if queue is not None:
                    queue.put_nowait(msg)
                else:
                    self.stray += 1
        finally:
            # The bus closed (or close() cancelled us): every open request is cut off.
            for queue in streams.values():
                queue.put_nowait(None)
            if self._subscription is subscription:
                self._subscription = None
                self._reader = None

    def _drop(self, token: str) -> None:
        self._streams.pop(token, None)

    async def close(self) -> None:
        self._closed = True
        reader, self._reader = self._reader, None
        subscription, self._subscription = self._subscription, None
        if reader is not None:
            reader.cancel()
            try:
                await reader
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is not None and current.cancelling():
                    raise
        if subscription is not None:
            try:
                await subscription.unsubscribe()
            except BusError as exc:
                _log.debug("overlay_unsubscribe_failed", error=str(exc))


class _Call:
    """One request's state, shared by open() and its response."""

    __slots__ = ("queue", "replica", "reply", "request_id", "subject", "token", "transport")

    def __init__(
        self,
        transport: OverlayTransport,
        token: str,
        reply: str,
        subject: str,
        replica: str,
        request_id: str,
        queue: asyncio.Queue[Msg | None],
    ) -> None:
        self.transport = transport
        self.token = token
        self.reply = reply
        self.subject = subject
        self.replica = replica
        self.request_id = request_id
        self.queue: asyncio.Queue[Msg | None] | None = queue

    async def finish(self, *, cancel: bool) -> None:
        """Forget the request; with `cancel`, tell the agent to stop it."""
        if self.queue is None:
            return
        self.queue = None
        self.transport._drop(self.token)
        if cancel:
            try:
                await self.transport._bus.publish(
                    self.subject, frames.encode_cancel(self.reply, self.request_id)
                )
            except BusError as exc:
                _log.debug("overlay_cancel_failed", request_id=self.request_id, error=str(exc))


class OverlayResponse:
    """The response of one tunnelled request, its head in; implements UpstreamResponse."""

    def __init__(self, call: _Call, head: TunnelHead, first: bytes) -> None:
        self.status = head.status
        self.headers: Sequence[tuple[str, str]] = head.headers
        self._call = call
        self._first = first
        self._ended = head.end
        self._agent_done = head.end  # the agent sent its last frame for this request
        self._seq = 1
        self._passed = 0  # body bytes handed to the consumer
        self._credited = 0  # of those, how many the agent has been told about
        if head.end:
            call.transport._drop(call.token)
            call.queue = None

    async def chunks(self) -> AsyncIterator[bytes]:
        if self._first:
            first, self._first = self._first, b""
            yield first
            await self._passed_on(len(first))
        call = self._call
        while not self._ended:
            queue = call.queue
            if queue is None:
                raise StreamBroken(call.replica, "the response was closed")
            try:
                msg = await self._next(queue)
                payload, last = self._take(msg)
            except StreamBroken:
                await call.finish(cancel=not self._agent_done)
                raise
            if last:
                self._ended = True
                await call.finish(cancel=False)
            if payload:
                yield payload
                await self._passed_on(len(payload))

    async def _passed_on(self, size: int) -> None:
        """The consumer came back for more: `size` bytes are with the client. Tell the agent
        once a quarter of the window has gone, so it never waits on a client that keeps up."""
        call = self._call
        self._passed += size
        window = call.transport.window_bytes
        if not window or self._agent_done or self._passed - self._credited < window // 4:
            return
        self._credited = self._passed
        try:
            await call.transport._bus.publish(
                call.subject, frames.encode_credit(call.reply, self._passed)
            )
        except BusError as exc:
            # Cumulative: the next CREDIT makes up for this one (or the agent's stall timeout
            # ends a stream nobody can reach any more).
            _log.debug("overlay_credit_failed", request_id=call.request_id, error=str(exc))

    async def _next(self, queue: asyncio.Queue[Msg | None]) -> Msg | None:
        if not queue.empty():
            return queue.get_nowait()
        idle = self._call.transport.idle_timeout
        try:
            async with asyncio.timeout(idle):
                return await queue.get()
        except TimeoutError:
            raise StreamBroken(self._call.replica, f"no data for {idle:g} s") from None

    def _take(self, msg: Msg | None) -> tuple[bytes, bool]:
        """The body bytes in `msg`, and whether they are the last; StreamBroken if it is
        neither DATA nor END, or not the frame expected next."""
        replica = self._call.replica
        if msg is None:
            raise StreamBroken(replica, "the overlay transport closed")
        try:
            frame = frames.decode(msg.data)
        except FrameError as exc:
            raise StreamBroken(replica, f"garbage from the agent: {exc}") from None
        if frame.kind == frames.ACK:
            return b"", False  # a late one, overtaken by its HEAD
        if frame.seq != self._seq:
            raise StreamBroken(
                replica,
                f"a tunnel frame was lost (expected #{self._seq}, got "
                f"{frame.kind_name} #{frame.seq})",
            )
        self._seq += 1
        if frame.kind == frames.DATA:
            return frame.payload, False
        if frame.kind == frames.END:
            self._agent_done = True
            return frame.payload, True
        meta = frame.meta
        if isinstance(meta, TunnelError):
            self._agent_done = True
            raise StreamBroken(replica, f"{meta.reason}: {meta.detail}")
        raise StreamBroken(replica, f"the agent sent {frame.kind_name} in the body")

    async def aclose(self) -> None:
        if not self._ended:
            self._ended = True
            await self._call.finish(cancel=True)

    @property
    def finished(self) -> bool:
        return self._ended


def _error_before_head(replica: str, error: TunnelError) -> UpstreamError:
    detail = f"{error.reason}: {error.detail}" if error.detail else error.reason
    if error.reason in frames.NOT_DELIVERED:
        return ConnectFailed(replica, detail)
    if error.reason == "first_byte_timeout":
        return FirstByteTimeout(replica, detail)
    return ResetBeforeHead(replica, detail)
