"""The work queued for the writer thread, and how each job reports back to its caller."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, TypeVar

from events.errors import EventStoreError
from events.store import Snapshot

from .rows import Row

T = TypeVar("T")


def _settle(future: asyncio.Future[T], error: BaseException | None, result: T) -> None:
    """Resolve a job's future on the loop thread, unless its caller already gave up on it."""
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


@dataclass(slots=True, eq=False)
class Group:
    """The appends of one append_many: one future for all of them, resolved by the last."""

    future: asyncio.Future[None]
    results: list[list[int] | EventStoreError]
    waiting: int = 0

    def settle(self, index: int, error: BaseException | None, positions: list[int]) -> None:
        if self.future.done():
            return
        if error is None:
            self.results[index] = positions
        elif isinstance(error, EventStoreError):
            self.results[index] = error
        else:  # a bug, not a storage outcome: the caller sees it raised
            self.future.set_exception(error)
            return
        self.waiting -= 1
        if self.waiting == 0:
            self.future.set_result(None)


@dataclass(slots=True, eq=False)
class Append:
    stream: str
    expected: int
    rows: list[Row]
    future: asyncio.Future[Any]
    positions: list[int] | None = None
    error: BaseException | None = None
    wrote: bool = False
    group: Group | None = None  # set when this append is one of an append_many
    index: int = 0

    def settle(self) -> None:
        assert self.error is not None or self.positions is not None
        if self.group is None:
            _settle(self.future, self.error, self.positions or [])
        else:
            self.group.settle(self.index, self.error, self.positions or [])


@dataclass(slots=True, eq=False)
class SaveSnapshot:
    snapshot: Snapshot
    future: asyncio.Future[None]
    error: BaseException | None = None

    def settle(self) -> None:
        _settle(self.future, self.error, None)


@dataclass(slots=True, eq=False)
class Compact:
    older_than_ns: int
    future: asyncio.Future[int]
    removed: int = 0
    error: BaseException | None = None

    def settle(self) -> None:
        _settle(self.future, self.error, self.removed)


Job = Append | SaveSnapshot | Compact


@dataclass(slots=True)
class BatchOutcome:
    committed: bool = False
    appends: int = 0
    events: int = 0
    careful: bool = False
