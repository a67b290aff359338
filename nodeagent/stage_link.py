"""The stage link: pipeline stages' TCP connections carried over NATS
(events/contract/stage_link.py; docs/subjects.md, "Stage link").

A sharded replica's head engine dials each worker engine over plain TCP (llama.cpp's
`--rpc host:port`). When the stages may reach each other only through the overlay (a node
behind NAT has nothing but its outbound NATS connection), the agents carry those connections:

* the head's agent runs a `StageLinkClient`: for each worker it listens on 127.0.0.1:<free
  port> (`forward`), the address that goes into the head's command instead of the worker's,
  and carries each connection made to it as one stream to the worker's agent;
* the worker's agent runs a `StageLinkServer`: an OPEN naming a replica, an epoch and a rank
  that this node runs (`resolve`) and still may (`fence`) is connected to that stage's local
  port; anything else is refused in one line.

Bytes go both ways in numbered DATA frames, within the receiver's credit window; a lost frame
ends the stream (ERROR `gap`) and the local socket is reset, so an engine never reads a byte
stream with a hole in it. A peer that leaves the window full for `stall_timeout_s` is given
up. Everything goes through the Bus protocol: the simulator's MemoryBus as NATS.

Security: the link carries whatever the engines speak (llama.cpp's RPC is unauthenticated and
gives its client the worker's memory), so it is exactly as safe as the NATS connection: TLS
and one NKEY identity per node. Every frame's subject names its sender in a token that NATS
permissions pin to the sender's own node id, so the server knows which node opened a stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog

from events.contract import stage_link as frames
from events.contract.stage_link import (
    DEFAULT_WINDOW,
    MAX_CHUNK,
    ErrorReason,
    Frame,
    FrameError,
    StageAccept,
    StageCredit,
    StageError,
    StageOpen,
)
from runtime.env import Bus, BusError, Msg, Subscription, is_no_responders

# (replica_id, epoch, rank) -> where that stage's engine listens on this node, or None when
# this agent does not run that rank of that replica at exactly that epoch.
Resolve = Callable[[str, int, int], tuple[str, int] | None]
# (replica_id, epoch) -> why this node must not serve it now ('' when it may): fencing.
Fence = Callable[[str, int], str]
# (head node, replica_id, epoch) -> why that node may not open links to the replica's stages
# ('' when it may). The head node is the one NATS let publish the OPEN (its subject's sender
# token, pinned by permissions), so this is the worker's check of who is calling.
Admit = Callable[[str, str, int], str]

# A peer that leaves our window full this long is gone or stuck. An engine reads its socket
# continuously while it works, so a full window for this long is not a slow model.
STALL_TIMEOUT_S: Final = 60.0
# The head's wait for ACCEPT: the worker's agent only has to connect on its own loopback.
OPEN_TIMEOUT_S: Final = 10.0
CONNECT_TIMEOUT_S: Final = 5.0
# llama.cpp's RPC server takes one client at a time; a few heads (old epochs draining) at once.
MAX_STREAMS: Final = 64
# How often the server asks again whether each stream's stage is still this node's to serve:
# a link must not outlive its epoch (the group was placed again) or the node's lease.
RECHECK_S: Final = 2.0
_RETRY_S: Final = 1.0

_log = structlog.get_logger("gpumesh.stage_link")


@dataclass(frozen=True, slots=True)
class StageTarget:
    """One worker stage, as the head's agent reaches it."""

    node_id: str  # the worker's node
    replica_id: str
    epoch: int
    rank: int


@dataclass(slots=True)
class _Failure:
    reason: ErrorReason
    detail: str
    tell_peer: bool  # ours: the peer must hear an ERROR; theirs: it already knows


class _Pipe:
    """One stream: a local socket on one side, frames on the bus on the other.

    `receive` takes the peer's frames as they arrive (synchronously, from the subscription's
    handler); `run` pumps both ways until both sides have closed or the stream fails. Either
    end uses it: the head's agent with the socket the head engine opened, the worker's with the
    one it opened to its engine."""

    def __init__(
        self,
        bus: Bus,
        out_subject: str,
        *,
        recv_window: int,
        send_window: int,
        chunk: int,
        stall_timeout_s: float,
        label: str,
        expect_accept: bool,
    ) -> None:
        self.bus = bus
        self.out_subject = out_subject
        self.label = label
        self.recv_window = recv_window
        self.send_window = send_window  # 0 until the peer states it (the head: in ACCEPT)
        self.chunk = chunk
        self.stall_timeout_s = stall_timeout_s
        self.out_seq = 0
        self.in_seq = 0
        self.sent = 0  # DATA bytes sent
        self.credited = 0  # of which the peer has written to its socket
        self.received = 0  # DATA bytes received
        self.consumed = 0  # of which written to our socket
        self.reported = 0  # the `consumed` last sent in a CREDIT
        self.peer_closed = False
        self.failure: _Failure | None = None
        self._credit = asyncio.Event()
        self._inbound: deque[bytes | None] = deque()  # None: the peer's CLOSE
        self._inbound_ready = asyncio.Event()
        self._pumps: list[asyncio.Task[None]] = []
        self._lock = asyncio.Lock()  # one frame at a time: seq order is publish order
        # The head's: resolved by the worker's first frame (ACCEPT, or an ERROR).
        self.accepted: asyncio.Future[None] | None = (
            asyncio.get_running_loop().create_future() if expect_accept else None
        )

    # The peer's frames.

    def receive(self, frame: Frame) -> None:
        if self.failure is not None:
            return
        meta = frame.meta
        if frame.kind == frames.ERROR and isinstance(meta, StageError):
            # Whatever its number: the peer says the stream is over, and why.
            self.end(meta.reason, meta.detail, tell_peer=False)
            return
        if frame.seq != self.in_seq:
            self.fail(
                "gap", f"{frame.kind_name} frame {frame.seq} came where {self.in_seq} was due"
            )
            return
        self.in_seq += 1
        if frame.kind == frames.DATA:
            if self.peer_closed:
                self.fail("bad_request", "DATA after the peer's CLOSE")
                return
            self.received += len(frame.payload)
            if self.received - self.consumed > self.recv_window:
                self.fail(
                    "overrun",
                    f"{self.received - self.consumed} bytes unwritten, over the window of "
                    f"{self.recv_window}",
                )
                return
            if frame.payload:
                self._inbound.append(frame.payload)
                self._inbound_ready.set()
        elif frame.kind == frames.CREDIT and isinstance(meta, StageCredit):
            if meta.consumed > self.sent:
                self.fail("bad_request", f"CREDIT for {meta.consumed} bytes, {self.sent} sent")
            elif meta.consumed > self.credited:
                self.credited = meta.consumed
                self._credit.set()
        elif frame.kind == frames.CLOSE:
            self.peer_closed = True
            self._inbound.append(None)
            self._inbound_ready.set()
        elif (
            frame.kind == frames.ACCEPT
            and isinstance(meta, StageAccept)
            and self.accepted is not None
            and not self.accepted.done()
        ):
            if meta.window < 1:
                self.fail("bad_request", f"ACCEPT with a window of {meta.window} bytes")
                return
            self.send_window = meta.window
            self.accepted.set_result(None)
        else:
            self.fail("bad_request", f"unexpected {frame.kind_name} frame")

    def fail(self, reason: ErrorReason, detail: str) -> None:
        """End the stream for a cause on this side: the peer gets an ERROR."""
        self.end(reason, detail, tell_peer=True)

    def end(self, reason: ErrorReason, detail: str, *, tell_peer: bool) -> None:
        if self.failure is not None:
            return
        self.failure = _Failure(reason, " ".join(detail.split()), tell_peer)
        for task in self._pumps:
            task.cancel()  # run() then sends the ERROR and resets the socket
        if self.accepted is not None and not self.accepted.done():
            self.accepted.set_result(None)

    # Sending.

    async def send(
        self, kind: int, payload: bytes = b"", meta: frames.Meta | None = None, reply: str = ""
    ) -> None:
        async with self._lock:
            seq = self.out_seq
            self.out_seq += 1
            if kind == frames.DATA:
                frame = frames.encode_data(seq, payload)
            else:
                frame = frames.encode(kind, seq=seq, meta=meta, payload=payload)
            await self.bus.publish(self.out_subject, frame, reply=reply)

    async def tell_failure(self) -> None:
        """The ERROR for our own failure, if any (best effort: the bus may be what failed)."""
        failure = self.failure
        if failure is None or not failure.tell_peer:
            return
        failure.tell_peer = False
        try:
            await self.send(
                frames.ERROR, meta=StageError(reason=failure.reason, detail=failure.detail)
            )
        except BusError:
            pass  # the peer sees a gap, or its own timeout

    # Pumping.

    async def run(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        opening: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """`opening()` (the handshake: it fails the pipe rather than raise), then pump until
        both sides have closed or the stream fails; then close the socket (reset it on a
        failure) and tell the peer why, if it does not know."""
        try:
            if opening is not None:
                await opening()
            if self.failure is None:
                async with asyncio.TaskGroup() as group:
                    self._pumps = [
                        group.create_task(self._outbound(reader), name=f"{self.label} out"),
                        group.create_task(self._inbound_pump(writer), name=f"{self.label} in"),
                    ]
        except asyncio.CancelledError:
            self.fail("cancelled", "the agent is stopping or the stage was taken down")
            raise
        except BaseExceptionGroup as group_error:
            # A pump's bug costs this stream, not the agent.
            _log.error("stage_link_pump_crashed", stream=self.label, error=repr(group_error))
            self.fail("internal", f"agent error: {group_error.exceptions[0]!r}")
        finally:
            self._pumps = []
            if self.failure is not None:
                reset(writer)
                await self.tell_failure()
            else:
                writer.close()
                with contextlib.suppress(OSError, TimeoutError):
                    async with asyncio.timeout(1.0):
                        await writer.wait_closed()

    async def _outbound(self, reader: asyncio.StreamReader) -> None:
        """Local socket -> peer. Reads only what the window has room for, so a slow peer holds
        back the local writer through TCP."""
        try:
            while True:
                room = await self._room()
                if not room:
                    return
                data = await reader.read(min(self.chunk, room))
                if not data:
                    await self.send(frames.CLOSE)
                    return
                self.sent += len(data)
                await self.send(frames.DATA, data)
        except OSError as exc:
            self.fail("reset", f"reading the local socket: {describe(exc)}")
        except BusError as exc:
            self.fail("reset", f"publishing: {describe(exc)}")

    async def _room(self) -> int:
        """Bytes we may send now; 0 once the peer has left the window full for the stall
        timeout (the stream has then failed)."""
        while True:
            room = self.send_window - (self.sent - self.credited)
            if room > 0:
                return room
            self._credit.clear()
            try:
                async with asyncio.timeout(self.stall_timeout_s):
                    await self._credit.wait()
            except TimeoutError:
                self.fail(
                    "stalled",
                    f"no CREDIT for {self.stall_timeout_s:g} s with "
                    f"{self.sent - self.credited} bytes unacknowledged",
                )
                return 0

    async def _inbound_pump(self, writer: asyncio.StreamWriter) -> None:
        """Peer -> local socket: whatever has arrived, written at once, then one drain; CREDIT
        whenever a quarter of our window has been written since the last one, so the peer
        never waits on a full window that we have in fact emptied."""
        inbound = self._inbound
        every = max(1, self.recv_window // 4)
        try:
            while True:
                while not inbound:
                    self._inbound_ready.clear()
                    await self._inbound_ready.wait()
                written = 0
                while inbound and inbound[0] is not None:
                    chunk = inbound.popleft()
                    assert chunk is not None
                    writer.write(chunk)
                    written += len(chunk)
                if written:
                    await writer.drain()
                    self.consumed += written
                    if self.consumed - self.reported >= every:
                        self.reported = self.consumed
                        await self.send(frames.CREDIT, meta=StageCredit(consumed=self.consumed))
                if inbound and inbound[0] is None:
                    # The peer's half-close: ours to our socket, which may still send.
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
        except OSError as exc:
            self.fail("reset", f"writing the local socket: {describe(exc)}")
        except BusError as exc:
            self.fail("reset", f"publishing: {describe(exc)}")


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with RST: the engine must see the stream break, never an orderly end of file
    that could pass for the end of what the peer sent."""
    from .tcp_reset import reset as reset_transport  # sockets: real ones only, never the sim's

    reset_transport(writer.transport)


def describe(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


async def _subscribe(
    bus: Bus, subject: str, handler: Callable[[Msg], None], log: Any
) -> Subscription:
    while True:
        try:
            return await bus.subscribe(subject, handler=handler)
        except BusError as exc:
            log.warning("stage_link_subscribe_failed", subject=subject, error=str(exc))
            await asyncio.sleep(_RETRY_S)


# The worker's end.


@dataclass(slots=True)
class _Served:
    pipe: _Pipe
    open: StageOpen
    head: str


class StageLinkServer:
    """Carries streams from heads to this node's worker stages, on `stagelink(node_id)`, until
    cancelled. An OPEN is checked, in this order, against `fence`, `admit` (the opening node)
    and `resolve` (the stage and its local address); any no is an ERROR in one line. `run()`
    owns a task per stream, in a TaskGroup: cancelling it ends every stream (each peer told,
    each socket reset)."""

    def __init__(
        self,
        bus: Bus,
        node_id: str,
        resolve: Resolve,
        *,
        fence: Fence | None = None,
        admit: Admit | None = None,
        window: int = DEFAULT_WINDOW,
        chunk: int = MAX_CHUNK,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        max_streams: int = MAX_STREAMS,
        recheck_s: float = RECHECK_S,
        log: Any = None,
    ) -> None:
        if not 1 <= chunk <= MAX_CHUNK or window < 1:
            raise ValueError(f"chunk must be 1..{MAX_CHUNK} and window positive")
        self.node_id = node_id
        self.subject = f"{frames.stagelink(node_id)}.stage.*.*"
        self._bus = bus
        self._resolve = resolve
        self._fence = fence
        self._admit = admit
        self._window = window
        self._chunk = chunk
        self._stall_timeout_s = stall_timeout_s
        self._connect_timeout_s = connect_timeout_s
        self._max_streams = max_streams
        self._recheck_s = recheck_s
        self._log: Any = (log if log is not None else _log).bind(component="stage_link_server")
        self._streams: dict[tuple[str, str], _Served] = {}
        # Set when a stream opens: the recheck sleeps on it while there is none, so that an
        # agent without pipelines (most, and every simulated one) has no timer running.
        self._first_stream = asyncio.Event()
        # Refusals, answered by one task (the subscription's handler cannot await).
        self._replies: asyncio.Queue[tuple[str, bytes]] = asyncio.Queue()
        self._group: asyncio.TaskGroup | None = None
        self.subscribed = asyncio.Event()
        # Counters, for tests and status.
        self.streams = 0  # accepted
        self.garbage = 0
        self.errors: dict[str, int] = {}

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def run(self) -> None:
        subscription = await _subscribe(self._bus, self.subject, self._on_msg, self._log)
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self._send_replies(), name="stage link replies")
                group.create_task(self._recheck(), name="stage link recheck")
                self.subscribed.set()
                await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self._group = None
            self.subscribed.clear()
            with contextlib.suppress(BusError):
                await subscription.unsubscribe()

    def _on_msg(self, msg: Msg) -> None:
        who = frames.stream_of(msg.subject)
        if who is None:
            self._count_garbage(f"not a stage link subject: {msg.subject}")
            return
        head, stream_id = who
        served = self._streams.get(who)
        try:
            frame = frames.decode(msg.data)
        except FrameError as exc:
            if served is not None:
                served.pipe.fail("bad_request", str(exc))
            else:
                self._refuse(head, stream_id, "bad_request", str(exc))
            return
        if served is not None:
            served.pipe.receive(frame)
        elif frame.kind == frames.OPEN and isinstance(frame.meta, StageOpen):
            self._open(head, stream_id, frame.meta)
        elif frame.kind == frames.DATA:
            # A stream we do not carry (this agent restarted, or ended it): the head must not
            # wait on it.
            self._refuse(head, stream_id, "bad_request", f"no stream {stream_id} on this agent")
        # A late CREDIT, CLOSE or ERROR of a stream that is over: nothing to say.

    def _open(self, head: str, stream_id: str, request: StageOpen) -> None:
        stage = f"stage {request.rank} of replica {request.replica_id} at epoch {request.epoch}"
        if len(self._streams) >= self._max_streams:
            self._refuse(head, stream_id, "overloaded", f"{self._max_streams} streams carried")
            return
        if request.window < 1:
            self._refuse(head, stream_id, "bad_request", f"window of {request.window} bytes")
            return
        fenced = self._fence(request.replica_id, request.epoch) if self._fence else ""
        if fenced:
            self._refuse(head, stream_id, "fenced", f"{stage}: {fenced}")
            return
        refused = self._admit(head, request.replica_id, request.epoch) if self._admit else ""
        if refused:
            self._refuse(head, stream_id, "forbidden", f"{stage} from node {head}: {refused}")
            return
        address = self._resolve(request.replica_id, request.epoch, request.rank)
        if address is None:
            self._refuse(
                head, stream_id, "unknown_stage", f"node {self.node_id} does not run {stage}"
            )
            return
        group = self._group
        if group is None:
            self._refuse(head, stream_id, "cancelled", "the agent is stopping")
            return
        pipe = _Pipe(
            self._bus,
            frames.stagelink_to_head(head, self.node_id, stream_id),
            recv_window=self._window,
            send_window=request.window,
            chunk=self._chunk,
            stall_timeout_s=self._stall_timeout_s,
            label=f"stage link {head}/{stream_id}",
            expect_accept=False,
        )
        pipe.in_seq = 1  # the OPEN was the head's frame 0
        key = (head, stream_id)
        try:
            group.create_task(self._serve(key, pipe, address), name=pipe.label)
        except RuntimeError:  # the group is shutting down: run() is being cancelled
            self._refuse(head, stream_id, "cancelled", "the agent is stopping")
            return
        self._streams[key] = _Served(pipe, request, head)
        self._first_stream.set()
        self.streams += 1

    async def _serve(self, key: tuple[str, str], pipe: _Pipe, address: tuple[str, int]) -> None:
        host, port = address
        try:
            try:
                async with asyncio.timeout(self._connect_timeout_s):
                    reader, writer = await asyncio.open_connection(host, port, limit=self._chunk)
            except (OSError, TimeoutError) as exc:
                why = describe(exc) if isinstance(exc, OSError) else "timed out"
                pipe.fail("connect_error", f"cannot reach the stage at {host}:{port}: {why}")
                await pipe.tell_failure()
                return
            except asyncio.CancelledError:
                pipe.fail("cancelled", "the agent is stopping")
                await pipe.tell_failure()
                raise

            async def accept() -> None:
                if pipe.failure is None:  # the head may have given up meanwhile
                    try:
                        await pipe.send(frames.ACCEPT, meta=StageAccept(window=self._window))
                    except BusError as exc:
                        pipe.fail("reset", f"publishing: {describe(exc)}")

            await pipe.run(reader, writer, accept)
        finally:
            self._streams.pop(key, None)
            if pipe.failure is not None:
                self._count(pipe.failure.reason, pipe.label, pipe.failure.detail)

    def _refuse(self, head: str, stream_id: str, reason: ErrorReason, detail: str) -> None:
        self._count(reason, f"stage link {head}/{stream_id}", detail)
        self._replies.put_nowait(
            (
                frames.stagelink_to_head(head, self.node_id, stream_id),
                frames.encode_error(0, reason, detail),
            )
        )

    def _count(self, reason: str, label: str, detail: str) -> None:
        self.errors[reason] = self.errors.get(reason, 0) + 1
        if reason != "cancelled":
            self._log.info("stage_link_ended", stream=label, why=reason, detail=detail)

    def _count_garbage(self, why: str) -> None:
        self.garbage += 1
        if self.garbage == 1 or self.garbage % 1000 == 0:
            self._log.warning("stage_link_garbage", error=why, count=self.garbage)

    async def _send_replies(self) -> None:
        while True:
            subject, frame = await self._replies.get()
            try:
                await self._bus.publish(subject, frame)
            except BusError as exc:
                self._log.warning("stage_link_publish_failed", error=str(exc))

    async def _recheck(self) -> None:
        while True:
            if not self._streams:
                self._first_stream.clear()
                await self._first_stream.wait()
            await asyncio.sleep(self._recheck_s)
            for served in list(self._streams.values()):
                request = served.open
                fenced = self._fence(request.replica_id, request.epoch) if self._fence else ""
                if fenced:
                    served.pipe.fail("fenced", fenced)
                elif self._resolve(request.replica_id, request.epoch, request.rank) is None:
                    served.pipe.fail(
                        "unknown_stage",
                        f"node {self.node_id} no longer runs stage {request.rank} of replica "
                        f"{request.replica_id} at epoch {request.epoch}",
                    )


# The head's end.


@dataclass(slots=True)
class _Forward:
    target: StageTarget
    address: tuple[str, int]
    server: asyncio.Server | None = None
    connections: set[asyncio.Task[None]] = field(default_factory=set)


class StageLinkClient:
    """The head's agent's end: local listeners (`forward`), each connection to one carried to
    its worker's agent. `run()` must be running for `forward`; it owns every stream in a
    TaskGroup, and cancelling it closes every listener and stream.

    `new_stream_id` must not repeat across restarts of this agent (the agent passes
    `env.new_id`, a UUIDv7): a worker may still hold a stream of our previous life."""

    def __init__(
        self,
        bus: Bus,
        node_id: str,
        *,
        window: int = DEFAULT_WINDOW,
        chunk: int = MAX_CHUNK,
        stall_timeout_s: float = STALL_TIMEOUT_S,
        open_timeout_s: float = OPEN_TIMEOUT_S,
        new_stream_id: Callable[[], str] | None = None,
        log: Any = None,
    ) -> None:
        if not 1 <= chunk <= MAX_CHUNK or window < 1:
            raise ValueError(f"chunk must be 1..{MAX_CHUNK} and window positive")
        self.node_id = node_id
        self.subject = f"{frames.stagelink(node_id)}.head.*.*"
        self._bus = bus
        self._window = window
        self._chunk = chunk
        self._stall_timeout_s = stall_timeout_s
        self._open_timeout_s = open_timeout_s
        self._new_stream_id = new_stream_id
        self._counter = itertools.count(1)
        self._prefix = ""
        self._log: Any = (log if log is not None else _log).bind(component="stage_link_client")
        self._pipes: dict[tuple[str, str], _Pipe] = {}
        self._forwards: dict[tuple[str, int], _Forward] = {}
        self._group: asyncio.TaskGroup | None = None
        self.ready = asyncio.Event()  # subscribed: `forward` may be called
        # Counters, for tests and status.
        self.streams = 0
        self.strays = 0  # frames for no stream of ours (late ones, after a stream ended)
        self.errors: dict[str, int] = {}
        self.last_error = ""  # reason: detail, of the last stream that failed

    @property
    def in_flight(self) -> int:
        return len(self._pipes)

    def forwards(self) -> dict[tuple[str, int], StageTarget]:
        return {address: fwd.target for address, fwd in self._forwards.items()}

    async def run(self) -> None:
        # Without an injected id source: the loop's clock at start (microseconds since boot on
        # a real loop) and a counter, unique across this agent's restarts on one machine.
        self._prefix = f"{int(asyncio.get_running_loop().time() * 1e6):x}"
        subscription = await _subscribe(self._bus, self.subject, self._on_msg, self._log)
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                self.ready.set()
                await asyncio.get_running_loop().create_future()  # until cancelled
        finally:
            self._group = None
            self.ready.clear()
            forwards = list(self._forwards.values())
            self._forwards.clear()
            for fwd in forwards:
                if fwd.server is not None:
                    fwd.server.close()
            with contextlib.suppress(BusError):
                await subscription.unsubscribe()

    async def forward(
        self, target: StageTarget, *, host: str = "127.0.0.1", port: int = 0
    ) -> tuple[str, int]:
        """Listen on host:port (0: a free port) for `target`; return the address listened on,
        what goes into the head's command in place of the worker's."""
        if self._group is None:
            raise RuntimeError("StageLinkClient.run() is not running")
        fwd = _Forward(target, (host, port))

        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            # A plain function, not a coroutine: asyncio would run a coroutine in a task of
            # its own, which nobody would own; this one belongs to run()'s TaskGroup.
            group = self._group
            if group is None or fwd.server is None or not fwd.server.is_serving():
                reset(writer)
                return
            task = group.create_task(
                self._connection(target, reader, writer), name=f"stage link {target.node_id}"
            )
            fwd.connections.add(task)
            task.add_done_callback(fwd.connections.discard)

        fwd.server = await asyncio.start_server(
            accepted, host, port, limit=self._chunk, reuse_address=True
        )
        bound = fwd.server.sockets[0].getsockname()
        fwd.address = (bound[0], bound[1])
        self._forwards[fwd.address] = fwd
        self._log.info(
            "stage_link_forward",
            address=f"{fwd.address[0]}:{fwd.address[1]}",
            to=target.node_id,
            replica=target.replica_id,
            epoch=target.epoch,
            rank=target.rank,
        )
        return fwd.address

    async def unforward(self, address: tuple[str, int]) -> None:
        """Stop listening on `address` and end its streams (the head stopped)."""
        fwd = self._forwards.pop(address, None)
        if fwd is None or fwd.server is None:
            return
        fwd.server.close()
        tasks = list(fwd.connections)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _stream_id(self) -> str:
        if self._new_stream_id is not None:
            return self._new_stream_id()
        return f"{self._prefix}-{next(self._counter)}"

    async def _connection(
        self, target: StageTarget, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        stream_id = self._stream_id()
        key = (target.node_id, stream_id)
        pipe = _Pipe(
            self._bus,
            frames.stagelink_to_stage(target.node_id, self.node_id, stream_id),
            recv_window=self._window,
            send_window=0,
            chunk=self._chunk,
            stall_timeout_s=self._stall_timeout_s,
            label=f"stage link {target.node_id}/{stream_id}",
            expect_accept=True,
        )
        self._pipes[key] = pipe
        self.streams += 1
        request = StageOpen(
            replica_id=target.replica_id, epoch=target.epoch, rank=target.rank, window=self._window
        )
        # The reply subject only asks NATS to say "no responders" at once when no agent
        # listens on the worker's subject; the worker answers on its own subject anyway.
        back = frames.stagelink_to_head(self.node_id, target.node_id, stream_id)

        async def open_stream() -> None:
            try:
                await pipe.send(frames.OPEN, meta=request, reply=back)
                assert pipe.accepted is not None
                async with asyncio.timeout(self._open_timeout_s):
                    await pipe.accepted
            except TimeoutError:
                pipe.fail(
                    "open_timeout",
                    f"no answer from node {target.node_id} within {self._open_timeout_s:g} s",
                )
            except BusError as exc:
                pipe.fail("reset", f"publishing: {describe(exc)}")

        try:
            await pipe.run(reader, writer, open_stream)
        finally:
            self._pipes.pop(key, None)
            failure = pipe.failure
            if failure is not None:
                self.errors[failure.reason] = self.errors.get(failure.reason, 0) + 1
                self.last_error = f"{failure.reason}: {failure.detail}"
                if failure.reason != "cancelled":
                    self._log.info(
                        "stage_link_ended",
                        stream=pipe.label,
                        why=failure.reason,
                        detail=failure.detail,
                    )

    def _on_msg(self, msg: Msg) -> None:
        who = frames.stream_of(msg.subject)
        pipe = self._pipes.get(who) if who is not None else None
        if pipe is None or who is None:
            self.strays += 1
            return
        if is_no_responders(msg):
            pipe.end(
                "unreachable", f"no agent listens for stage links on node {who[0]}", tell_peer=False
            )
            return
        try:
            frame = frames.decode(msg.data)
        except FrameError as exc:
            pipe.fail("bad_request", str(exc))
            return
        pipe.receive(frame)
