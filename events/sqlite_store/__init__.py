"""The durable event store: one SQLite file in WAL mode, written by one group-committing writer.

Design (the figures behind it: docs/performance.md, Event store):

- Exactly one writer connection, living in its own single-thread executor. `append()` only
  queues work; a dispatcher on the event loop hands up to `max_batch` queued appends at a time
  to that thread, which commits them in ONE transaction, so the fsync of `synchronous=FULL` is
  paid once per batch instead of once per append. One batch is in flight at a time: whatever
  queues meanwhile forms the next batch (group commit).
- Appends are validated against an in-memory cache of stream versions before anything is
  written, so a conflicting append fails alone and its batch-mates are written with a single
  `executemany`. The UNIQUE constraints stay as the backstop: if one ever fires, the batch is
  rolled back and replayed carefully, one SAVEPOINT per append, against fresh reads.
- Reads use a second connection in a second thread; WAL lets them run beside the writer.
- sqlite3 exceptions never leave this package: they become StoreFull or StoreIOError.

The modules, one job each:

- `store.py`: `SqliteEventStore`, the protocol, opening and closing; ties the rest together.
- `group_commit.py`: the event loop's side of the writer: the queue, batching, `StoreStats`.
- `writer.py`: the writer thread: the version cache, one transaction per batch, the careful
  replay. `compaction.py`: the heartbeat compaction it runs in a transaction alone.
- `reader.py`: the reader thread's queries. `tail.py`: the last commits, kept in memory for
  subscribers at the head.
- `schema.py`: the tables and their migrations. `rows.py`: events to rows and rows back to
  envelopes. `jobs.py`: the queued work and how it reports back. `failures.py`: which SQLite
  failures fail a batch and which fail one append.
"""

from .group_commit import StoreStats
from .schema import SCHEMA_VERSION
from .store import SqliteEventStore

__all__ = ["SCHEMA_VERSION", "SqliteEventStore", "StoreStats"]
