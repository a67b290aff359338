"""Where the log lives on NATS: the stream, its subjects, and how a log stream maps to a subject."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

_NAME: Final = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TOKEN: Final = re.compile(r"^[A-Za-z0-9_-]+$")
STORAGES: Final = ("file", "memory")

# The server refuses an atomic batch of more than this many messages (error 10199).
MAX_BATCH: Final = 1000


@dataclass(frozen=True, slots=True)
class JetStreamOptions:
    """How the store lays the log out on JetStream.

    `stream` holds every event, one message each, on `<subject_prefix>.<kind>.<id>`. Snapshots
    go to the key-value bucket `snapshot_bucket` (default `<stream>_SNAPSHOTS`).
    `duplicate_window_s` is JetStream's own window for `Nats-Msg-Id`: the server keeps every id
    that long, so it costs server memory in proportion to the append rate.
    `max_inflight_batches` stays under the server's limit of 50 atomic batches in flight per
    stream; beyond it the server abandons batches (error 10176).
    """

    stream: str = "GPUMESH_LOG"
    subject_prefix: str = "gpumesh.v1.log"
    replicas: int = 1
    storage: str = "file"
    snapshot_bucket: str = ""
    duplicate_window_s: float = 120.0
    request_timeout_s: float = 10.0
    # A single publish unanswered this long, when the connection has moved to another server
    # since it was sent, is sent once more (jsapi.py, Api._resend): its server may have died
    # with it.
    resend_after_s: float = 1.0
    max_inflight_batches: int = 32

    def __post_init__(self) -> None:
        if not _NAME.match(self.stream):
            raise ValueError(f"stream name {self.stream!r}: use 1-64 of [A-Za-z0-9_-]")
        if self.snapshot_bucket and not _NAME.match(self.snapshot_bucket):
            raise ValueError(f"snapshot bucket {self.snapshot_bucket!r}: use [A-Za-z0-9_-]")
        if not all(_TOKEN.match(token) for token in self.subject_prefix.split(".")):
            raise ValueError(
                f"subject prefix {self.subject_prefix!r}: dot-separated tokens of [A-Za-z0-9_-]"
            )
        if self.storage not in STORAGES:
            raise ValueError(f"storage must be one of {STORAGES}, not {self.storage!r}")
        if not 1 <= self.replicas <= 5:
            raise ValueError(f"replicas must be 1 to 5, not {self.replicas}")
        if not 1 <= self.max_inflight_batches <= 50:
            raise ValueError("max_inflight_batches must be 1 to 50 (the server's own limit)")
        if self.request_timeout_s <= 0 or self.duplicate_window_s <= 0:
            raise ValueError("request_timeout_s and duplicate_window_s must be positive")
        if self.resend_after_s <= 0:
            raise ValueError("resend_after_s must be positive")

    @property
    def bucket(self) -> str:
        return self.snapshot_bucket or f"{self.stream}_SNAPSHOTS"

    @property
    def filter(self) -> str:
        """Every subject of the log."""
        return f"{self.subject_prefix}.>"

    def subject(self, stream: str) -> str:
        """`node/a` -> `<prefix>.node.a`. The stream must already be valid (catalog rules)."""
        return f"{self.subject_prefix}.{stream.replace('/', '.', 1)}"

    def stream_of(self, subject: str) -> str:
        return subject[len(self.subject_prefix) + 1 :].replace(".", "/", 1)
