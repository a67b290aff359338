"""The stage link's framing: one TCP connection between two pipeline stages, carried over NATS.

A sharded replica's head (rank 0) talks to each worker stage's engine over plain TCP (llama.cpp's
RPC backend, for one). When the spec lets stages reach each other only through the overlay (a
node behind NAT has nothing but its outbound NATS connection), the head's agent listens on a
local port for each worker and carries every connection made to it, as a byte stream, to the
worker's agent, which connects to the engine's port on its node (nodeagent/stage_link.py).
docs/subjects.md, "Stage link", is the contract. Every frame is one binary NATS payload, laid
out as the HTTP tunnel's (events/contract/tunnel.py):

    kind: u8 | seq: u32 big-endian | meta_len: u32 big-endian | meta (msgspec JSON) | payload

`seq` numbers every frame of a stream in each direction from 0 (the head's OPEN, the worker's
ACCEPT or ERROR): NATS core delivers in order per publisher but at most once, so a receiver
that meets any other number has lost a frame and ends the stream with ERROR `gap`, never
passing on a byte stream with a hole in it.

Flow control, both ways: each receiver states its window (OPEN's for what the worker sends,
ACCEPT's for what the head sends); a sender keeps at most that many DATA bytes beyond the
receiver's cumulative CREDIT in flight, and reads its own socket only when it has room, so a
slow reader holds back the writer's TCP, not anyone's memory. A receiver that gets more than
its window ends the stream with ERROR `overrun`. CLOSE is a half-close (the sender's socket
reached end of file): the receiver shuts its socket's write side; the stream is over when both
sides have closed, or at the first ERROR.

Decoding never raises anything but FrameError, whose message is one line.
"""

from __future__ import annotations

import struct
from typing import Final, Literal

import msgspec

from events.contract import subjects

# Head -> worker only.
OPEN: Final = 0x01  # meta StageOpen: connect me to this stage's engine
# Worker -> head only.
ACCEPT: Final = 0x02  # meta StageAccept: connected to the engine; send within my window
# Both ways.
DATA: Final = 0x03  # payload: the next bytes of the stream (at most MAX_CHUNK)
CREDIT: Final = 0x04  # meta StageCredit: I have passed on this many DATA bytes, cumulative
CLOSE: Final = 0x05  # no meta: my socket reached end of file; no DATA follows from me
ERROR: Final = 0x06  # meta StageError: the stream is over; nothing follows

KIND_NAMES: Final = {
    OPEN: "OPEN",
    ACCEPT: "ACCEPT",
    DATA: "DATA",
    CREDIT: "CREDIT",
    CLOSE: "CLOSE",
    ERROR: "ERROR",
}

_PREFIX: Final = struct.Struct(">BII")
PREFIX_SIZE: Final = _PREFIX.size  # 9 bytes

# DATA payloads stay at or below this: far under NATS's default max_payload (1 MiB), small
# enough that a token's few bytes never wait behind a long frame of weights on the same link.
MAX_CHUNK: Final = 64 * 1024
# A receiver's default window: 16 chunks, enough to keep a loopback NATS busy (bench/stage_link.py).
DEFAULT_WINDOW: Final = 1024 * 1024

# Why a stream ended (StageError.reason).
ErrorReason = Literal[
    "unknown_stage",  # the worker's agent does not run that replica's rank at that epoch
    "fenced",  # the controller no longer vouches for that replica on the worker's node
    "forbidden",  # the opening node is not one the worker lets reach that replica's stages
    "connect_error",  # the stage's engine refused or could not be reached
    "unreachable",  # no agent listens on the worker's subject (NATS: no responders)
    "open_timeout",  # no ACCEPT or ERROR within the head's open timeout
    "overloaded",  # the worker's agent carries its maximum of streams
    "bad_request",  # a frame the receiver could not use (undecodable, unexpected, bad window)
    "gap",  # a frame was lost: the byte stream would have had a hole
    "overrun",  # the peer sent beyond the window it was given
    "stalled",  # the window stayed full, with no CREDIT, for the sender's stall timeout
    "reset",  # the local socket broke (its peer reset or vanished)
    "cancelled",  # the agent is stopping, or the stage was taken down
    "internal",  # a bug in the agent
]


class StageOpen(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="stagelink.open.v1"
):
    """Connect this stream to the engine of `replica_id`'s stage `rank`, at exactly `epoch`."""

    replica_id: str
    epoch: int
    rank: int
    window: int = DEFAULT_WINDOW  # DATA bytes the worker may send beyond the head's CREDIT


class StageAccept(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="stagelink.accept.v1"
):
    window: int = DEFAULT_WINDOW  # DATA bytes the head may send beyond the worker's CREDIT


class StageCredit(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="stagelink.credit.v1"
):
    consumed: int  # DATA bytes, from the first, written to the receiver's socket


class StageError(
    msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True, tag="stagelink.error.v1"
):
    reason: ErrorReason
    detail: str = ""  # one line


Meta = StageOpen | StageAccept | StageCredit | StageError


class FrameError(ValueError):
    """Bytes that are not a stage link frame; the message is one line."""


class Frame(msgspec.Struct, frozen=True):
    kind: int
    seq: int = 0
    meta: Meta | None = None
    payload: bytes = b""

    @property
    def kind_name(self) -> str:
        return KIND_NAMES.get(self.kind, f"0x{self.kind:02x}")


_ENCODER: Final = msgspec.json.Encoder()
_META_TYPES: Final[dict[int, type[Meta] | None]] = {
    OPEN: StageOpen,
    ACCEPT: StageAccept,
    DATA: None,
    CREDIT: StageCredit,
    CLOSE: None,
    ERROR: StageError,
}
_DECODERS: Final = {
    kind: msgspec.json.Decoder(cls) for kind, cls in _META_TYPES.items() if cls is not None
}


def encode(kind: int, *, seq: int = 0, meta: Meta | None = None, payload: bytes = b"") -> bytes:
    """One frame. `meta` must be the kind's meta type (None for DATA and CLOSE)."""
    expected = _META_TYPES.get(kind, ...)
    if expected is ...:
        raise ValueError(f"unknown stage link frame kind 0x{kind:02x}")
    if (meta is None) != (expected is None) or (meta is not None and type(meta) is not expected):
        raise ValueError(f"a {KIND_NAMES[kind]} frame takes {expected!r} as meta, not {meta!r}")
    raw = _ENCODER.encode(meta) if meta is not None else b""
    return b"".join((_PREFIX.pack(kind, seq, len(raw)), raw, payload))


def encode_open(open_: StageOpen) -> bytes:
    return encode(OPEN, meta=open_)


def encode_accept(window: int) -> bytes:
    return encode(ACCEPT, meta=StageAccept(window=window))


def encode_data(seq: int, payload: bytes) -> bytes:
    # The hot path: no meta to encode, one concatenation.
    return _PREFIX.pack(DATA, seq, 0) + payload


def encode_credit(seq: int, consumed: int) -> bytes:
    return encode(CREDIT, seq=seq, meta=StageCredit(consumed=consumed))


def encode_close(seq: int) -> bytes:
    return _PREFIX.pack(CLOSE, seq, 0)


def encode_error(seq: int, reason: ErrorReason, detail: str = "") -> bytes:
    line = " ".join(detail.split())  # one line, whatever the cause's text was
    return encode(ERROR, seq=seq, meta=StageError(reason=reason, detail=line))


def decode(data: bytes) -> Frame:
    """The frame in `data`; FrameError (one line) for anything else."""
    if len(data) < PREFIX_SIZE:
        raise FrameError(
            f"not a stage link frame: {len(data)} bytes, shorter than its 9-byte prefix"
        )
    kind, seq, meta_len = _PREFIX.unpack_from(data)
    if kind not in _META_TYPES:
        raise FrameError(f"not a stage link frame: unknown kind 0x{kind:02x}")
    end = PREFIX_SIZE + meta_len
    if end > len(data):
        raise FrameError(
            f"truncated {KIND_NAMES[kind]} frame: meta of {meta_len} bytes, "
            f"{len(data) - PREFIX_SIZE} left"
        )
    decoder = _DECODERS.get(kind)
    meta: Meta | None = None
    if decoder is not None:
        if meta_len == 0:
            raise FrameError(f"{KIND_NAMES[kind]} frame without its meta")
        try:
            meta = decoder.decode(data[PREFIX_SIZE:end])
        except msgspec.DecodeError as exc:
            first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            raise FrameError(f"{KIND_NAMES[kind]} frame with undecodable meta: {first}") from None
    elif meta_len:
        raise FrameError(f"{KIND_NAMES[kind]} frame with {meta_len} bytes of meta, expected none")
    if kind == DATA and len(data) - end > MAX_CHUNK:
        raise FrameError(f"DATA frame of {len(data) - end} bytes, over the {MAX_CHUNK}-byte chunk")
    return Frame(kind, seq, meta, data[end:])


# Subjects (events/contract/subjects.py). Each node reads only under its own `stagelink(node)`;
# each frame's subject names the node that sent it in a token its NATS permissions pin to its
# own id (docs/subjects.md), so a receiver knows, from the server, who is at the other end.
STAGELINK_ALL: Final = subjects.STAGELINK_ALL
stagelink = subjects.stagelink
stagelink_to_stage = subjects.stagelink_to_stage
stagelink_to_head = subjects.stagelink_to_head


def stream_of(subject: str) -> tuple[str, str] | None:
    """(the sending node, the stream id) from a stage link subject, or None if it is not one."""
    tokens = subject.split(".")
    if len(tokens) != 8 or tokens[4] != "stagelink" or tokens[5] not in ("stage", "head"):
        return None
    return tokens[6], tokens[7]
