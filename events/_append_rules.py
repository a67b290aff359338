"""Checks every store applies before writing, so both stores refuse the same things."""

from __future__ import annotations

from collections.abc import Sequence

from .catalog import check_stream, stream_of
from .envelope import NewEvent
from .errors import InvalidAppend
from .store import ANY


def check_batch(stream: str, events: Sequence[NewEvent], expected_version: int) -> None:
    check_stream(stream)
    if expected_version < ANY:
        raise InvalidAppend(
            f"expected_version {expected_version} is not a version, NO_STREAM (0) or ANY (-1)"
        )
    seen: set[str] = set()
    for event in events:
        owner = stream_of(event.payload)
        if owner != stream:
            raise InvalidAppend(f"{event.type} belongs to stream {owner!r}, not {stream!r}")
        if event.event_id in seen:
            raise InvalidAppend(f"event id {event.event_id} appears twice in one append")
        seen.add(event.event_id)
