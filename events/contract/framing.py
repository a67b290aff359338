"""The binary framing shared by the HTTP tunnel (tunnel.py) and the stage link (stage_link.py).

Each of those modules is its protocol's contract (docs/subjects.md): its kinds, their names, the
meta type each carries and the public `encode`/`decode`, which are a `Codec` built here from
those tables. Every frame is one binary NATS payload:

    kind: u8 | seq: u32 big-endian | meta_len: u32 big-endian | meta (msgspec JSON) | payload

A kind has either a meta type (a tagged msgspec struct, which its frames must carry) or none
(its frames carry no meta). Decoding never raises anything but the protocol's FrameError, whose
message is one line.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Any, ClassVar, Final, Generic, TypeVar

import msgspec

# A module that packs it on a hot path aliases it (`_PREFIX = framing.PREFIX`) rather than
# importing the name: CPython 3.11 compiles a method call on an imported name as an attribute
# load (a bound method made each time) and a call, ~25 ns more per frame.
PREFIX: Final = struct.Struct(">BII")
PREFIX_SIZE: Final = PREFIX.size  # 9 bytes

M = TypeVar("M", bound=msgspec.Struct)
F = TypeVar("F", bound="Frame[Any]")


class FrameError(ValueError):
    """Bytes that are not a frame of the protocol; the message is one line. Each protocol
    raises its own subclass, so that a handler of one never catches the other's."""


class Frame(msgspec.Struct, Generic[M], frozen=True):
    """One decoded frame; a protocol subclasses it with its meta type and its kind names."""

    kind: int
    seq: int = 0
    meta: M | None = None
    payload: bytes = b""

    kind_names: ClassVar[Mapping[int, str]] = {}

    @property
    def kind_name(self) -> str:
        return self.kind_names.get(self.kind, f"0x{self.kind:02x}")


_ENCODER: Final = msgspec.json.Encoder()

# A kind's name, meta type, meta decoder and largest payload (None: no meta, or no limit).
_Kind = tuple[str, type[M] | None, msgspec.json.Decoder[M] | None, int | None]


class Codec(Generic[M, F]):
    """`encode` and `decode` for one protocol: `meta_types` maps each of its kinds to the meta
    type its frames carry (None: no meta), `frame` names the kinds, and `max_chunk` bounds the
    payload of the kinds it lists. Meant to be built once, at import, and its bound methods
    exported as the protocol module's own functions."""

    __slots__ = ("_error", "_frame", "_kinds", "_protocol")

    def __init__(
        self,
        protocol: str,
        meta_types: Mapping[int, type[M] | None],
        *,
        frame: type[F],
        error: type[FrameError],
        max_chunk: Mapping[int, int] | None = None,
    ) -> None:
        names = frame.kind_names
        if set(names) != set(meta_types) or not set(names) <= set(range(0x100)):
            raise ValueError(f"{protocol}: kinds must be bytes, each with a name and a meta type")
        limits = max_chunk or {}
        self._protocol = protocol  # as in "not a {protocol} frame"
        # All decode needs of a kind in one lookup, indexed by the kind byte itself (None: no
        # such kind): cheaper than a dict's .get on the gateway's hot path.
        kinds: list[_Kind[M] | None] = [None] * 0x100
        for kind, cls in meta_types.items():
            decoder = msgspec.json.Decoder(cls) if cls is not None else None
            kinds[kind] = (names[kind], cls, decoder, limits.get(kind))
        self._kinds = tuple(kinds)
        self._frame = frame
        self._error = error

    def encode(
        self, kind: int, *, seq: int = 0, meta: M | None = None, payload: bytes = b""
    ) -> bytes:
        """One frame. `meta` must be the kind's meta type (None for a kind without one)."""
        spec = self._kinds[kind] if 0 <= kind <= 0xFF else None
        if spec is None:
            raise ValueError(f"unknown {self._protocol} frame kind 0x{kind:02x}")
        name, expected, _, _ = spec
        if (meta is None) != (expected is None) or (
            meta is not None and type(meta) is not expected
        ):
            raise ValueError(f"a {name} frame takes {expected!r} as meta, not {meta!r}")
        raw = _ENCODER.encode(meta) if meta is not None else b""
        return b"".join((PREFIX.pack(kind, seq, len(raw)), raw, payload))

    def decode(self, data: bytes) -> F:
        """The frame in `data`; FrameError (one line) for anything else."""
        if len(data) < PREFIX_SIZE:
            raise self._error(
                f"not a {self._protocol} frame: {len(data)} bytes, "
                f"shorter than its {PREFIX_SIZE}-byte prefix"
            )
        kind, seq, meta_len = PREFIX.unpack_from(data)
        spec = self._kinds[kind]
        if spec is None:
            raise self._error(f"not a {self._protocol} frame: unknown kind 0x{kind:02x}")
        name, _, decoder, limit = spec
        end = PREFIX_SIZE + meta_len
        if end > len(data):
            raise self._error(
                f"truncated {name} frame: meta of {meta_len} bytes, {len(data) - PREFIX_SIZE} left"
            )
        meta: M | None = None
        if decoder is not None:
            if meta_len == 0:
                raise self._error(f"{name} frame without its meta")
            try:
                meta = decoder.decode(data[PREFIX_SIZE:end])
            except msgspec.DecodeError as exc:
                first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                raise self._error(f"{name} frame with undecodable meta: {first}") from None
        elif meta_len:
            raise self._error(f"{name} frame with {meta_len} bytes of meta, expected none")
        if limit is not None and len(data) - end > limit:
            raise self._error(
                f"{name} frame of {len(data) - end} bytes, over the {limit}-byte chunk"
            )
        # Not self._frame(...): CPython 3.11 cannot specialise that method-style call on a slot.
        frame = self._frame
        return frame(kind, seq, meta, data[end:])
