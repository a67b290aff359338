"""`gpumesh events redact`: take secrets written in clear out of an existing SQLite log.

Logs written before `secret_env` existed hold a spec's whole `env`, so an `HF_TOKEN` or an API
key given there is stored in clear. This rewrites every stored spec (`cluster.created.v1`,
`cluster.spec_changed.v1`) whose `env` has names that look like secrets (TOKEN, SECRET, KEY,
PASSWORD, any case): each such entry moves to `secret_env` as its reference
(`secret:sha256:<hex>`), and its value into the secret store beside the log
(`<log stem>.secrets.db`, mode 0600), where the controller finds it. Before writing it copies
the log whole to `<log>.before-redact-<UTC time>` (mode 0600: it holds the values in clear).

The rows are rewritten in place (same positions, versions and event ids), with SQLite's
`secure_delete` on, then the WAL is checkpointed and the file vacuumed, so no page of the file
keeps the old bytes. The cluster actors' snapshots of the streams changed are dropped (a
snapshot is a cache: the actor folds its stream again). Run it with the controller stopped.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sqlite3
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from .cluster import ClusterCreated, ClusterSpecChanged
from .codec import decode_payload, encode_payload
from .errors import LogNotFound, StoreIOError
from .secret_store import SqliteSecretStore, redact_env

_SPEC_TYPES = ("cluster.created.v1", "cluster.spec_changed.v1")


@dataclass(frozen=True, slots=True)
class Change:
    """One stored spec rewritten: which cluster, revision and row, and the names moved."""

    cluster: str
    revision: int
    position: int
    type: str
    moved: tuple[str, ...]

    def line(self) -> str:
        names = ", ".join(self.moved)
        return (
            f"cluster {self.cluster} revision {self.revision} (position {self.position}, "
            f"{self.type}): moved {names} from env to secret_env"
        )


@dataclass(slots=True)
class Report:
    log: Path
    changes: list[Change] = field(default_factory=list)
    backup: Path | None = None
    secrets: Path | None = None
    snapshots_dropped: int = 0
    dry_run: bool = False

    def as_json(self) -> dict[str, object]:
        return {
            "log": str(self.log),
            "dry_run": self.dry_run,
            "backup": str(self.backup) if self.backup else None,
            "secret_store": str(self.secrets) if self.secrets else None,
            "snapshots_dropped": self.snapshots_dropped,
            "changed": [
                {
                    "cluster": c.cluster,
                    "revision": c.revision,
                    "position": c.position,
                    "type": c.type,
                    "moved": list(c.moved),
                }
                for c in self.changes
            ],
        }


def redact_log(path: Path, *, stamp: str, dry_run: bool = False) -> Report:
    """Rewrite the specs in the SQLite log at `path` (see the module's doc). `stamp` names the
    backup (a UTC time, `20261126T040000Z`). Idempotent: a second run changes nothing."""
    if not path.exists():
        raise LogNotFound(str(path))
    report = Report(log=path, dry_run=dry_run)
    try:
        conn = sqlite3.connect(path, isolation_level=None)
    except sqlite3.Error as exc:
        raise StoreIOError(f"event store {path}: {exc}") from None
    with contextlib.closing(conn):
        try:
            rewrites, values = _plan(conn, report)
            if dry_run or not rewrites:
                return report
            report.backup = _backup(conn, path, stamp)
            store = SqliteSecretStore.beside(path)
            for ref, value in values.items():
                store.put_now(ref, value)
            report.secrets = store.path
            report.snapshots_dropped = _rewrite(conn, rewrites, report)
        except sqlite3.Error as exc:
            raise StoreIOError(f"event store {path}: {exc}") from None
    return report


def _plan(conn: sqlite3.Connection, report: Report) -> tuple[dict[int, bytes], dict[str, str]]:
    rewrites: dict[int, bytes] = {}
    values: dict[str, str] = {}
    revisions: dict[str, int] = {}
    rows = conn.execute(
        "SELECT position, type, data FROM events WHERE type IN (?, ?) ORDER BY position",
        _SPEC_TYPES,
    )
    for position, type_, data in rows:
        done = redact_spec_event(decode_payload(type_, bytes(data)), revisions)
        if done is None:
            continue  # not a spec (undecodable: left as it is, a rebuild reports it)
        rewritten, found, change = done
        if change is None:
            continue  # nothing in its env looks like a secret
        rewrites[position] = encode_payload(rewritten)
        values.update(found)
        report.changes.append(dataclasses.replace(change, position=position, type=type_))
    return rewrites, values


def redact_spec_event(
    payload: object, revisions: dict[str, int]
) -> tuple[ClusterCreated | ClusterSpecChanged, dict[str, str], Change | None] | None:
    """A stored spec with its env's secrets moved to `secret_env` references: the event
    rewritten, the values moved (reference -> value), and what moved (None: nothing did).
    None for any other payload. `revisions` (cluster -> its last revision) is read and kept
    up to date, for the report: call it on the log's specs in order. Shared by the SQLite and
    the JetStream logs' redaction."""
    if isinstance(payload, ClusterCreated):
        revision = 1
        name = payload.spec.name
    elif isinstance(payload, ClusterSpecChanged):
        name = payload.spec.name
        revision = payload.revision or revisions.get(name, 0) + 1
    else:
        return None
    revisions[name] = revision
    new_spec, found, moved = redact_env(payload.spec)
    rewritten = msgspec.structs.replace(payload, spec=new_spec)
    change = Change(name, revision, 0, "", tuple(moved)) if moved else None
    return rewritten, found, change


def _backup(conn: sqlite3.Connection, path: Path, stamp: str) -> Path:
    backup = path.with_name(f"{path.name}.before-redact-{stamp}")
    fd = os.open(backup, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    os.close(fd)
    with contextlib.closing(sqlite3.connect(backup)) as target:
        conn.backup(target)
    os.chmod(backup, 0o600)
    return backup


def _rewrite(conn: sqlite3.Connection, rewrites: dict[int, bytes], report: Report) -> int:
    conn.execute("PRAGMA secure_delete = ON")  # freed pages are zeroed, not left as they were
    conn.execute("BEGIN IMMEDIATE")
    try:
        for position, data in rewrites.items():
            conn.execute("UPDATE events SET data = ? WHERE position = ?", (data, position))
        streams = sorted({f"cluster/{c.cluster}" for c in report.changes})
        dropped = 0
        for stream in streams:
            dropped += conn.execute("DELETE FROM snapshots WHERE stream = ?", (stream,)).rowcount
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.execute("VACUUM")
    return dropped
