"""One event as one JetStream message, and back.

What the store must read without the body (the scan at open, compaction, rebuild filtering)
travels in headers: the event id (`Nats-Msg-Id`, which the server also deduplicates on), the
stream version and recorded-at. The body is the rest: type, correlation and causation ids and
the payload's JSON, as a JSON array. The stream is the subject; the position is the stream
sequence the server assigned.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import msgspec

from events.codec import decode_payload, encode_payload
from events.envelope import Envelope, NewEvent, Undecodable

MSG_ID: Final = "Nats-Msg-Id"
# Carries the id instead of Nats-Msg-Id when an event must be written again past the server's
# memory of a compacted one (see writer.py): the server would otherwise call it a duplicate.
EVENT_ID: Final = "Gpumesh-Event-Id"
VERSION: Final = "Gpumesh-Stream-Version"
RECORDED_AT: Final = "Gpumesh-Recorded-At"
EXPECTED_LAST_SUBJECT_SEQ: Final = "Nats-Expected-Last-Subject-Sequence"
# With it, the expected sequence is that of the last message on this subject instead of the
# message's own: how a leader's appends are made conditional on its term record (store.fence).
EXPECTED_SUBJECT: Final = "Nats-Expected-Last-Subject-Sequence-Subject"
BATCH_ID: Final = "Nats-Batch-Id"
BATCH_SEQ: Final = "Nats-Batch-Sequence"
BATCH_COMMIT: Final = "Nats-Batch-Commit"


class _Body(msgspec.Struct, array_like=True):
    type: str
    correlation_id: str
    causation_id: str
    payload: msgspec.Raw


_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(_Body)


def body(event: NewEvent) -> bytes:
    raw = msgspec.Raw(encode_payload(event.payload))
    return _encoder.encode(_Body(event.type, event.correlation_id, event.causation_id, raw))


def headers(event: NewEvent, version: int, *, dedupe: bool = True) -> dict[str, str]:
    return {
        MSG_ID if dedupe else EVENT_ID: event.event_id,
        VERSION: str(version),
        RECORDED_AT: str(event.recorded_at),
    }


def event_id_of(hdrs: Mapping[str, str]) -> str:
    return hdrs.get(MSG_ID) or hdrs.get(EVENT_ID) or ""


def version_of(hdrs: Mapping[str, str]) -> int:
    return _int(hdrs.get(VERSION))


def recorded_at_of(hdrs: Mapping[str, str]) -> int:
    return _int(hdrs.get(RECORDED_AT))


def _int(text: str | None) -> int:
    # A message someone else published on our subjects has none of our headers: it reads as
    # version 0 with an undecodable payload instead of stopping every reader of the log.
    try:
        return int(text) if text is not None else 0
    except ValueError:
        return 0


def envelope(stream: str, position: int, hdrs: Mapping[str, str], data: bytes) -> Envelope:
    """Never raises: a body that is not ours comes back as an Undecodable payload."""
    try:
        stored = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        error = " ".join(f"{type(exc).__name__}: {exc}".split())
        return Envelope(
            event_id=event_id_of(hdrs),
            stream=stream,
            version=version_of(hdrs),
            position=position,
            type="",
            recorded_at=recorded_at_of(hdrs),
            payload=Undecodable(raw=bytes(data), error=error),
        )
    return Envelope(
        event_id=event_id_of(hdrs),
        stream=stream,
        version=version_of(hdrs),
        position=position,
        type=stored.type,
        recorded_at=recorded_at_of(hdrs),
        correlation_id=stored.correlation_id,
        causation_id=stored.causation_id,
        payload=decode_payload(stored.type, bytes(stored.payload)),
    )
