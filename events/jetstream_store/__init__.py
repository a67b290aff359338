"""The event store on a JetStream stream: the log replicated by NATS itself, for a controller
that can fail over without a shared disk.

Design (figures: docs/performance.md, JetStream store):

- One stream (`GPUMESH_LOG`) holds every event, one message each, on the subject
  `<prefix>.<kind>.<id>` of its log stream (`gpumesh.v1.log.node.a` for `node/a`). The global
  position is the JetStream stream sequence; a log stream is read by subject.
- Optimistic concurrency per log stream: every append is a conditional publish
  (`Nats-Expected-Last-Subject-Sequence` = the sequence of the stream's last event, 0 for a new
  stream). The version travels in a header (`Gpumesh-Stream-Version`). A writer that did not
  see another's append is refused by the server itself (error 10071), so two controllers can
  never both extend a stream: the fencing high availability relies on. On a refusal the store
  reads what it missed and answers as the memory store would (ConcurrencyConflict with the
  real version, the original positions of a retry, or, with ANY, a new try).
- Fenced on a term (`fence`, a leader's store: actors/fenced_store.py): every append is
  conditional instead on `leadership/terms` still ending at the leader's own term record
  (`Nats-Expected-Last-Subject-Sequence-Subject` names that subject; nats-server 2.11+), one
  expectation per message being all the server takes. A newer term's record makes the server
  refuse every append of the old one (TermEnded). The stream versions are then checked by the
  writer against its index, which `fence` made exact up to the record (it reads what the
  index had not seen; `LogIndex.learned_through` says how far it had) and which only this
  writer can extend after it.
- One fenced publish in flight at a time: a clustered stream takes one conditional publish per
  subject checked while it is replicated, answering any other 10164, and every fenced append
  checks the terms subject. So a fenced writer's appends wait in order and go out as group
  commits (commits.py): whatever waits, as one atomic batch of up to 1,000 events across
  streams fenced on its first message, one replication round per lot, not per append (before:
  45% of a hundred heartbeats refused, on three servers).
- Atomic appends: an append of several events is one atomic batch (ADR-50, nats-server 2.12+:
  `allow_atomic`, `Nats-Batch-Id`/`-Sequence`/`-Commit`, the commit acknowledged), stored at
  consecutive sequences or not at all. Found on nats-server 2.15.1: the batch takes the
  expected-subject-sequence check on its first message, checked against the stream as it was
  before the batch (on a later message of the same subject the server refuses the batch,
  10164); a refused batch uses no sequence; with more than 50 batches in flight on a stream
  the server abandons the excess (10176, so the store keeps at most 32 in flight); a batch
  holds at most 1,000 messages (10199: so does an append here, InvalidAppend beyond); and a
  batch that repeats a `Nats-Msg-Id` the server remembers is refused whole (10201) where a
  single publish is answered "duplicate" with the original sequence.
- Appends leave in the order they were made (writer.py, Turns), so positions follow call
  order as in the other stores; appends to different streams are in flight together, and
  `append_many` sends all its appends before it awaits the first acknowledgement.
- Idempotency: `Nats-Msg-Id` is the event id (the server's duplicate window), and the store
  keeps its own index of the ids in the log, so a retry returns the original positions and
  writes nothing however late it comes; an id reused in another stream raises
  DuplicateEventId. The index (ids, each stream's last sequence and version, each heartbeat
  stream's live heartbeats) is rebuilt at open from a headers-only read of the stream: about
  40,000 events/s on the bench machine, so a log of a million events opens in half a minute,
  and it costs memory in proportion to the live events, as the memory store does.
- The server's window outlives compaction: it still knows the id of a heartbeat compacted away.
  The store re-appends such an id without `Nats-Msg-Id`; after a restart it no longer knows
  which ids those are, meets the server's duplicate answer, and writes the event after it
  (tests/contract/test_jetstream_store.py: test_jetstream_rewrites_a_compacted_id_late).
- Reads are batch direct gets (`allow_direct`): on R3 a follower may answer, so a read that
  stops short of a sequence this store saw acknowledged is asked again. Subscribers take
  this store's own appends from an in-memory tail of its last acknowledged ones, and read
  the rest (another writer's, or what is older) with the same direct gets; past all it
  knows, they ask the server again every 10-100 ms (follow.py). Heartbeat compaction purges
  per heartbeat subject below a sequence bound, so the positions of what remains do not
  change. Snapshots live in a key-value bucket, one key per log stream.

The modules: `store.py` (the class, reads, compaction, snapshots), `writer.py` (appends),
`index.py` (versions, ids and heartbeats in memory; the scan at open), `follow.py`
(subscriptions), `tail.py` (the store's own latest appends, for its subscribers),
`jsapi.py` (the JetStream requests and error translation), `messages.py` (an event as a
message), `options.py` (names and limits).
"""

from .options import JetStreamOptions
from .store import JetStreamEventStore

__all__ = ["JetStreamEventStore", "JetStreamOptions"]
