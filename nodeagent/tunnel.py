"""The agent's end of the HTTP tunnel: HTTP requests that arrive over NATS, forwarded to the
local workloads, their responses streamed back in frames (events/contract/tunnel.py,
docs/subjects.md).

A node behind NAT has only its outbound NATS connection; the gateway's overlay transport
(gateway/transport/overlay.py) sends each request to `subjects.tunnel(node_id)` with a reply
inbox, and this server answers on that inbox: HEAD, then DATA frames as the body arrives, then
END (or ERROR). Everything goes through the Bus protocol, so it runs on the simulator's
MemoryBus as on NATS.

Flow control: when the request names a `window`, a body is read from the workload only as
fast as the gateway's CREDIT frames say its client takes it, so a slow client costs the
workload's socket buffer, not the gateway's memory. A gateway silent for `stall_timeout_s`
with the window full is gone or stuck: the request ends with ERROR `stalled`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Final

import structlog

from events.contract import subjects, tunnel as frames
from events.contract.tunnel import (
    HOP_BY_HOP,
    ErrorReason,
    FrameError,
    TunnelCancel,
    TunnelCredit,
    TunnelHead,
    TunnelRequest,
)
from runtime.env import Bus, BusError
from wire.http_client import (
    BodyError,
    ConnectError,
    HeadError,
    HeadTimeout,
    HttpClient,
    Response,
    check_request,
    encode_request,
    origin,
)

# (replica_id, epoch) -> the workload's base URL on this node (http://127.0.0.1:8000), or None
# when this agent does not run that replica at that epoch.
Resolve = Callable[[str, int], str | None]
# (replica_id, epoch) -> why this node must not serve it now ('' when it may): fencing.
Fence = Callable[[str, int], str]

DEFAULT_MAX_CONCURRENT: Final = 512
# A request whose response head is not ready this soon after it arrived gets an ACK frame, so
# that the gateway tells "the agent holds it" (then FirstByteTimeout) from "nobody got it"
# (ConnectFailed). Fast requests need none: their HEAD is the acknowledgement.
ACK_AFTER_S: Final = 0.05
_RETRY_S: Final = 1.0
# How long a request waits for CREDIT with its window full before it gives up (the gateway's
# own idle timeout for a stream is 60 s by default: longer than that, nobody is reading).
STALL_TIMEOUT_S: Final = 90.0


_log = structlog.get_logger("gpumesh.tunnel")


# A request without a timeout, and a stream's silence: the gateway keeps its own deadlines
# (and cancels), so the agent waits as long as they allow.
_NO_DEADLINE_S: Final = 24 * 3600.0


class _Stream:
    """One request in flight, answered on `reply`."""

    __slots__ = (
        "ack_timer",
        "answered",
        "cancelled",
        "credit",
        "credited",
        "reply",
        "request_id",
        "sent",
        "seq",
        "task",
        "window",
    )

    def __init__(self, reply: str, request_id: str, window: int = 0) -> None:
        self.reply = reply
        self.request_id = request_id
        self.window = window  # body bytes that may be ahead of the gateway's CREDIT (0: any)
        self.sent = 0  # body bytes sent
        self.credited = 0  # body bytes the gateway says it passed on
        self.credit: asyncio.Event | None = None  # set when CREDIT comes to a waiting sender
        self.seq = 0  # of the next response frame
        self.answered = False  # a HEAD or ERROR went out: no ACK needed any more
        self.cancelled = False  # by the gateway's CANCEL
        self.task: asyncio.Task[None] | None = None
        self.ack_timer: asyncio.TimerHandle | None = None


class TunnelServer:
    """Serves `subjects.tunnel(node_id)` until cancelled. `run()` owns a task per request (in a
    TaskGroup) and one HTTP client with keep-alive connections to the workloads."""

    def __init__(
        self,
        bus: Bus,
        node_id: str,
        resolve: Resolve,
        *,
        max_concurrent: int = DEFAULT_MAX_CONCURRENT,
        frame_bytes: int = frames.MAX_FRAME_PAYLOAD,
        ack_after_s: float = ACK_AFTER_S,
        log: Any = None,
        fence: Fence | None = None,
        stall_timeout_s: float = STALL_TIMEOUT_S,
    ) -> None:
        self.subject = subjects.tunnel(node_id)
        self._bus = bus
        self._resolve = resolve
        self._fence = fence
        self._max_concurrent = max_concurrent
        self._frame_bytes = frame_bytes
        self._ack_after_s = ack_after_s
        self._stall_timeout_s = stall_timeout_s
        self._log: Any = (log if log is not None else _log).bind(component="tunnel")
        self._streams: dict[str, _Stream] = {}
        self._group: asyncio.TaskGroup | None = None
        # Keep-alive connections to the workloads; no limit: the server bounds concurrency.
        self._client = HttpClient()
        self._acks: asyncio.Queue[_Stream] = asyncio.Queue()
        self.subscribed = asyncio.Event()  # for tests and callers that must not race the first
        self.window_full = asyncio.Event()  # set once any request has waited for CREDIT
        # Counters, for tests and status.
        self.requests = 0
        self.garbage = 0
        self.cancels = 0
        self.errors: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self._send_acks(), name="tunnel acks")
                await self._serve()
        finally:
            self._group = None
            await self._client.close()

    async def _serve(self) -> None:
        while True:
            try:
                subscription = await self._bus.subscribe(self.subject)
            except BusError as exc:
                self._log.warning("tunnel_subscribe_failed", error=str(exc))
                await asyncio.sleep(_RETRY_S)
                continue
            self.subscribed.set()
            try:
                async for msg in subscription:
                    try:
                        await self._receive(msg.data, msg.reply)
                    except Exception:
                        # A bug here must cost one request, not the agent and every replica.
                        self._log.exception("tunnel_receive_crashed")
            finally:
                self.subscribed.clear()
                await subscription.unsubscribe()
            await asyncio.sleep(_RETRY_S)  # the bus ended the subscription: it is closing

    async def _receive(self, data: bytes, reply: str) -> None:
        try:
            frame = frames.decode(data)
        except FrameError as exc:
            await self._garbage(str(exc), reply)
            return
        meta = frame.meta
        if isinstance(meta, TunnelRequest):
            await self._start(meta, frame.payload, reply)
        elif isinstance(meta, TunnelCancel):
            self._cancel(meta)
        elif isinstance(meta, TunnelCredit):
            self._credit(meta)
        else:
            await self._garbage(f"unexpected {frame.kind_name} frame on the tunnel subject", "")

    async def _garbage(self, why: str, reply: str) -> None:
        self.garbage += 1
        if self.garbage == 1 or self.garbage % 1000 == 0:
            self._log.warning("tunnel_garbage", error=why, count=self.garbage)
        if reply and reply not in self._streams:
            await self._publish(reply, frames.encode_error(0, "bad_request", why))

    async def _start(self, request: TunnelRequest, body: bytes, reply: str) -> None:
        if not reply:
            await self._garbage("a REQUEST frame without a reply subject", "")
            return
        if reply in self._streams:
            await self._garbage(f"a second REQUEST for the stream {reply}", "")
            return
        self.requests += 1
        if len(self._streams) >= self._max_concurrent:
            await self._fail_now(
                reply, "overloaded", f"{self._max_concurrent} requests in flight on this agent"
            )
            return
        fenced = self._fence(request.replica_id, request.epoch) if self._fence else ""
        if fenced:
            # Checked before the workload is even looked up: a node back from a partition may
            # still run a replica the controller has replaced, and a stale gateway may ask.
            await self._fail_now(reply, "fenced", fenced)
            return
        base = self._resolve(request.replica_id, request.epoch)
        if base is None:
            await self._fail_now(
                reply,
                "unknown_replica",
                f"this node does not run replica {request.replica_id} at epoch {request.epoch}",
            )
            return
        if not request.path.startswith("/"):
            await self._fail_now(reply, "bad_request", f"path {request.path!r} is not absolute")
            return
        assert self._group is not None
        stream = _Stream(reply, request.request_id, max(0, request.window))
        stream.ack_timer = asyncio.get_running_loop().call_later(
            self._ack_after_s, self._ack_due, stream
        )
        self._streams[reply] = stream
        stream.task = self._group.create_task(
            self._handle(stream, request, base, body),
            name=f"tunnel {request.request_id}",
        )

    def _cancel(self, cancel: TunnelCancel) -> None:
        stream = self._streams.get(cancel.reply)
        if stream is None or stream.task is None:
            return  # finished already, or never here
        self.cancels += 1
        stream.cancelled = True
        stream.task.cancel()

    def _credit(self, credit: TunnelCredit) -> None:
        stream = self._streams.get(credit.reply)
        if stream is None or credit.consumed <= stream.credited:
            return  # finished already, or an older CREDIT overtaken by a newer one
        stream.credited = credit.consumed
        if stream.credit is not None:
            stream.credit.set()

    async def _room(self, stream: _Stream) -> bool:
        """Wait until the stream's window has room. False once the gateway has stayed silent
        for the stall timeout: the request has then ended with ERROR `stalled`."""
        if not stream.window:
            return True
        # One frame may go beyond the window, so a frame larger than it still goes out.
        while stream.sent - stream.credited >= stream.window:
            self.window_full.set()
            stream.credit = asyncio.Event()
            try:
                async with asyncio.timeout(self._stall_timeout_s):
                    await stream.credit.wait()
            except TimeoutError:
                unacknowledged = stream.sent - stream.credited
                await self._error(
                    stream,
                    "stalled",
                    f"no CREDIT for {self._stall_timeout_s:g} s, "
                    f"{unacknowledged} bytes unacknowledged",
                )
                return False
            finally:
                stream.credit = None
        return True

    async def _fail_now(self, reply: str, reason: ErrorReason, detail: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1
        await self._publish(reply, frames.encode_error(0, reason, detail))

    # Acknowledgements, for requests whose head takes a while.

    def _ack_due(self, stream: _Stream) -> None:
        stream.ack_timer = None
        if not stream.answered:
            self._acks.put_nowait(stream)

    async def _send_acks(self) -> None:
        while True:
            stream = await self._acks.get()
            if not stream.answered and stream.reply in self._streams:
                await self._publish(stream.reply, frames.encode_ack())

    # One request.

    async def _handle(
        self, stream: _Stream, request: TunnelRequest, base: str, body: bytes
    ) -> None:
        try:
            await self._forward(stream, request, base, body)
        except asyncio.CancelledError:
            if not stream.cancelled:
                # The agent is shutting down: tell the gateway rather than leave it waiting.
                await asyncio.shield(self._error(stream, "cancelled", "the agent is stopping"))
            raise
        except Exception as exc:
            self._log.exception("tunnel_request_crashed", request_id=request.request_id)
            await self._error(stream, "internal", f"agent error: {exc!r}")
        finally:
            if stream.ack_timer is not None:
                stream.ack_timer.cancel()
            self._streams.pop(stream.reply, None)

    async def _forward(
        self, stream: _Stream, request: TunnelRequest, base: str, body: bytes
    ) -> None:
        headers = [(k, v) for k, v in request.headers if k.lower() not in HOP_BY_HOP]
        try:
            where = origin(base)
            check_request(request.method, headers)
        except ValueError as exc:
            await self._error(stream, "bad_request", _describe(exc))
            return
        data = encode_request(request.method, request.path, where, headers, body)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + (request.timeout_s or _NO_DEADLINE_S)
        try:
            response = await self._client.request(
                where.host, where.port, request.method, data, deadline
            )
        except ConnectError as exc:
            await self._error(stream, "connect_error", f"cannot reach {base}: {_describe(exc)}")
            return
        except HeadTimeout:
            await self._error(
                stream, "first_byte_timeout", f"no response head within {request.timeout_s:g} s"
            )
            return
        except HeadError as exc:
            await self._error(stream, "reset", f"before the response head: {_describe(exc)}")
            return
        try:
            await self._relay(stream, response)
        except BodyError as exc:
            await self._error(stream, "reset", f"in the response body: {_describe(exc)}")
        finally:
            # Back to the pool when the body was read to its end; else the connection drops
            # (cancelled or broken) and the workload sees its client go.
            response.close()

    async def _relay(self, stream: _Stream, response: Response) -> None:
        """HEAD (with whatever body is in already), then the body in frames as it arrives,
        each carrying everything buffered by then, up to the frame cap."""
        cap = self._frame_bytes
        assert response.head is not None
        head = TunnelHead(
            status=response.head.status,
            headers=tuple((k, v) for k, v in response.head.headers if k.lower() not in HOP_BY_HOP),
        )
        data = response.take(cap)
        if response.complete and not response.pending:
            head = TunnelHead(status=head.status, headers=head.headers, end=True)
            await self._send(stream, frames.encode_head(stream.seq, head, data))
            return
        await self._send(stream, frames.encode_head(stream.seq, head, data))
        stream.sent += len(data)
        while True:
            # Read only when the window has room: what the workload sends meanwhile waits in
            # the client's buffer, then in its socket, and TCP slows it down.
            if not await self._room(stream):
                return
            if not await response.readable(_NO_DEADLINE_S):
                await self._send(stream, frames.encode_end(stream.seq))
                return
            data = response.take(cap)
            stream.sent += len(data)
            if response.complete and not response.pending:
                await self._send(stream, frames.encode_end(stream.seq, data))
                return
            await self._send(stream, frames.encode_data(stream.seq, data))

    async def _send(self, stream: _Stream, frame: bytes) -> None:
        stream.answered = True
        stream.seq += 1
        await self._publish(stream.reply, frame)

    async def _error(self, stream: _Stream, reason: ErrorReason, detail: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1
        if reason not in ("connect_error", "unknown_replica", "cancelled"):
            self._log.info(
                "tunnel_request_failed", request_id=stream.request_id, why=reason, detail=detail
            )
        await self._send(stream, frames.encode_error(stream.seq, reason, detail))

    async def _publish(self, reply: str, frame: bytes) -> None:
        try:
            await self._bus.publish(reply, frame)
        except BusError as exc:
            # The gateway notices the missing frame (a gap, or its timeout).
            self._log.warning("tunnel_publish_failed", error=str(exc))


def _describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__
