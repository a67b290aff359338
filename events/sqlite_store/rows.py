"""The row codec: events to the rows the writer binds, and stored rows back to envelopes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Final

from events.codec import decode_payload, encode_payload
from events.envelope import Envelope, NewEvent, Undecodable
from events.errors import InvalidAppend

INT64_MIN: Final = -(2**63)
INT64_MAX: Final = 2**63 - 1

# A row as the writer binds it, in schema.COLUMNS order. `append()` builds it on the loop thread
# with position and version left at 0; the writer thread fills both in place when it plans the
# batch.
Row = list[Any]


def clamp(value: int) -> int:
    """Positions, versions and times are stored in 64 bits: a bound past them means "all"."""
    return min(max(value, INT64_MIN), INT64_MAX)


def check_storable(events: Sequence[NewEvent]) -> None:
    """Refuse, before it is queued, what SQLite could not bind: it would fail a whole batch."""
    for e in events:
        if type(e.recorded_at) is not int or not INT64_MIN <= e.recorded_at <= INT64_MAX:
            raise InvalidAppend(f"recorded_at {e.recorded_at!r} is not a 64-bit integer")
        if not (type(e.event_id) is type(e.correlation_id) is type(e.causation_id) is str):
            for name in ("event_id", "correlation_id", "causation_id"):
                if type(getattr(e, name)) is not str:
                    raise InvalidAppend(f"{name} {getattr(e, name)!r} is not a string")


def new_rows(stream: str, events: Sequence[NewEvent]) -> list[Row]:
    # Built on the loop thread, so the writer thread, through which every write must pass, only
    # numbers and binds them.
    return [
        [
            0,
            e.event_id,
            stream,
            0,
            e.type,
            e.recorded_at,
            e.correlation_id,
            e.causation_id,
            encode_payload(e.payload),
        ]
        for e in events
    ]


def as_bytes(value: object) -> bytes:
    """Hand-edited or damaged rows can hold TEXT or NULL where a BLOB belongs."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if value is None:
        return b""
    return str(value).encode()


def to_envelope(row: Sequence[Any]) -> Envelope:
    position, event_id, stream, version, type_, recorded_at, correlation, causation, data = row
    if (
        type(data) is bytes
        and type(type_) is str
        and type(event_id) is str
        and type(stream) is str
        and type(version) is int
        and type(recorded_at) is int
    ):
        return Envelope(
            event_id=event_id,
            stream=stream,
            version=version,
            position=position,
            type=type_,
            recorded_at=recorded_at,
            correlation_id=correlation or "",
            causation_id=causation or "",
            payload=decode_payload(type_, data),
        )
    return _damaged_envelope(row)


def _damaged_envelope(row: Sequence[Any]) -> Envelope:
    """A row to_envelope found a column of the wrong type in."""
    position, event_id, stream, version, type_, recorded_at, correlation, causation, data = row
    if type(data) is not bytes:
        data = as_bytes(data)
    type_tag = type_ if type(type_) is str else ("" if type_ is None else str(type_))
    # A damaged row (a column not of the schema's type) reads back in place as Undecodable,
    # with safe values, rather than handing a fold or an actor bytes where it expects text.
    wrong = [
        name
        for name, value, kind in (
            ("event_id", event_id, str),
            ("stream", stream, str),
            ("version", version, int),
            ("recorded_at", recorded_at, int),
        )
        if type(value) is not kind
    ]
    if wrong:
        return Envelope(
            event_id=event_id if type(event_id) is str else "",
            stream=stream if type(stream) is str else "",
            version=version if type(version) is int else 0,
            position=position,
            type=type_tag,
            recorded_at=recorded_at if type(recorded_at) is int else 0,
            payload=Undecodable(
                raw=data, error=f"damaged row: {', '.join(wrong)} not of the schema's type"
            ),
        )
    # Only the payload or its type tag was off: read as a clean row, which decodes what it can.
    return to_envelope(
        (position, event_id, stream, version, type_tag, recorded_at, correlation, causation, data)
    )
