"""Payload encoding (msgspec JSON) and the upcaster chain applied on read.

Rules (docs/schema-evolution.md): a new field gets a default; a changed meaning gets a new
tag plus an upcaster registered here, so old rows keep decoding. Stored rows are never rewritten.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from .catalog import DomainEvent
from .envelope import Envelope, Undecodable

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[DomainEvent] = msgspec.json.Decoder(DomainEvent)
_envelope_encoder = msgspec.json.Encoder()
_envelope_decoder = msgspec.json.Decoder(Envelope)

Upcaster = Callable[[dict[str, Any]], dict[str, Any]]

# old tag -> function turning the old payload dict into the next version's dict (with its tag).
UPCASTERS: dict[str, Upcaster] = {}


def encode_payload(event: DomainEvent) -> bytes:
    return _encoder.encode(event)


def decode_payload(type_tag: str, data: bytes) -> DomainEvent | Undecodable:
    """Decode one stored payload. Never raises: bad data comes back as Undecodable."""
    try:
        if type_tag in UPCASTERS:
            return _upcast(type_tag, data)
        return _decoder.decode(data)
    except (
        msgspec.DecodeError,
        msgspec.ValidationError,
        LookupError,
        TypeError,
        ValueError,
        AttributeError,  # an upcaster written for a dict, handed a list or a string
    ) as exc:
        error = " ".join(f"{type(exc).__name__}: {exc}".split())
        return Undecodable(raw=bytes(data), error=error)


def _upcast(type_tag: str, data: bytes) -> DomainEvent:
    raw: dict[str, Any] = msgspec.json.decode(data)
    tag = type_tag
    seen = 0
    while tag in UPCASTERS:
        raw = UPCASTERS[tag](raw)
        tag = raw["type"]
        seen += 1
        if seen > 64:
            raise ValueError(f"upcaster loop from {type_tag}")
    event: DomainEvent = msgspec.convert(raw, DomainEvent)
    return event


def encode_envelope(envelope: Envelope) -> bytes:
    """The wire form used on NATS and in exports: the whole envelope as JSON."""
    return _envelope_encoder.encode(envelope)


def decode_envelope(data: bytes) -> Envelope:
    return _envelope_decoder.decode(data)
