"""HTTP/1.1 message heads and chunked bodies, parsed strictly, for the gateway's own data path.

The gateway's front (gateway/front.py) and its upstream client (gateway/transport/client.py)
speak HTTP/1.1 on asyncio protocols instead of through aiohttp's server and client, which were
half of the gateway's CPU per proxied request (docs/performance.md, Gateway). They need only
this much of HTTP: a head split into its lines, Content-Length or chunked framing.

The request parser is deliberately narrow. It accepts what OpenAI clients send and refuses
(returns None for) anything else, so that the front can hand that connection to aiohttp's
complete parser instead: an odd request is served slower, never parsed differently from how
aiohttp would parse it (no request smuggling through a disagreement between two parsers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import WireError

MAX_HEAD_BYTES = 8190  # aiohttp's own line limit; a longer head goes to aiohttp, which says 431
_MAX_LENGTH_DIGITS = 15

# RFC 9110 5.6.2 token characters: what a method and a header name may consist of.
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")
# The methods the front may serve; any other (lower case included) is aiohttp's to judge.
_METHODS = frozenset({b"GET", b"POST", b"PUT", b"PATCH", b"DELETE", b"OPTIONS", b"HEAD"})
# A field value: visible ASCII, obs-text, space and tab (RFC 9110 5.5); never CR, LF or NUL.
_VALUE = re.compile(rb"[\t\x20-\x7e\x80-\xff]*")
# A request target in origin form: a path and a query of visible ASCII.
_TARGET = re.compile(rb"/[\x21-\x7e]*")


class HttpError(WireError):
    """A message that is not HTTP/1.1 as this parser takes it."""


@dataclass(slots=True)
class RequestHead:
    method: str
    target: str  # path and query, as sent
    headers: list[tuple[str, str]]  # names as sent; values decoded as aiohttp does
    content_length: int
    keep_alive: bool


def parse_request_head(head: bytes) -> RequestHead | None:
    """The head (without its final empty line) of an HTTP/1.1 request with a Content-Length
    body or none; None for anything this parser leaves to aiohttp: another version, chunked or
    Expect, an absolute target, a malformed line."""
    if len(head) > MAX_HEAD_BYTES:
        return None
    bare = head.replace(b"\r\n", b"")
    if b"\n" in bare or b"\r" in bare:
        return None  # a lone CR or LF: parsers disagree on those
    lines = head.split(b"\r\n")
    parts = lines[0].split(b" ")
    if len(parts) != 3 or parts[2] != b"HTTP/1.1":
        return None
    method, target = parts[0], parts[1]
    if method not in _METHODS or not _TARGET.fullmatch(target):
        return None
    headers: list[tuple[str, str]] = []
    length: bytes | None = None
    keep_alive = True
    hosts = 0
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            return None  # obs-fold, a space before the colon, no colon at all
        value = value.strip(b" \t")
        if not _VALUE.fullmatch(value):
            return None
        lower = name.lower()
        if lower == b"content-length":
            if length is not None or not value.isdigit() or len(value) > _MAX_LENGTH_DIGITS:
                return None  # two lengths (even equal ones) or a strange one: aiohttp decides
            length = value
        elif lower in (b"transfer-encoding", b"expect", b"upgrade"):
            return None
        elif lower == b"host":
            hosts += 1
        elif lower == b"connection" and b"close" in value.lower():
            keep_alive = False
        # surrogateescape: the bytes a client sent come back out unchanged when forwarded.
        headers.append((name.decode("ascii"), value.decode("utf-8", "surrogateescape")))
    if hosts != 1:
        return None  # RFC 9112 3.2: exactly one Host; aiohttp says 400 otherwise
    return RequestHead(
        method=method.decode("ascii"),
        target=target.decode("ascii"),
        headers=headers,
        content_length=int(length) if length is not None else 0,
        keep_alive=keep_alive,
    )


def could_be_request(start: bytes) -> bool:
    """Whether the first bytes of a head, before it is whole, could still become a request
    parse_request_head takes: its method so far, then a space."""
    method, space, _ = start.partition(b" ")
    if not space:
        return len(method) < 8 and any(m.startswith(method) for m in _METHODS)
    return method in _METHODS


# How a response's body is delimited (RFC 9112 6.3).
NO_BODY = 0
LENGTH = 1
CHUNKED = 2
UNTIL_CLOSE = 3


@dataclass(slots=True)
class ResponseHead:
    status: int
    reason: str
    headers: list[tuple[str, str]]  # every header, as sent
    framing: int  # NO_BODY, LENGTH, CHUNKED or UNTIL_CLOSE
    content_length: int  # with LENGTH
    keep_alive: bool


def parse_response_head(head: bytes, method: str) -> ResponseHead:
    """A response head (without its final empty line) to a request of `method`."""
    lines = head.split(b"\r\n")
    status_line = lines[0]
    version, _, rest = status_line.partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise HttpError(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
    status = int(code)
    headers: list[tuple[str, str]] = []
    length: int | None = None
    chunked = False
    keep_alive = version == b"HTTP/1.1"
    for line in lines[1:]:
        name, colon, value = line.partition(b":")
        if not colon or not _TOKEN.fullmatch(name):
            raise HttpError(f"malformed header line: {line[:80]!r}")
        value = value.strip(b" \t")
        if not _VALUE.fullmatch(value):
            # A lone CR or LF would split the answer the gateway writes from these headers.
            raise HttpError(f"a control character in header {name[:40]!r}")
        lower = name.lower()
        if lower == b"content-length":
            if not value.isdigit() or len(value) > _MAX_LENGTH_DIGITS:
                raise HttpError(f"bad Content-Length: {value[:40]!r}")
            if length is not None and length != int(value):
                raise HttpError("two different Content-Length values")
            length = int(value)
        elif lower == b"transfer-encoding":
            # The last coding decides; anything but chunked is read until the close.
            chunked = value.lower().rsplit(b",", 1)[-1].strip() == b"chunked"
            if not chunked:
                keep_alive = False
        elif lower == b"connection":
            tokens = value.lower()
            if b"close" in tokens:
                keep_alive = False
            elif b"keep-alive" in tokens and version == b"HTTP/1.0":
                keep_alive = True
        headers.append((name.decode("latin-1"), value.decode("latin-1")))
    if method == "HEAD" or status < 200 or status in (204, 304):
        framing, length = NO_BODY, 0
    elif chunked:
        framing = CHUNKED  # RFC 9112 6.3: chunked overrides any Content-Length
    elif length is not None:
        framing = LENGTH
    else:
        framing, keep_alive = UNTIL_CLOSE, False
    return ResponseHead(
        status=status,
        reason=reason.decode("latin-1"),
        headers=headers,
        framing=framing,
        content_length=length or 0,
        keep_alive=keep_alive,
    )


class ChunkedDecoder:
    """Decodes a chunked body fed in arbitrary pieces (RFC 9112 7.1); trailers are dropped."""

    __slots__ = ("_buf", "_left", "_state", "done")

    _SIZE, _DATA, _DATA_END, _TRAILER = range(4)
    _MAX_LINE = 4096

    def __init__(self) -> None:
        self._buf = b""
        self._left = 0
        self._state = self._SIZE
        self.done = False

    def feed(self, data: bytes) -> tuple[list[bytes], bytes]:
        """The body bytes in `data`, and what follows the body's end (b"" until done)."""
        out: list[bytes] = []
        buf = self._buf + data if self._buf else data
        self._buf = b""
        pos = 0
        end = len(buf)
        while pos < end and not self.done:
            if self._state == self._DATA:
                take = min(self._left, end - pos)
                out.append(buf[pos : pos + take])
                pos += take
                self._left -= take
                if self._left == 0:
                    self._state = self._DATA_END
                continue
            eol = buf.find(b"\r\n", pos)
            if eol < 0:
                if end - pos > self._MAX_LINE:
                    raise HttpError("chunk line too long")
                self._buf = buf[pos:]
                return out, b""
            line = buf[pos:eol]
            pos = eol + 2
            if self._state == self._SIZE:
                size = line.split(b";", 1)[0].strip(b" \t")
                if not size or len(size) > 16 or size.strip(b"0123456789abcdefABCDEF"):
                    raise HttpError(f"bad chunk size line: {line[:40]!r}")
                self._left = int(size, 16)
                self._state = self._DATA if self._left else self._TRAILER
            elif self._state == self._DATA_END:
                if line:
                    raise HttpError("chunk data longer than its size")
                self._state = self._SIZE
            elif not line:  # the empty line after the trailers
                self.done = True
        return out, buf[pos:] if self.done else b""


def encode_chunk(data: bytes) -> bytes:
    return b"%x\r\n%b\r\n" % (len(data), data)


LAST_CHUNK = b"0\r\n\r\n"
