"""Errors raised by the event log. Driver errors are translated here, at the boundary."""

from __future__ import annotations


class EventStoreError(Exception):
    """Root of every error the event store raises."""


class ConcurrencyConflict(EventStoreError):
    """The stream was not at the version the writer expected: reload, re-decide, retry."""

    def __init__(self, stream: str, expected: int, actual: int) -> None:
        self.stream = stream
        self.expected = expected
        self.actual = actual
        super().__init__(
            f"concurrency conflict on {stream!r}: expected version {expected}, "
            f"stream is at {actual}"
        )


class DuplicateEventId(EventStoreError):
    """An event id is already stored under another stream or batch: ids are global."""

    def __init__(self, event_id: str) -> None:
        self.event_id = event_id
        super().__init__(f"event id {event_id} is already stored with different contents")


class InvalidAppend(EventStoreError, ValueError):
    """The append itself is malformed (wrong stream for an event, bad stream name)."""


class StoreFull(EventStoreError):
    """The disk under the store is full. Nothing of the failed batch was written."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"event store {path} cannot write: the disk is full (nothing was written; "
            "free space and retry)"
        )


class StoreClosed(EventStoreError):
    """The store was closed; no further appends or reads."""

    def __init__(self) -> None:
        super().__init__("the event store is closed")


class TermEnded(EventStoreError):
    """A newer leadership term is recorded in the log: this writer's term is over and its
    append was refused whole (nothing of it was written)."""


class StoreIOError(EventStoreError):
    """Any other storage failure, with the driver's message."""


class LogNotFound(EventStoreError):
    """A command was pointed at a data directory with no event log in it."""

    def __init__(self, path: str) -> None:
        self.path = path
        super().__init__(
            f"no event log at {path} (start a stack there, run `gpumesh events generate`, "
            "or pass --data-dir)"
        )
