"""The HTTP tunnel's framing: HTTP requests over NATS from a gateway to a node's agent.

Shared by both ends (gateway/transport/overlay.py and nodeagent/tunnel.py); docs/subjects.md,
"HTTP tunnel", is the contract. Every frame is one binary NATS payload:

    kind: u8 | seq: u32 big-endian | meta_len: u32 big-endian | meta (msgspec JSON) | payload

`meta` is a tagged msgspec struct for the kinds that have one (else empty) and `payload` the
raw bytes of a body, uncopied into JSON and unencoded. `seq` numbers the response frames of one
request (HEAD, DATA, END, ERROR) from 0, so that a gateway notices a lost frame: NATS core
delivers at most once. REQUEST, CANCEL, CREDIT and ACK carry seq 0 and are not counted.

Flow control: a REQUEST with `window` > 0 lets the agent send at most that many body bytes
beyond what the gateway has reported consumed in CREDIT frames; the agent stops reading from
the workload meanwhile, so a slow client holds back the workload, not memory in the gateway.
`window` 0 (a gateway older than flow control) means no limit.

Decoding never raises anything but FrameError, whose message is one line.
"""

from __future__ import annotations

from typing import Final, Literal

import msgspec

from events.contract import framing

# Gateway -> agent, on subjects.tunnel(node_id).
REQUEST: Final = 0x01  # meta TunnelRequest, payload the request body; reply = the stream's inbox
CANCEL: Final = 0x02  # meta TunnelCancel: stop the request streaming to `reply`
CREDIT: Final = 0x03  # meta TunnelCredit: the gateway has passed on `consumed` body bytes

# Agent -> gateway, on the request's reply subject.
ACK: Final = 0x10  # no meta: the agent holds the request (sent only if no HEAD is ready soon)
HEAD: Final = 0x11  # meta TunnelHead, payload the first body bytes (maybe all of them)
DATA: Final = 0x12  # payload a body chunk
END: Final = 0x13  # payload the last body bytes (maybe none): the body is complete
ERROR: Final = 0x14  # meta TunnelError: the request failed; nothing follows

KIND_NAMES: Final = {
    REQUEST: "REQUEST",
    CANCEL: "CANCEL",
    CREDIT: "CREDIT",
    ACK: "ACK",
    HEAD: "HEAD",
    DATA: "DATA",
    END: "END",
    ERROR: "ERROR",
}

_PREFIX: Final = framing.PREFIX  # not imported by name: see framing.PREFIX
PREFIX_SIZE: Final = _PREFIX.size  # 9 bytes

# Agent -> gateway frames stay below this, far under NATS's default max_payload (1 MiB).
MAX_FRAME_PAYLOAD: Final = 256 * 1024

# Why a request failed (TunnelError.reason). Before the response head: connect_error,
# unknown_replica, overloaded and bad_request mean the workload never saw the request.
ErrorReason = Literal[
    "connect_error",  # the workload refused or could not be reached
    "unknown_replica",  # this agent does not run that replica at that epoch
    "fenced",  # the controller no longer vouches for that replica here (lease lapsed or moved)
    "overloaded",  # the agent is at its concurrency limit
    "bad_request",  # the agent could not use the request (undecodable, bad method, header or path)
    "reset",  # the workload closed the connection before or while answering
    "first_byte_timeout",  # no response head within timeout_s
    "stalled",  # the window was full and no CREDIT came for the agent's stall timeout
    "cancelled",  # the agent is shutting down
    "internal",  # a bug in the agent
]
NOT_DELIVERED: Final = frozenset(
    {"connect_error", "unknown_replica", "fenced", "overloaded", "bad_request"}
)

Headers = tuple[tuple[str, str], ...]


class TunnelRequest(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="tunnel.request.v1"
):
    """The head of one HTTP request for a replica on the agent's node."""

    request_id: str  # the HTTP request's id (X-Request-Id), for logs
    replica_id: str
    epoch: int  # the agent serves only a replica it runs at exactly this epoch
    method: str
    path: str  # path and query, e.g. /v1/chat/completions
    headers: Headers = ()  # end-to-end headers, as [name, value] pairs
    timeout_s: float = 0.0  # until the response head must be in (0: no limit)
    window: int = 0  # body bytes the agent may send ahead of the gateway's CREDIT (0: no limit)


class TunnelCancel(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="tunnel.cancel.v1"
):
    """Stop the request whose frames go to `reply` (the client went away, or gave up)."""

    reply: str
    request_id: str = ""


class TunnelCredit(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="tunnel.credit.v1"
):
    """The gateway has passed `consumed` body bytes (HEAD's, DATA's and END's payloads, from
    the first) of the request streaming to `reply` on to its client. Cumulative, so a lost
    CREDIT is made good by the next."""

    reply: str
    consumed: int


class TunnelHead(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="tunnel.head.v1"
):
    status: int
    headers: Headers = ()  # end-to-end headers of the workload's response
    end: bool = False  # the frame's payload is the whole body: no DATA or END follows


class TunnelError(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="tunnel.error.v1"
):
    reason: ErrorReason
    detail: str = ""  # one line


Meta = TunnelRequest | TunnelCancel | TunnelCredit | TunnelHead | TunnelError


class FrameError(framing.FrameError):
    """Bytes that are not a tunnel frame; the message is one line."""


class Frame(framing.Frame[Meta], frozen=True):
    kind_names = KIND_NAMES


_CODEC: Final[framing.Codec[Meta, Frame]] = framing.Codec(
    "tunnel",
    {
        REQUEST: TunnelRequest,
        CANCEL: TunnelCancel,
        CREDIT: TunnelCredit,
        ACK: None,
        HEAD: TunnelHead,
        DATA: None,
        END: None,
        ERROR: TunnelError,
    },
    frame=Frame,
    error=FrameError,
)

# encode(kind, *, seq=0, meta=None, payload=b""): one frame; `meta` must be the kind's meta type
# (None for ACK, DATA, END). decode(data): the Frame in `data`, else FrameError (one line).
encode: Final = _CODEC.encode
decode: Final = _CODEC.decode


def encode_request(request: TunnelRequest, body: bytes = b"") -> bytes:
    return encode(REQUEST, meta=request, payload=body)


def encode_cancel(reply: str, request_id: str = "") -> bytes:
    return encode(CANCEL, meta=TunnelCancel(reply=reply, request_id=request_id))


def encode_credit(reply: str, consumed: int) -> bytes:
    return encode(CREDIT, meta=TunnelCredit(reply=reply, consumed=consumed))


def encode_ack() -> bytes:
    return _ACK


def encode_head(seq: int, head: TunnelHead, payload: bytes = b"") -> bytes:
    return encode(HEAD, seq=seq, meta=head, payload=payload)


def encode_data(seq: int, payload: bytes) -> bytes:
    return _PREFIX.pack(DATA, seq, 0) + payload


def encode_end(seq: int, payload: bytes = b"") -> bytes:
    return _PREFIX.pack(END, seq, 0) + payload


def encode_error(seq: int, reason: ErrorReason, detail: str = "") -> bytes:
    line = " ".join(detail.split())  # one line, whatever the cause's text was
    return encode(ERROR, seq=seq, meta=TunnelError(reason=reason, detail=line))


_ACK: Final = _PREFIX.pack(ACK, 0, 0)


# A node's direct front (nodeagent/fencing_front.py) sets this on a refusal the workload never saw,
# with the reason (one of NOT_DELIVERED) as its value: the gateway may then repeat even a
# request that is not safe to repeat, as it does for the tunnel's own such errors.
NOT_DELIVERED_HEADER: Final = "Gpumesh-Not-Delivered"

# Headers set per hop (RFC 9110 7.6.1), plus Host and Content-Length, which each hop sets for
# itself, and NOT_DELIVERED_HEADER, which only a front may set (a workload's is dropped): never
# forwarded, by the gateway, the front or the agent's end of the tunnel.
HOP_BY_HOP: frozenset[str] = frozenset(
    {
        NOT_DELIVERED_HEADER.lower(),
        "connection",
        "keep-alive",
        "proxy-authenticate",
        "proxy-authorization",
        "te",
        "trailer",
        "trailers",
        "transfer-encoding",
        "upgrade",
        "host",
        "content-length",
    }
)
