"""Where the proxy's answer goes: a client connection, through aiohttp or the gateway's front.

gateway/proxy.py decides what to answer; a `Sink` carries it to the client. Two carry it: the
front's own connections (gateway/front.py, the fast path every ordinary inference request
takes) and `AiohttpSink`, for the requests the front hands to aiohttp (anything unusual, see
wire/http1.py). Both answer the same bytes' worth of HTTP; the proxy cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import msgspec
from aiohttp import web

Headers = Sequence[tuple[str, str]]

_JSON = msgspec.json.Encoder()
JSON_HEADERS: tuple[tuple[str, str], ...] = (("Content-Type", "application/json"),)


def error_body(status: int, message: str, code: str) -> bytes:
    """OpenAI's error shape, which every client of an OpenAI-compatible endpoint parses."""
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    return _JSON.encode({"error": {"message": message, "type": kind, "code": code}})


class Inbound(Protocol):
    """The request as the proxy needs it, whichever server parsed it."""

    method: str

    def header(self, lower_name: str) -> str | None:
        """The first value of a header, by its lower-case name."""
        ...

    def header_items(self) -> Headers:
        """Every header as received, names as sent."""
        ...


class FlowControlled(Protocol):
    """A body source that can stop and start reading (an upstream connection)."""

    def pause(self) -> None: ...

    def resume(self) -> None: ...


class Sink(Protocol):
    def send(self, status: int, headers: Headers, body: bytes) -> None:
        """A whole answer, sent at once (Content-Length framing)."""
        ...

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        """The head of an answer whose body follows in pieces, and the first of them (sent
        with the head: one write, so the first token is not a second packet behind it)."""
        ...

    async def write(self, data: bytes) -> None:
        """A piece of the body; ConnectionResetError if the client has gone."""
        ...

    async def end(self) -> None:
        """The body is complete. Never raises for a client that has gone."""
        ...

    def abort(self) -> None:
        """Drop the connection: the client sees an incomplete answer, never a truncated one
        that looks complete."""
        ...

    def client_gone(self) -> bool: ...

    def relay_writer(self, source: FlowControlled) -> Callable[[bytes], None] | None:
        """A function that writes a piece of the body at once, from inside the source's own
        read callback, pausing `source` while the client cannot take more; None if this sink
        can only be written from a task (then the proxy uses write())."""
        ...

    def relay_done(self) -> None:
        """The source is finished with; forget it."""
        ...


class AiohttpInbound:
    __slots__ = ("_request", "method")

    def __init__(self, request: web.BaseRequest) -> None:
        self._request = request
        self.method = request.method

    def header(self, lower_name: str) -> str | None:
        return self._request.headers.get(lower_name)

    def header_items(self) -> Headers:
        # str(): aiohttp's names are `istr`, which a tunnel frame cannot encode.
        return [(str(k), v) for k, v in self._request.headers.items()]


class AiohttpSink:
    """Answers through aiohttp; `response` is what the route handler returns."""

    __slots__ = ("_request", "_stream", "response")

    def __init__(self, request: web.BaseRequest) -> None:
        self._request = request
        self._stream: web.StreamResponse | None = None
        self.response: web.StreamResponse | None = None

    def send(self, status: int, headers: Headers, body: bytes) -> None:
        response = web.Response(status=status, body=body)
        for name, value in headers:
            response.headers.add(name, value)
        self.response = response

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        stream = web.StreamResponse(status=status)
        for name, value in headers:
            stream.headers.add(name, value)
        self._stream = self.response = stream
        await stream.prepare(self._request)
        if first:
            await stream.write(first)

    async def write(self, data: bytes) -> None:
        assert self._stream is not None
        await self._stream.write(data)

    async def end(self) -> None:
        if self._stream is not None:
            try:
                await self._stream.write_eof()
            except ConnectionResetError:
                pass

    def abort(self) -> None:
        if self._request.transport is not None:
            self._request.transport.abort()

    def client_gone(self) -> bool:
        transport = self._request.transport
        return transport is None or transport.is_closing()

    def relay_writer(self, source: FlowControlled) -> Callable[[bytes], None] | None:
        return None  # aiohttp's StreamResponse is written from a task

    def relay_done(self) -> None:
        pass
