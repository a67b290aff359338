"""The front's HTTP/1.1 parsing: what it takes, what it leaves to aiohttp, and that whatever it
takes it reads exactly as aiohttp's own parser would (no request smuggling between the two)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import HttpRequestParser
from hypothesis import given, strategies as st

from wire.http1 import (
    CHUNKED,
    LENGTH,
    NO_BODY,
    UNTIL_CLOSE,
    ChunkedDecoder,
    HttpError,
    could_be_request,
    encode_chunk,
    parse_request_head,
    parse_response_head,
)

GOOD = (
    b"POST /v1/chat/completions?x=1 HTTP/1.1\r\nHost: 127.0.0.1:8080\r\n"
    b"Authorization: Bearer k1\r\nContent-Type: application/json\r\nContent-Length: 42"
)


def test_an_ordinary_request_head() -> None:
    head = parse_request_head(GOOD)
    assert head is not None
    assert (head.method, head.target, head.content_length, head.keep_alive) == (
        "POST",
        "/v1/chat/completions?x=1",
        42,
        True,
    )
    assert head.headers[1] == ("Authorization", "Bearer k1")


@pytest.mark.parametrize(
    "head",
    [
        b"POST / HTTP/1.1\r\nContent-Length: 1",  # no Host
        b"POST / HTTP/1.1\r\nHost: a\r\nHost: a",
        b"POST / HTTP/1.0\r\nContent-Length: 1",  # another version
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked",
        b"POST / HTTP/1.1\r\nContent-Length: 3\r\nTransfer-Encoding: chunked",
        b"POST / HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 3",
        b"GET / HTTP/1.1\r\nUpgrade: websocket",
        b"POST / HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3",  # even equal ones
        b"POST / HTTP/1.1\r\nContent-Length: +3",
        b"POST / HTTP/1.1\r\nContent-Length: 0x3",
        b"POST / HTTP/1.1\r\nContent-Length: 3 3",
        b"POST / HTTP/1.1\r\nX-A: 1\r\n folded",  # obs-fold
        b"POST / HTTP/1.1\r\nX-A : 1",  # space before the colon
        b"POST / HTTP/1.1\r\nX-A 1",
        b"POST / HTTP/1.1\nX-A: 1",  # a lone LF
        b"POST / HTTP/1.1\r\nX-A: 1\rX-B: 2",  # a lone CR
        b"POST / HTTP/1.1\r\nX-A: a\x00b",
        b"POST http://example.com/ HTTP/1.1",  # absolute form
        b"POST  / HTTP/1.1",
        b"P@ST / HTTP/1.1",
        b"POST /a b HTTP/1.1",
        b"POST / HTTP/1.1\r\nX-Long: " + b"a" * 9000,
    ],
)
def test_anything_unusual_is_left_to_aiohttp(head: bytes) -> None:
    assert parse_request_head(head) is None


def test_connection_close_is_noticed() -> None:
    head = parse_request_head(b"GET /c/x/ HTTP/1.1\r\nHost: gw\r\nConnection: close")
    assert head is not None and not head.keep_alive and head.content_length == 0


class _Protocol:
    transport = None

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


def _aiohttp_parse(data: bytes) -> Any:
    loop = asyncio.new_event_loop()
    try:
        parser = HttpRequestParser(
            _Protocol(), loop, 2**16, max_line_size=8190, max_field_size=8190
        )
        messages, _, _ = parser.feed_data(data)
        return messages[0][0] if messages else None
    finally:
        loop.close()


_NAMES = st.sampled_from(
    [
        *(b"Host", b"Content-Length", b"content-length", b"X-A", b"Connection"),
        *(b"Transfer-Encoding", b"Expect", b"X A", b"X-A ", b"", b"Authorization", b"X\x00"),
    ]
)
_VALUES = st.sampled_from(
    [
        *(b"1", b"12", b" 7 ", b"close", b"keep-alive", b"chunked", b"+1", b"-1", b"1,1"),
        *(b"a\tb", b"\xc3\xa9t\xc3\xa9", b"x\ry", b"x\ny", b"", b"Bearer k", b"0", b"007"),
    ]
)
_SEPARATORS = st.sampled_from([b"\r\n", b"\r\n", b"\r\n", b"\n", b"\r\n "])


@given(
    method=st.sampled_from([b"POST", b"GET", b"DELETE", b"post", b"P OST"]),
    target=st.sampled_from([b"/v1/completions", b"/c/x/a?b=c", b"/%2e%2e/", b"*", b"/a\x7fb"]),
    version=st.sampled_from([b"HTTP/1.1", b"HTTP/1.0", b"HTTP/1.1 ", b"http/1.1"]),
    fields=st.lists(st.tuples(_NAMES, _VALUES, _SEPARATORS), max_size=6),
)
def test_what_the_front_takes_aiohttp_reads_the_same_way(
    method: bytes,
    target: bytes,
    version: bytes,
    fields: list[tuple[bytes, bytes, bytes]],
) -> None:
    head = method + b" " + target + b" " + version + b"\r\nHost: gw"
    for name, value, separator in fields:
        head += separator + name + b":" + value
    ours = parse_request_head(head)
    if ours is None:
        return  # aiohttp's to answer, whatever it makes of it
    try:
        theirs = _aiohttp_parse(head + b"\r\n\r\n" + b"x" * ours.content_length)
    except HttpProcessingError as exc:
        raise AssertionError(f"the front took what aiohttp refuses: {head!r}: {exc}") from exc
    assert theirs is not None
    assert theirs.method == ours.method
    assert theirs.path == ours.target
    assert not theirs.chunked
    assert theirs.should_close == (not ours.keep_alive)
    raw = [(k.decode(), v.decode("utf-8", "surrogateescape")) for k, v in theirs.raw_headers]
    assert raw == ours.headers
    length = theirs.headers.get("Content-Length")
    assert int(length or 0) == ours.content_length


def test_response_framing() -> None:
    assert parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5", "GET").framing == LENGTH
    chunked = parse_response_head(
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\nContent-Length: 5", "GET"
    )
    assert chunked.framing == CHUNKED and chunked.keep_alive
    assert parse_response_head(b"HTTP/1.1 204 No Content", "GET").framing == NO_BODY
    assert parse_response_head(b"HTTP/1.1 200 OK\r\nContent-Length: 5", "HEAD").framing == NO_BODY
    until_close = parse_response_head(b"HTTP/1.1 200 OK", "GET")
    assert until_close.framing == UNTIL_CLOSE and not until_close.keep_alive
    assert not parse_response_head(
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1", "GET"
    ).keep_alive
    assert not parse_response_head(b"HTTP/1.0 200 OK\r\nContent-Length: 1", "GET").keep_alive


@pytest.mark.parametrize(
    "head",
    [
        b"HTTP/2 200 OK",
        b"HTTP/1.1 2000 OK",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1",
        b"HTTP/1.1 200 OK\r\nX-A: a\nInjected: yes",  # a value that would split our answer
        b"HTTP/1.1 200 OK\r\nbad line",
    ],
)
def test_a_garbled_response_head_is_an_error(head: bytes) -> None:
    with pytest.raises(HttpError):
        parse_response_head(head, "GET")


@given(
    pieces=st.lists(st.binary(min_size=1, max_size=300), max_size=8),
    cuts=st.lists(st.integers(min_value=0, max_value=4000), max_size=10),
    extension=st.booleans(),
    trailer=st.booleans(),
)
def test_a_chunked_body_decodes_the_same_however_it_is_split(
    pieces: list[bytes], cuts: list[int], extension: bool, trailer: bool
) -> None:
    encoded = b"".join(
        encode_chunk(p).replace(b"\r\n", b";ext=1\r\n", 1) if extension else encode_chunk(p)
        for p in pieces
    )
    encoded += b"0\r\nX-Trailer: 1\r\n\r\n" if trailer else b"0\r\n\r\n"
    after = b"HTTP/1.1 200 OK\r\n"  # the next response on the connection
    data = encoded + after
    decoder = ChunkedDecoder()
    out: list[bytes] = []
    rest = b""
    start = 0
    for cut in [*sorted({c % (len(data) + 1) for c in cuts}), len(data)]:
        got, rest = decoder.feed(data[start:cut])
        out.extend(got)
        start = cut
        if decoder.done:
            rest += data[cut:]
            break
    assert decoder.done
    assert b"".join(out) == b"".join(pieces)
    assert rest == after


@pytest.mark.parametrize(
    "body", [b"zz\r\nab\r\n", b"3\r\nabcd\r\n", b"-1\r\n", b"\r\n", b"1" * 20 + b"\r\n"]
)
def test_a_lying_chunked_body_is_an_error(body: bytes) -> None:
    with pytest.raises(HttpError):
        ChunkedDecoder().feed(body)


@pytest.mark.parametrize(
    ("start", "plausible"),
    [
        (b"", True),
        (b"PO", True),
        (b"POST /v1/chat", True),
        (b"DELETE", True),
        (b"\x16\x03\x01\x00\xa5", False),  # a TLS ClientHello on the plain port
        (b"post /", False),
        (b"BREW /pot HTTP/1.1", False),
        (b"GETX", False),
    ],
)
def test_a_head_that_cannot_become_a_request_is_known_early(start: bytes, plausible: bool) -> None:
    assert could_be_request(start) is plausible
