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

from typing import Final, Literal

import msgspec

from events.contract import framing, subjects

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

_PREFIX: Final = framing.PREFIX  # not imported by name: see framing.PREFIX
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


class FrameError(framing.FrameError):
    """Bytes that are not a stage link frame; the message is one line."""


class Frame(framing.Frame[Meta], frozen=True):
    kind_names = KIND_NAMES


_CODEC: Final[framing.Codec[Meta, Frame]] = framing.Codec(
    "stage link",
    {
        OPEN: StageOpen,
        ACCEPT: StageAccept,
        DATA: None,
        CREDIT: StageCredit,
        CLOSE: None,
        ERROR: StageError,
    },
    frame=Frame,
    error=FrameError,
    max_chunk={DATA: MAX_CHUNK},
)

# encode(kind, *, seq=0, meta=None, payload=b""): one frame; `meta` must be the kind's meta type
# (None for DATA and CLOSE). decode(data): the Frame in `data`, else FrameError (one line),
# a DATA frame over MAX_CHUNK included.
encode: Final = _CODEC.encode
decode: Final = _CODEC.decode


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
