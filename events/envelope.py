"""The stored envelope around a domain event, and the shape of an event waiting to be appended."""

from __future__ import annotations

import msgspec

from .catalog import DomainEvent, type_tag
from .ids import Entropy, uuid7


class Undecodable(msgspec.Struct, frozen=True, kw_only=True, tag="undecodable"):
    """A stored payload that could not be decoded: kept raw with the reason, never dropped."""

    raw: bytes
    error: str


class NewEvent(msgspec.Struct, frozen=True, kw_only=True):
    """An event on its way into the store: the store assigns version and position."""

    event_id: str
    payload: DomainEvent
    recorded_at: int  # ns since the Unix epoch, from the injected clock
    correlation_id: str = ""
    causation_id: str = ""

    @property
    def type(self) -> str:
        return type_tag(self.payload)


class Envelope(msgspec.Struct, frozen=True, kw_only=True):
    """A committed event. `position` is global commit order; `version` is 1-based per stream."""

    event_id: str
    stream: str
    version: int
    position: int
    type: str
    recorded_at: int
    correlation_id: str = ""
    causation_id: str = ""
    payload: DomainEvent | Undecodable


def new_event(
    payload: DomainEvent,
    *,
    wall_ns: int,
    entropy: Entropy,
    correlation_id: str = "",
    causation_id: str = "",
) -> NewEvent:
    """Stamp a payload with a fresh time-ordered id and the recorded-at time.

    A new correlation id defaults to the event's own id: the first event of a chain starts it.
    """
    event_id = uuid7(wall_ns, entropy)
    return NewEvent(
        event_id=event_id,
        payload=payload,
        recorded_at=wall_ns,
        correlation_id=correlation_id or event_id,
        causation_id=causation_id,
    )
