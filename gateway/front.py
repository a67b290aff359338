"""The gateway's front door: client connections served on asyncio protocols.

Every connection starts here. An ordinary inference request (an OpenAI route or /c/<cluster>/,
a Content-Length body or none; see wire/http1.py for exactly what is taken) is parsed here
and given straight to the proxy, with no per-request objects beyond the proxy's own: aiohttp's
server, its router and its middleware were a third of the gateway's CPU per request.

Anything else (the control API, /metrics, /v1/models, a chunked body, a malformed request) is
handed to aiohttp's server, connection and unread bytes together, before a byte of it is
answered here: it is served exactly as before, by aiohttp's complete parser and the gateway's
aiohttp application (gateway/app.py). A connection handed over stays with aiohttp.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from wire.http1 import (
    LAST_CHUNK,
    MAX_HEAD_BYTES,
    RequestHead,
    could_be_request,
    encode_chunk,
    parse_request_head,
)

from .proxy import OPENAI_PATHS, Proxy, send_error, split_passthrough
from .reply import FlowControlled, Headers

_OPENAI_PATHS = frozenset(OPENAI_PATHS)
# HEAD and the rest go to aiohttp: an answer without a body is its business.
_PASSTHROUGH_METHODS = frozenset({"GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Requests a client sends ahead of its answer (pipelining) are held up to this; then reading
# pauses until the one in progress is answered.
_PIPELINE_LIMIT = 256 * 1024
_NO_BODY_STATUSES = frozenset({204, 304})


def _status_line(status: int) -> bytes:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n".encode("ascii")


_STATUS_LINES: dict[int, bytes] = {s.value: _status_line(s.value) for s in HTTPStatus}


class FrontInbound:
    """A request parsed by the front, as the proxy reads it."""

    __slots__ = ("_head", "_lower", "method")

    def __init__(self, head: RequestHead) -> None:
        self._head = head
        self.method = head.method
        self._lower: dict[str, str] | None = None

    def header(self, lower_name: str) -> str | None:
        lower = self._lower
        if lower is None:
            lower = {}
            for name, value in self._head.headers:
                lower.setdefault(name.lower(), value)  # the first one, as aiohttp's get()
            self._lower = lower
        return lower.get(lower_name)

    def header_items(self) -> Headers:
        return self._head.headers


class Front:
    """The protocol factory for the gateway's listening socket (`loop.create_server(front)`)."""

    def __init__(
        self,
        proxy: Proxy,
        handoff: Callable[[], asyncio.Protocol],
        *,
        max_body_bytes: int,
        header_timeout_s: float,
        request_body_timeout_s: float,
        log: Any,
    ) -> None:
        self.proxy = proxy
        self.handoff = handoff
        self.max_body_bytes = max_body_bytes
        self.header_timeout_s = header_timeout_s
        self.request_body_timeout_s = request_body_timeout_s
        self.log = log
        self.connections: set[FrontConnection] = set()
        self.stopping = False
        self._all_idle = asyncio.Event()
        self._all_idle.set()

    def __call__(self) -> FrontConnection:
        return FrontConnection(self)

    def _changed(self) -> None:
        if self.stopping and not any(conn.task is not None for conn in self.connections):
            self._all_idle.set()

    async def shutdown(self, timeout: float) -> None:
        """Close idle connections now, the others once their answer is out (the proxy's own
        cut_in_flight() ends those still running when the grace is over); then wait for them,
        at most `timeout`."""
        self.stopping = True
        self._all_idle.clear()
        for conn in list(self.connections):
            conn.close_when_idle()
        self._changed()
        try:
            async with asyncio.timeout(timeout):
                await self._all_idle.wait()
        except TimeoutError:
            pass
        for conn in list(self.connections):
            conn.abort()


class FrontConnection(asyncio.Protocol):
    """One client connection: requests one at a time, answered in order."""

    def __init__(self, front: Front) -> None:
        self._front = front
        self._loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.task: asyncio.Task[None] | None = None
        self._buf = b""
        self._head: RequestHead | None = None  # parsed, waiting for its body
        self._parts: list[bytes] = []  # that body so far
        self._have = 0
        self._route: tuple[bool, str, str] = (True, "", "")  # openai?, cluster, target
        self._keep_alive = True
        self._closing = False  # close once the answer in progress is out
        self._reading_paused = False
        self._drain: asyncio.Future[None] | None = None
        self._writing_paused = False
        self._answer_started = False
        self._answer_done = False
        self._deadline = 0.0  # when the wait for a head (or a body) ends
        self._timer: asyncio.TimerHandle | None = None
        self._relay_source: FlowControlled | None = None

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self._front.connections.add(self)
        if self._front.stopping:
            transport.close()
            return
        self._wait_for_head()

    def data_received(self, data: bytes) -> None:
        if self.task is None and self._head is not None:
            # A body arriving in pieces: kept as a list and joined once (adding each piece to
            # one bytes object would copy a 16 MiB body hundreds of times).
            self._parts.append(data)
            self._have += len(data)
            if self._have >= self._head.content_length:
                self._buf = b"".join(self._parts)
                self._parts.clear()
                self._advance()
            return
        self._buf = self._buf + data if self._buf else data
        if self.task is None:
            self._advance()
        elif len(self._buf) > _PIPELINE_LIMIT and not self._reading_paused:
            self._reading_paused = True
            assert self.transport is not None
            self.transport.pause_reading()

    def eof_received(self) -> bool | None:
        # A client that half-closes after its request still gets its answer; then the
        # connection closes (nothing more can come).
        self._closing = True
        return True if self.task is not None else None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._front.connections.discard(self)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.task is not None:
            self.task.cancel()  # the client went away: stop its upstream request too
        self._wake_writer()
        self._front._changed()

    def pause_writing(self) -> None:
        self._writing_paused = True
        if self._relay_source is not None:
            self._relay_source.pause()

    def resume_writing(self) -> None:
        self._writing_paused = False
        if self._relay_source is not None:
            self._relay_source.resume()
        self._wake_writer()

    # -- reading requests ----------------------------------------------------------------

    def _advance(self) -> None:
        """Parse what has arrived; start the request once its body is whole."""
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        head = self._head
        buf = self._buf
        if head is None:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES or not could_be_request(buf):
                    # Not HTTP this front serves (TLS to a plain port, garbage): aiohttp answers
                    # it now, rather than the head timeout later.
                    self._hand_off()
                return
            head = parse_request_head(buf[:end])
            route = _route(head) if head is not None else None
            if head is None or route is None or head.content_length > self._front.max_body_bytes:
                # aiohttp answers it, from its first byte: an error in its shape, a 413, or a
                # route the front does not serve.
                self._hand_off()
                return
            buf = self._buf = buf[end + 4 :]
            self._head, self._route = head, route
            self._keep_alive = head.keep_alive
            if len(buf) < head.content_length:
                self._parts = [buf] if buf else []
                self._have = len(buf)
                self._buf = b""
                self._deadline = self._loop.time() + self._front.request_body_timeout_s
                self._arm()
                return
        length = head.content_length
        if len(buf) < length:
            return
        body = buf[:length]
        self._buf = buf[length:]
        self._head = None
        self._answer_started = self._answer_done = False
        self.task = self._loop.create_task(self._serve(head, body))

    def _hand_off(self) -> None:
        transport = self.transport
        assert transport is not None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._front.connections.discard(self)
        self.transport = None
        protocol = self._front.handoff()
        transport.set_protocol(protocol)
        protocol.connection_made(transport)
        if self._buf:
            data, self._buf = self._buf, b""
            protocol.data_received(data)

    async def _serve(self, head: RequestHead, body: bytes) -> None:
        proxy = self._front.proxy
        inbound = FrontInbound(head)
        openai, cluster, target = self._route
        try:
            with proxy.in_flight_here():
                tenant = proxy.admit(inbound, self)
                if tenant is None:
                    pass
                elif openai:
                    await proxy.serve_openai(inbound, self, tenant, target, body)
                else:
                    await proxy.serve_passthrough(inbound, self, tenant, cluster, target, body)
        except asyncio.CancelledError:
            self.abort()  # the client went away, or the gateway's grace ended mid-answer
            raise
        except Exception:
            self._front.log.exception("request_failed", method=head.method, path=head.target)
            if self._answer_started:
                self.abort()
            else:
                self._keep_alive = False
                send_error(self, 500, "the gateway failed to answer this request", "internal")
        finally:
            self.task = None
            self._request_done()

    def _request_done(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            self._front._changed()
            return
        if not self._answer_done or not self._keep_alive or self._closing:
            transport.close()
            self._front._changed()
            return
        if self._reading_paused:
            self._reading_paused = False
            transport.resume_reading()
        self._front._changed()
        self._wait_for_head()
        if self._buf:
            self._advance()

    # -- the deadline for a head or a body ----------------------------------------------

    def _wait_for_head(self) -> None:
        self._deadline = self._loop.time() + self._front.header_timeout_s
        self._arm()

    def _arm(self) -> None:
        # One timer per connection, moved lazily: a request only sets _deadline, and the timer
        # looks again when it fires (a timer per request cost more than the request's parse).
        if self._timer is None:
            self._timer = self._loop.call_at(self._deadline, self._expired)

    def _expired(self) -> None:
        self._timer = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if self.task is not None:
            return  # answering: the proxy's deadlines hold; the wait starts again after
        if self._loop.time() < self._deadline:
            self._arm()
            return
        if self._head is not None:
            # A head in, its body trickling: say why, then close (the stream is spent).
            self._keep_alive = False
            limit = self._front.request_body_timeout_s
            send_error(
                self,
                408,
                f"the request body did not arrive within {limit:g} s",
                "request_timeout",
            )
        transport.close()  # no whole head in time (or an idle keep-alive connection)

    # -- Sink: the answer ----------------------------------------------------------------

    def _head_bytes(self, status: int, headers: Headers, framing: str) -> list[str]:
        lines = [f"{name}: {value}\r\n" for name, value in headers]
        if framing:
            lines.append(framing)
        if not self._keep_alive or self._closing or self._front.stopping:
            self._keep_alive = False
            lines.append("Connection: close\r\n")
        lines.append("\r\n")
        return lines

    def send(self, status: int, headers: Headers, body: bytes) -> None:
        transport = self.transport
        self._answer_started = self._answer_done = True
        if transport is None or transport.is_closing():
            return
        if status in _NO_BODY_STATUSES or status < 200:
            framing, body = "", b""
        else:
            framing = f"Content-Length: {len(body)}\r\n"
        lines = self._head_bytes(status, headers, framing)
        status_line = _STATUS_LINES.get(status) or _status_line(status)
        transport.write(status_line + "".join(lines).encode("utf-8", "surrogateescape") + body)

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        transport = self.transport
        self._answer_started = True
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client has gone")
        lines = self._head_bytes(status, headers, "Transfer-Encoding: chunked\r\n")
        status_line = _STATUS_LINES.get(status) or _status_line(status)
        head = status_line + "".join(lines).encode("utf-8", "surrogateescape")
        transport.write(head + encode_chunk(first) if first else head)

    async def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client has gone")
        if data:
            transport.write(encode_chunk(data))
        if self._writing_paused:
            # The client reads slower than the replica writes: wait, so the replica's side
            # pauses too (wire/http_client.py) instead of our memory growing.
            self._drain = self._loop.create_future()
            try:
                await self._drain
            finally:
                self._drain = None
            if self.transport is None or self.transport.is_closing():
                raise ConnectionResetError("the client has gone")

    def relay_writer(self, source: FlowControlled) -> Callable[[bytes], None]:
        self._relay_source = source
        if self._writing_paused:
            source.pause()
        return self._write_now

    def relay_done(self) -> None:
        self._relay_source = None

    def _write_now(self, data: bytes) -> None:
        # Called from the replica connection's read callback: never raises. A client that has
        # gone is noticed by connection_lost(), which cancels the request.
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(encode_chunk(data))

    async def end(self) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        transport.write(LAST_CHUNK)
        self._answer_done = True

    def abort(self) -> None:
        self._keep_alive = False
        if self.transport is not None:
            self.transport.abort()

    def client_gone(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def close_when_idle(self) -> None:
        self._closing = True
        if self.task is None and self.transport is not None:
            self.transport.close()

    def _wake_writer(self) -> None:
        drain = self._drain
        if drain is not None and not drain.done():
            drain.set_result(None)


def _route(head: RequestHead) -> tuple[bool, str, str] | None:
    """(openai?, cluster, target) for a request the front serves; None for aiohttp's."""
    target = head.target
    path = target.partition("?")[0]
    if "/." in path or "//" in path:
        return None  # dot segments, empty segments: aiohttp's normalisation decides
    if path in _OPENAI_PATHS:
        return (True, "", target) if head.method == "POST" else None
    if path.startswith("/c/") and head.method in _PASSTHROUGH_METHODS:
        cluster, tail = split_passthrough(target)
        if not cluster or "%" in cluster:
            return None  # an encoded cluster name: aiohttp decodes it
        return False, cluster, tail
    return None
