"""Fold everything a store has committed into a state: the one paging loop every reader shares."""

from __future__ import annotations

from events import EventStore
from events.store import RebuildReader

from . import fleet
from .views import FleetState


async def fold_log(
    store: EventStore,
    state: FleetState,
    *,
    page_size: int = 10_000,
    skip_superseded_heartbeats: bool = False,
) -> int:
    """Fold every event after `state.position` into `state`; return how many were folded.

    With `skip_superseded_heartbeats` and a store that is a RebuildReader, heartbeats a later one
    of the same node supersedes are not even decoded: the state is the same (docs/performance.md
    says which tests prove it), and a log that is mostly heartbeats folds many times faster.
    """
    fast = store if skip_superseded_heartbeats and isinstance(store, RebuildReader) else None
    folded = 0
    while True:
        position = state.position + 1
        if fast is not None:
            page = await fast.read_for_rebuild(position, page_size)
        else:
            page = await store.read_all(position, page_size)
        for envelope in page:
            fleet.apply(state, envelope)
        folded += len(page)
        if len(page) < page_size:
            return folded
