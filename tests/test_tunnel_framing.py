"""events/contract/tunnel.py: every frame kind round-trips, and garbage is a one-line FrameError."""

from __future__ import annotations

import re
import struct
from pathlib import Path

import msgspec
import pytest
from hypothesis import given, strategies as st

from events.contract import tunnel as t
from events.contract.tunnel import (
    Frame,
    FrameError,
    TunnelCancel,
    TunnelCredit,
    TunnelError,
    TunnelHead,
    TunnelRequest,
)

REQUEST = TunnelRequest(
    request_id="req-1",
    replica_id="r1",
    epoch=3,
    method="POST",
    path="/v1/chat/completions?x=1",
    headers=(("Content-Type", "application/json"), ("X-Request-Id", "req-1")),
    timeout_s=30.0,
)


def test_request_round_trips_with_a_raw_body() -> None:
    body = b'{"messages": []}\x00\xff binary is fine'
    frame = t.decode(t.encode_request(REQUEST, body))
    assert frame == Frame(t.REQUEST, 0, REQUEST, body)
    assert frame.kind_name == "REQUEST"


def test_the_layout_is_kind_seq_meta_length_meta_payload() -> None:
    raw = t.encode_head(7, TunnelHead(status=200), b"body")
    kind, seq, meta_len = struct.unpack(">BII", raw[:9])
    assert (kind, seq) == (t.HEAD, 7)
    assert msgspec.json.decode(raw[9 : 9 + meta_len]) == {"type": "tunnel.head.v1", "status": 200}
    assert raw[9 + meta_len :] == b"body"
    assert t.encode_data(2, b"abc") == b"\x12\x00\x00\x00\x02\x00\x00\x00\x00abc"


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (
            t.encode_cancel("_INBOX.x.1", "req-1"),
            Frame(t.CANCEL, 0, TunnelCancel(reply="_INBOX.x.1", request_id="req-1")),
        ),
        (
            t.encode_credit("_INBOX.x.1", 524_288),
            Frame(t.CREDIT, 0, TunnelCredit(reply="_INBOX.x.1", consumed=524_288)),
        ),
        (t.encode_ack(), Frame(t.ACK)),
        (
            t.encode_head(0, TunnelHead(status=503, headers=(("a", "b"),), end=True), b"x"),
            Frame(t.HEAD, 0, TunnelHead(status=503, headers=(("a", "b"),), end=True), b"x"),
        ),
        (t.encode_data(5, b"chunk"), Frame(t.DATA, 5, None, b"chunk")),
        (t.encode_end(6), Frame(t.END, 6)),
        (t.encode_end(6, b"tail"), Frame(t.END, 6, None, b"tail")),
        (
            t.encode_error(2, "reset", "peer\nclosed   it"),
            Frame(t.ERROR, 2, TunnelError(reason="reset", detail="peer closed it")),
        ),
    ],
)  # fmt: skip
def test_every_kind_round_trips(raw: bytes, expected: Frame) -> None:
    assert t.decode(raw) == expected


def test_the_largest_sequence_number_fits() -> None:
    assert t.decode(t.encode_data(2**32 - 1, b"")).seq == 2**32 - 1


def test_encode_refuses_a_mismatched_meta() -> None:
    with pytest.raises(ValueError, match="HEAD frame takes"):
        t.encode(t.HEAD, meta=REQUEST)
    with pytest.raises(ValueError, match="DATA frame takes"):
        t.encode(t.DATA, meta=TunnelHead(status=200))
    with pytest.raises(ValueError, match="unknown tunnel frame kind 0x7f"):
        t.encode(0x7F)


def _meta(kind: int, meta: bytes, payload: bytes = b"") -> bytes:
    return struct.pack(">BII", kind, 0, len(meta)) + meta + payload


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (b"", "0 bytes, shorter than its 9-byte prefix"),
        (b"GET / HTTP/1.1\r\n", "unknown kind 0x47"),
        (b'{"type": "tunnel.request.v1"}', "unknown kind 0x7b"),
        (struct.pack(">BII", t.HEAD, 0, 500) + b"{}", "truncated HEAD frame: meta of 500 bytes"),
        (_meta(t.HEAD, b""), "HEAD frame without its meta"),
        (_meta(t.HEAD, b"{not json"), "HEAD frame with undecodable meta"),
        (_meta(t.HEAD, b'{"type": "tunnel.error.v1"}'), "HEAD frame with undecodable meta"),
        (_meta(t.REQUEST, b'{"type": "tunnel.request.v1"}'), "Object missing required field"),
        (_meta(t.ERROR, b'{"type": "tunnel.error.v1", "reason": "x"}'), "undecodable meta"),
        (_meta(t.ERROR, b"\xff\xfe"), "ERROR frame with undecodable meta"),
        (_meta(t.DATA, b"{}"), "DATA frame with 2 bytes of meta, expected none"),
    ],
)  # fmt: skip
def test_garbage_is_a_one_line_frame_error(raw: bytes, message: str) -> None:
    with pytest.raises(FrameError) as caught:
        t.decode(raw)
    assert message in str(caught.value)
    assert "\n" not in str(caught.value)


@given(st.binary(max_size=64))
def test_no_input_crashes_the_decoder(raw: bytes) -> None:
    try:
        frame = t.decode(raw)
    except FrameError as exc:
        assert "\n" not in str(exc)
    else:
        assert frame.kind in t.KIND_NAMES


@given(st.binary(max_size=2048), st.integers(0, 2**32 - 1))
def test_payloads_pass_byte_for_byte(payload: bytes, seq: int) -> None:
    assert t.decode(t.encode_data(seq, payload)).payload == payload
    assert t.decode(t.encode_request(REQUEST, payload)).payload == payload


def test_the_contract_page_lists_every_meta_field_and_tag() -> None:
    doc = (Path(__file__).resolve().parents[1] / "docs" / "subjects.md").read_text()
    section = doc[
        doc.index("### HTTP tunnel\n") : doc.index("\n### ", doc.index("### HTTP tunnel"))
    ]
    assert "```json" not in section  # the contract test would try to parse it as a payload
    assert not re.search(r"^\| Payload \|", section, re.M)  # no JSON example to check
    for cls in (TunnelRequest, TunnelCancel, TunnelCredit, TunnelHead, TunnelError):
        heading = f"#### `events.contract.tunnel.{cls.__name__}`\n"
        assert heading in section, cls.__name__
        table = section[section.index(heading) :].split("\n#### ")[0]
        documented = re.findall(r"^\| `(\w+)` \|", table, re.M)
        assert documented == [f.name for f in msgspec.structs.fields(cls)], cls.__name__
        assert f'`"type": "{cls.__struct_config__.tag}"`' in table
    for kind, name in t.KIND_NAMES.items():
        assert f"| `0x{kind:02x}` | {name} |" in section
    assert f"{t.MAX_FRAME_PAYLOAD // 1024} KiB" in section
