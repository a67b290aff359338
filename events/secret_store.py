"""Secret references in cluster specs, and the store their values live in.

A spec's `secret_env` maps a variable to a reference, never to a value, once the controller has
taken it (docs/security.md, Secrets):

- `secret:sha256:<hex>`: the value is in the controller's `SecretStore`, keyed by this digest
  (SHA-256 of the value's UTF-8 bytes). It reaches only the node that runs the replica, sealed
  to that node's key inside its StartReplica.
- `file:/absolute/path`: a file on the node, read by the agent when it starts the replica; the
  value never leaves the node.

Anything else a user writes is an inline value, which the controller moves into its store and
replaces by its reference before the spec is recorded or sent anywhere.

The store is a protocol, injected as the event store is: memory (the simulator and tests), a
SQLite file of its own beside the log (one machine; never the log's own file), and a JetStream
key-value bucket readable only by the controller role (wire/secret_kv.py), which standbys reach
too.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import sqlite3
from pathlib import Path
from typing import Protocol

import msgspec

from .cluster import ClusterSpec
from .errors import EventStoreError

SECRET_PREFIX = "secret:sha256:"
FILE_PREFIX = "file:"
_DIGEST = re.compile(r"^secret:sha256:[0-9a-f]{64}$")
# What `gpumesh events redact` takes for a secret in a spec's plain `env`.
SENSITIVE_NAME = re.compile(r"TOKEN|SECRET|KEY|PASSWORD", re.IGNORECASE)


def reference(value: str) -> str:
    """The reference a value is recorded as: `secret:sha256:<hex>`."""
    return SECRET_PREFIX + hashlib.sha256(value.encode()).hexdigest()


def is_reference(text: str) -> bool:
    return bool(_DIGEST.match(text))


def is_file(text: str) -> bool:
    return text.startswith(FILE_PREFIX)


def inline_names(spec: ClusterSpec) -> list[str]:
    """The `secret_env` names that hold a value rather than a reference (none once recorded)."""
    return [k for k, v in spec.secret_env.items() if not (is_reference(v) or is_file(v))]


def redact(spec: ClusterSpec) -> tuple[ClusterSpec, dict[str, str]]:
    """The spec with every inline `secret_env` value replaced by its reference, and the values
    to keep, by reference. Pure: storing them is the caller's."""
    values: dict[str, str] = {}
    refs: dict[str, str] = {}
    for name, value in spec.secret_env.items():
        if is_reference(value) or is_file(value):
            refs[name] = value
        else:
            ref = reference(value)
            values[ref] = value
            refs[name] = ref
    if not values:
        return spec, {}
    return msgspec.structs.replace(spec, secret_env=refs), values


def redact_env(spec: ClusterSpec) -> tuple[ClusterSpec, dict[str, str], list[str]]:
    """For `gpumesh events redact`: the spec with every plain `env` entry whose name looks like
    a secret (SENSITIVE_NAME) moved to `secret_env` as a reference; the values by reference;
    the names moved. A spec with nothing to move comes back unchanged (the same object)."""
    moved = sorted(name for name in spec.env if SENSITIVE_NAME.search(name))
    if not moved:
        return spec, {}, []
    env = {k: v for k, v in spec.env.items() if k not in moved}
    secret_env = dict(spec.secret_env)
    values: dict[str, str] = {}
    for name in moved:
        ref = reference(spec.env[name])
        values[ref] = spec.env[name]
        secret_env[name] = ref
    return msgspec.structs.replace(spec, env=env, secret_env=secret_env), values, moved


class SecretStoreError(EventStoreError):
    """The secret store cannot be read or written."""


class SecretStore(Protocol):
    """Secret values by reference (`secret:sha256:<hex>`)."""

    async def put(self, ref: str, value: str) -> None:
        """Keep `value` under `ref`; idempotent (the reference is the value's digest)."""
        ...

    async def get(self, ref: str) -> str | None:
        """The value kept under `ref`, or None."""
        ...


class MemorySecretStore:
    """The simulator's and the tests' store: a dict."""

    def __init__(self) -> None:
        self.values: dict[str, str] = {}

    async def put(self, ref: str, value: str) -> None:
        _check(ref, value)
        self.values[ref] = value

    async def get(self, ref: str) -> str | None:
        return self.values.get(ref)


class SqliteSecretStore:
    """One machine's store: a SQLite file of its own (mode 0600), never the event log's."""

    def __init__(self, path: Path) -> None:
        self.path = path

    @staticmethod
    def beside(events_db: Path) -> SqliteSecretStore:
        """The store that goes with an event log: `<log stem>.secrets.db` in its directory."""
        return SqliteSecretStore(events_db.with_name(events_db.stem + ".secrets.db"))

    def _connect(self) -> sqlite3.Connection:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if not self.path.exists():
                fd = os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600)
                os.close(fd)
            os.chmod(self.path, 0o600)
            db = sqlite3.connect(self.path)
            db.execute("CREATE TABLE IF NOT EXISTS secrets (ref TEXT PRIMARY KEY, value TEXT)")
        except (OSError, sqlite3.Error) as exc:
            raise SecretStoreError(f"secret store {self.path}: {exc}") from None
        return db

    def put_now(self, ref: str, value: str) -> None:
        _check(ref, value)
        try:
            with contextlib.closing(self._connect()) as db, db:
                db.execute("INSERT OR REPLACE INTO secrets VALUES (?, ?)", (ref, value))
        except sqlite3.Error as exc:
            raise SecretStoreError(f"secret store {self.path}: {exc}") from None

    def get_now(self, ref: str) -> str | None:
        try:
            with contextlib.closing(self._connect()) as db:
                row = db.execute("SELECT value FROM secrets WHERE ref = ?", (ref,)).fetchone()
        except sqlite3.Error as exc:
            raise SecretStoreError(f"secret store {self.path}: {exc}") from None
        return None if row is None else str(row[0])

    async def put(self, ref: str, value: str) -> None:
        await asyncio.to_thread(self.put_now, ref, value)

    async def get(self, ref: str) -> str | None:
        return await asyncio.to_thread(self.get_now, ref)


def _check(ref: str, value: str) -> None:
    if ref != reference(value):
        raise SecretStoreError(f"a secret's reference must be its digest, got {ref[:24]!r}")
