"""A lean HTTP/1.1 client to workloads: keep-alive connections on asyncio protocols.

Used by the gateway's direct transport (gateway/transport/direct.py) and by the node agent's
end of the overlay (nodeagent/tunnel.py): both relay requests to OpenAI-compatible workloads.

Why not aiohttp's client: it was a quarter of the gateway's CPU per proxied request (request
and response objects, tracing hooks, a cookie jar, a read timeout rescheduled on every read,
a StreamReader; docs/performance.md, Gateway). The gateway needs one request at a time on a
pooled connection, the response head, and the body relayed with back-pressure. A response
whose head and body arrive in one read (most non-streaming answers) costs one wake-up of the
waiting request and no timer at all.
"""

from __future__ import annotations

import asyncio
import collections
import re
import ssl
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import quote, urlsplit

from .errors import WireError
from .http1 import (
    CHUNKED,
    LENGTH,
    NO_BODY,
    UNTIL_CLOSE,
    ChunkedDecoder,
    HttpError,
    ResponseHead,
    parse_response_head,
)

_MAX_HEAD = 64 * 1024
# A body buffered this far ahead of its reader stops reading from the replica (TCP then holds
# it back) until the reader is below the low mark: a slow client cannot grow our memory.
_HIGH_WATER = 1024 * 1024
_LOW_WATER = 256 * 1024


# Methods whose request carries a body by definition: they say Content-Length even when empty.
_BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
# A request target that may go on the request line as it is; anything else is percent-encoded.
_PLAIN_TARGET = re.compile(r"/[\x21-\x7e]*")


_TOKEN = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
_FIELD_VALUE = re.compile(r"[^\x00-\x08\x0a-\x1f\x7f]*")


def check_request(method: str, headers: Sequence[tuple[str, str]]) -> None:
    """ValueError for a method or header that could not stand in a request as it is (a CR or
    LF would smuggle a second request): for requests that come from elsewhere, not parsed
    here."""
    if not _TOKEN.fullmatch(method):
        raise ValueError(f"not a method: {method[:40]!r}")
    for name, value in headers:
        if not _TOKEN.fullmatch(name) or not _FIELD_VALUE.fullmatch(value):
            raise ValueError(f"not a valid header: {name[:40]!r}")


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a workload listens: host and port, the Host header, and a path prefix (a node's
    front serves each replica under one)."""

    host: str
    port: int
    authority: str
    prefix: str


_ORIGINS: dict[str, Origin] = {}


def origin(url: str) -> Origin:
    """The origin of an `http://host:port[/prefix]` address (ValueError for anything else)."""
    found = _ORIGINS.get(url)
    if found is None:
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"not an http:// address: {url!r}")
        found = Origin(parts.hostname, parts.port or 80, parts.netloc, parts.path.rstrip("/"))
        if len(_ORIGINS) > 10_000:
            _ORIGINS.clear()  # addresses come and go with placements
        _ORIGINS[url] = found
    return found


def encode_request(
    method: str, target: str, where: Origin, headers: Sequence[tuple[str, str]], body: bytes
) -> bytes:
    """A whole request, ready for one write. `headers` must not hold Host, Content-Length or
    Transfer-Encoding: this sets the first two, and the body is never chunked."""
    if not _PLAIN_TARGET.fullmatch(target):
        # Percent-encode what may not stand on a request line, keep what is already encoded.
        target = quote(target, safe="/?&=%:@!$'()*+,;~-._[]#")
    lines = [f"{method} {where.prefix}{target} HTTP/1.1\r\nHost: {where.authority}\r\n"]
    lines.extend(f"{name}: {value}\r\n" for name, value in headers)
    if body or method in _BODY_METHODS:
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    # surrogateescape: header bytes a client sent, decoded that way, go out unchanged.
    data = "".join(lines).encode("utf-8", "surrogateescape")
    return data + body if body else data


class ConnectError(WireError):
    """No connection could be made: the request surely never left. `address` is the
    "host:port" tried ("" when the client was closed before it tried)."""

    def __init__(self, reason: str, *, address: str = "") -> None:
        super().__init__(reason)
        self.address = address


class HeadError(WireError):
    """The connection broke, or spoke garbage, after the request was sent and before its head."""


class HeadTimeout(WireError):
    """No response head by the deadline (`deadline`, in loop time)."""

    def __init__(self, deadline: float) -> None:
        super().__init__("no response head by the deadline")
        self.deadline = deadline


class BodyError(WireError):
    """The body broke off after the head: the connection dropped, went silent, or lied."""


class Response:
    """One response: its head, then its body as the connection delivers it."""

    __slots__ = (
        "_chunks",
        "_conn",
        "_consumer",
        "_done",
        "_error",
        "_head_error",
        "_head_waiter",
        "_idle_timer",
        "_last_data",
        "_paused",
        "_pending",
        "_waiter",
        "head",
    )

    def __init__(self, conn: _Connection) -> None:
        self._conn: _Connection | None = conn
        self.head: ResponseHead | None = None
        self._chunks: collections.deque[bytes] = collections.deque()
        self._pending = 0  # bytes in _chunks
        self._done = False
        self._error: str | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._last_data = 0.0
        self._idle_timer: asyncio.TimerHandle | None = None
        self._consumer: Callable[[bytes], None] | None = None
        # Per exchange, not per connection: a connection goes back to the pool as soon as its
        # body is in, possibly before this response's waiter has even resumed.
        self._head_waiter: asyncio.Future[None] | None = None
        self._head_error: BaseException | None = None

    @property
    def complete(self) -> bool:
        """The whole body is here (nothing more will arrive)."""
        return self._done

    def take_buffered(self) -> bytes:
        """Every body byte that has arrived so far, at once."""
        if not self._chunks:
            return b""
        data = self._chunks[0] if len(self._chunks) == 1 else b"".join(self._chunks)
        self._chunks.clear()
        self._pending = 0
        self._maybe_resume()
        return data

    @property
    def pending(self) -> int:
        """Body bytes that have arrived and not been taken yet."""
        return self._pending

    def take(self, limit: int) -> bytes:
        """Up to `limit` of the body bytes that have arrived, at once."""
        if self._pending <= limit:
            return self.take_buffered()
        parts: list[bytes] = []
        size = 0
        while size < limit:
            chunk = self._chunks.popleft()
            if size + len(chunk) > limit:
                cut = limit - size
                self._chunks.appendleft(chunk[cut:])
                chunk = chunk[:cut]
            parts.append(chunk)
            size += len(chunk)
        self._pending -= size
        self._maybe_resume()
        return b"".join(parts)

    async def readable(self, idle_timeout: float) -> bool:
        """Until some of the body is here (True) or it has ended with nothing left (False);
        BodyError if it breaks or goes silent for `idle_timeout`."""
        while not self._chunks:
            if self._done:
                return False
            await self._wait(idle_timeout)
        return True

    async def next_chunk(self, idle_timeout: float) -> bytes | None:
        """The next piece of the body, None at its end; BodyError if it breaks or no byte
        arrives for `idle_timeout` (a replica that lost power sends no RST, ever)."""
        while not self._chunks:
            if self._done:
                return None
            await self._wait(idle_timeout)
        chunk = self._chunks.popleft()
        self._pending -= len(chunk)
        self._maybe_resume()
        return chunk

    async def relay(self, consumer: Callable[[bytes], None], idle_timeout: float) -> None:
        """Hand every piece of the body to `consumer` as it arrives, in the connection's own
        callback, until the body ends (BodyError if it breaks). A stream's chunks then cost no
        task wake-up each; the consumer applies back-pressure with pause() and resume()."""
        if self._chunks:
            consumer(self.take_buffered())
        self._consumer = consumer
        try:
            while not self._done:
                await self._wait(idle_timeout)
        finally:
            self._consumer = None

    async def _wait(self, idle_timeout: float) -> None:
        """Until the connection delivers something, ends the body or breaks (BodyError)."""
        if self._error is not None:
            raise BodyError(self._error)
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        if self._idle_timer is None:
            self._idle_timer = loop.call_at(
                self._last_data + idle_timeout, self._check_idle, idle_timeout
            )
        try:
            await waiter
        finally:
            self._waiter = None

    def pause(self) -> None:
        """Stop reading from the replica (the consumer cannot keep up)."""
        if not self._paused and self._conn is not None:
            self._paused = True
            self._conn.pause()

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            if self._conn is not None:
                self._conn.resume()

    def close(self) -> None:
        """Done with it. A body not read to its end drops the connection: the replica sees its
        client go away (and can stop generating) instead of writing into a pooled socket."""
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        conn, self._conn = self._conn, None
        if conn is not None and not self._done:
            conn.abort()
        if not self._done and self._error is None:
            self._error = "closed by the gateway"

    # -- called by the connection --------------------------------------------------------

    def _feed(self, data: bytes, now: float) -> None:
        self._last_data = now
        if self._consumer is not None:
            if data:
                self._consumer(data)
            return
        if data:
            self._chunks.append(data)
            self._pending += len(data)
        if self._pending > _HIGH_WATER and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _finish(self) -> None:
        self._done = True
        self._conn = None
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None
        self._wake()

    def _fail(self, reason: str) -> None:
        if self._done or self._error is not None:
            return
        self._error = reason
        self._conn = None
        self._wake()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _maybe_resume(self) -> None:
        if self._paused and self._pending <= _LOW_WATER:
            self._paused = False
            if self._conn is not None:
                self._conn.resume()

    def _check_idle(self, idle_timeout: float) -> None:
        self._idle_timer = None
        if self._done or self._error is not None:
            return
        loop = asyncio.get_running_loop()
        due = self._last_data + idle_timeout
        if self._waiter is None or loop.time() < due:
            # Data came since the timer was set, or nobody waits: look again when due.
            self._idle_timer = loop.call_at(
                max(due, loop.time() + 0.001), self._check_idle, idle_timeout
            )
            return
        conn = self._conn
        self._fail(f"no data from the replica for {idle_timeout:g} s")
        if conn is not None:
            conn.abort()


class _Connection(asyncio.Protocol):
    """One keep-alive connection to one replica; one request on it at a time."""

    def __init__(self, pool: HttpClient, key: tuple[str, int]) -> None:
        self._pool = pool
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.idle_since = 0.0
        self._loop = asyncio.get_running_loop()
        self._buf = b""
        self._response: Response | None = None
        self._method = ""
        self._framing = NO_BODY
        self._left = 0
        self._decoder: ChunkedDecoder | None = None
        self._reuse = False

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        response = self._response
        if response is None:
            self.abort()  # bytes nobody asked for: this connection cannot be trusted again
            return
        if response.head is None:
            buf = self._buf + data if self._buf else data
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > _MAX_HEAD:
                    self._head_failed(response, HeadError("response head too long"))
                    self.abort()
                else:
                    self._buf = buf
                return
            self._buf = b""
            try:
                head = parse_response_head(buf[:end], self._method)
            except HttpError as exc:
                self._head_failed(response, HeadError(str(exc)))
                self.abort()
                return
            data = buf[end + 4 :]
            if head.status < 200 and head.status != 101:
                if data:
                    self.data_received(data)  # 100 Continue and friends: the real head follows
                return
            self._reuse = head.keep_alive
            self._framing = head.framing
            self._left = head.content_length
            self._decoder = ChunkedDecoder() if head.framing == CHUNKED else None
            response.head = head
            now = self._loop.time()
            response._last_data = now
            waiter = response._head_waiter
            if waiter is not None and not waiter.done():
                waiter.set_result(None)
            if head.framing == NO_BODY or (head.framing == LENGTH and self._left == 0):
                self._body_done(response, data)
                return
            if not data:
                return
        self._body(response, data)

    def _body(self, response: Response, data: bytes) -> None:
        now = self._loop.time()
        if self._framing == LENGTH:
            if len(data) < self._left:
                self._left -= len(data)
                response._feed(data, now)
                return
            rest = data[self._left :]
            response._feed(data[: self._left], now)
            self._left = 0
            self._body_done(response, rest)
        elif self._framing == CHUNKED:
            assert self._decoder is not None
            try:
                pieces, rest = self._decoder.feed(data)
            except HttpError as exc:
                response._fail(f"malformed chunked body: {exc}")
                self.abort()
                return
            response._feed(
                b"".join(pieces) if len(pieces) > 1 else (pieces[0] if pieces else b""), now
            )
            if self._decoder.done:
                self._body_done(response, rest)
        else:  # UNTIL_CLOSE
            response._feed(data, now)

    def _body_done(self, response: Response, rest: bytes) -> None:
        self._response = None
        response._finish()
        if rest or not self._reuse:
            self.close()  # bytes past the end: the replica is confused; never reuse it
        else:
            self._pool._release(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self._pool._forget(self)
        response = self._response
        self._response = None
        if response is None:
            return
        if response.head is None:
            self._head_failed(
                response, HeadError(_describe(exc, "the replica closed the connection"))
            )
        elif self._framing == UNTIL_CLOSE:
            response._finish()
        else:
            response._fail(_describe(exc, "the replica closed the connection mid-body"))

    def pause_writing(self) -> None:  # the request body is written in one go; nothing to pause
        pass

    def resume_writing(self) -> None:
        pass

    # -- the client's side ---------------------------------------------------------------

    def pause(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def abort(self) -> None:
        self._reuse = False
        if self.transport is not None and not self.closed:
            self.transport.abort()

    def close(self) -> None:
        self._reuse = False
        if self.transport is not None and not self.closed:
            self.transport.close()

    def _head_failed(self, response: Response, error: BaseException) -> None:
        self._response = None
        response._head_error = error
        waiter = response._head_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def exchange(self, method: str, data: bytes, head_deadline: float) -> Response:
        assert self.transport is not None
        response = Response(self)
        self._response = response
        self._method = method
        self.transport.write(data)
        loop = self._loop
        waiter = response._head_waiter = loop.create_future()
        timer = loop.call_at(head_deadline, self._head_timed_out, response, head_deadline)
        try:
            await waiter
        except BaseException:
            if response.head is None:
                self.abort()  # cancelled mid-request: the connection's state is unknown
            else:
                response.close()
            raise
        finally:
            timer.cancel()
            response._head_waiter = None
        if response._head_error is not None:
            raise response._head_error
        return response

    def _head_timed_out(self, response: Response, deadline: float) -> None:
        if response.head is None and response._head_error is None:
            self._head_failed(response, HeadTimeout(deadline))
            self.abort()


def _describe(exc: BaseException | None, default: str) -> str:
    if exc is None:
        return default
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


PeerCheck = Callable[[object], str]
"""The far end's certificate (`getpeercert()`'s dict) -> "" when it is the one wanted, else
why not (the connection is then dropped: "shows no node certificate")."""


class HttpClient:
    """Keep-alive connections per (host, port); a request takes an idle one or opens one.

    With `tls`, each new connection goes through a TLS handshake before its first request
    (within the connect timeout again), and is kept only if `peer_check` accepts the far end's
    certificate; the pool keeps it, so TLS costs a handshake per connection."""

    def __init__(
        self,
        *,
        connect_timeout: float = 2.0,
        idle_timeout: float = 60.0,
        tls: ssl.SSLContext | None = None,
        peer_check: PeerCheck | None = None,
    ) -> None:
        self._tls = tls
        self._peer_check = peer_check
        self._connect_timeout = connect_timeout
        self._idle_timeout = idle_timeout  # an idle pooled connection older than this is closed
        self._idle: dict[tuple[str, int], list[_Connection]] = {}
        self._all: set[_Connection] = set()
        self._closed = False

    async def request(
        self, host: str, port: int, method: str, data: bytes, head_deadline: float
    ) -> Response:
        """Send `data` (a whole serialised request) and return once the response head is in.

        ConnectError: no connection could be made. HeadError: it broke (or spoke garbage)
        before the head. HeadTimeout: no head by `head_deadline` (loop time)."""
        conn = self._take_idle((host, port))
        if conn is None:
            conn = await self._connect(host, port, head_deadline)
        return await conn.exchange(method, data, head_deadline)

    def _take_idle(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        if not idle:
            return None
        now = asyncio.get_running_loop().time()
        while idle:
            conn = idle.pop()  # the most recently used: the likeliest to be alive
            transport = conn.transport
            if conn.closed or transport is None or transport.is_closing():
                continue
            if now - conn.idle_since > self._idle_timeout:
                conn.close()
                continue
            return conn
        return None

    async def _connect(self, host: str, port: int, head_deadline: float) -> _Connection:
        if self._closed:
            raise ConnectError("the client is closed")
        loop = asyncio.get_running_loop()
        timeout = min(self._connect_timeout, max(0.0, head_deadline - loop.time()))
        try:
            async with asyncio.timeout(timeout):
                _, conn = await loop.create_connection(
                    lambda: _Connection(self, (host, port)), host, port
                )
        except TimeoutError as exc:
            raise ConnectError(
                f"no connection to {host}:{port} within {timeout:g} s", address=f"{host}:{port}"
            ) from exc
        except OSError as exc:
            raise ConnectError(
                _describe(exc, "connection failed"), address=f"{host}:{port}"
            ) from exc
        if self._tls is not None:
            await self._start_tls(conn, self._tls, host, port, head_deadline)
        self._all.add(conn)
        return conn

    async def _start_tls(
        self, conn: _Connection, tls: ssl.SSLContext, host: str, port: int, head_deadline: float
    ) -> None:
        loop = asyncio.get_running_loop()
        plain = conn.transport
        assert plain is not None
        budget = min(self._connect_timeout, max(0.0, head_deadline - loop.time()))
        address = f"{host}:{port}"
        try:
            async with asyncio.timeout(budget):
                secured = await loop.start_tls(plain, conn, tls, server_hostname=host)
        except TimeoutError as exc:
            plain.abort()
            raise ConnectError(f"no TLS handshake within {budget:g} s", address=address) from exc
        except (OSError, ssl.SSLError) as exc:
            plain.abort()
            raise ConnectError(f"TLS with {address} failed: {exc}", address=address) from exc
        if secured is None:
            plain.abort()
            raise ConnectError("closed during the TLS handshake", address=address)
        conn.transport = secured
        why = self._peer_check(secured.get_extra_info("peercert")) if self._peer_check else ""
        if why:
            secured.abort()
            raise ConnectError(f"{address} {why}", address=address)

    def _release(self, conn: _Connection) -> None:
        if self._closed:
            conn.close()
            return
        conn.idle_since = conn._loop.time()
        self._idle.setdefault(conn.key, []).append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._all.discard(conn)
        idle = self._idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    async def close(self) -> None:
        self._closed = True
        for conn in list(self._all):
            conn.close()
        self._idle.clear()
        # Let the transports' close callbacks run, so no socket outlives the client.
        await asyncio.sleep(0)
