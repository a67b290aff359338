"""`gpumesh events redact` on a JetStream log: the secrets of older specs out of the stream.

A JetStream message cannot be changed, so the stream is written again, with every position
kept (a projection's checkpoint, a subscriber's cursor and the outbox's all name positions):

1. every message is read in order, and the stored specs (`cluster.created.v1`,
   `cluster.spec_changed.v1`) whose `env` holds names that look like secrets are rewritten as
   the SQLite log's are (events/redact.py): each such entry moves to `secret_env` as its
   reference, and its value into the controller's secret store;
2. the whole stream is written to a local backup file first (`--backup DIR`, mode 0600: it
   holds the values in clear), one JSON line per message, which `--restore FILE` writes back;
3. each message being rewritten is erased in place (the server overwrites its bytes), then the
   stream is deleted and created again with its own configuration, from its first sequence;
4. every message is published again in order, with its subject, headers and body (the
   rewritten body where it changed); a gap in the sequences (heartbeats compacted away, a
   message deleted) is kept by publishing a filler there and deleting it, so each message
   lands at the position it had; any other position is an error that names the backup;
5. the snapshots of the clusters whose specs changed are dropped (a snapshot is a cache).

Run it with every controller stopped: nothing may append meanwhile. It is idempotent: a second
run finds nothing to change and writes nothing.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from nats.aio.client import Client
from nats.js.errors import NotFoundError

from events.codec import decode_payload, encode_payload
from events.errors import StoreIOError
from events.redact import Change, Report, redact_spec_event

from .jsapi import Api, sequence_of, subject_of
from .messages import MSG_ID
from .options import JetStreamOptions

_FILLER = "redact-filler"  # the last token of a gap's filler subject
PAGE = 500


class _Body(msgspec.Struct, array_like=True):
    type: str
    correlation_id: str
    causation_id: str
    payload: msgspec.Raw


class Stored(msgspec.Struct, frozen=True, kw_only=True):
    """One message of the stream, as the backup file holds it (data in base64). Its headers
    are the ones it was published with, but for the server's requests and answers (`Nats-`,
    the expected sequences and batch markers above all, which a second publish must not be
    checked against) except the event id, `Nats-Msg-Id`."""

    seq: int
    subject: str
    headers: dict[str, str] = {}
    data: str = ""

    def body(self) -> bytes:
        return base64.b64decode(self.data)


Progress = Callable[[str], None]


@dataclass(slots=True)
class Plan:
    messages: list[Stored]
    rewrites: dict[int, bytes]  # seq -> the new body
    values: dict[str, str]  # secret reference -> value


async def read_stream(nc: Client, options: JetStreamOptions) -> list[Stored]:
    """Every message of the stream in order, with the headers it was published with (the
    server's own, added to a read, left out)."""
    api = Api(nc, options)
    await api.start()
    try:
        last, count = await api.last_sequence()
        found: list[Stored] = []
        seq = 1
        while count and seq <= last:
            page = await api.read(seq, PAGE)
            if not page:
                break
            for msg in page:
                headers = {
                    k: v
                    for k, v in (msg.headers or {}).items()
                    if not k.startswith("Nats-") or k == MSG_ID
                }
                found.append(
                    Stored(
                        seq=sequence_of(msg),
                        subject=subject_of(msg),
                        headers=headers,
                        data=base64.b64encode(msg.data or b"").decode(),
                    )
                )
            seq = found[-1].seq + 1
        return found
    finally:
        await api.stop()


def plan(messages: Sequence[Stored], report: Report) -> Plan:
    """What to rewrite: each stored spec with secrets in its env (as the SQLite log's)."""
    rewrites: dict[int, bytes] = {}
    values: dict[str, str] = {}
    revisions: dict[str, int] = {}
    for m in messages:
        try:
            stored = msgspec.json.decode(m.body(), type=_Body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            continue  # not an event of ours: written back as it was
        payload = decode_payload(stored.type, bytes(stored.payload))
        done = redact_spec_event(payload, revisions)
        if done is None:
            continue
        rewritten, found, change = done
        if change is None:
            continue
        body = msgspec.json.encode(
            _Body(
                stored.type,
                stored.correlation_id,
                stored.causation_id,
                msgspec.Raw(encode_payload(rewritten)),
            )
        )
        rewrites[m.seq] = body
        values.update(found)
        report.changes.append(
            Change(change.cluster, change.revision, m.seq, stored.type, change.moved)
        )
    return Plan(list(messages), rewrites, values)


def write_backup(messages: Sequence[Stored], path: Path) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    encoder = msgspec.json.Encoder()
    with os.fdopen(fd, "wb") as out:
        for m in messages:
            out.write(encoder.encode(m) + b"\n")
        out.flush()
        os.fsync(out.fileno())


def read_backup(path: Path) -> list[Stored]:
    decoder = msgspec.json.Decoder(Stored)
    with path.open("rb") as lines:
        return [decoder.decode(line) for line in lines if line.strip()]


async def erase(nc: Client, options: JetStreamOptions, seqs: Sequence[int]) -> None:
    """Overwrite the messages at `seqs` on the server's disk before the stream goes."""
    jsm = nc.jsm(timeout=options.request_timeout_s)
    for seq in seqs:
        with contextlib.suppress(NotFoundError):
            await jsm.delete_msg(options.stream, seq)


async def rewrite_stream(
    nc: Client,
    options: JetStreamOptions,
    messages: Sequence[Stored],
    rewrites: dict[int, bytes],
    backup: Path,
    progress: Progress,
) -> None:
    """Delete the stream, create it again with its own configuration, and publish every
    message back at its own sequence (`rewrites`' bodies where given)."""
    js = nc.jetstream(timeout=options.request_timeout_s)
    jsm = nc.jsm(timeout=options.request_timeout_s)
    info = await js.stream_info(options.stream)
    config = info.config
    await jsm.delete_stream(options.stream)
    first = messages[0].seq if messages else info.state.last_seq + 1
    config.first_seq = first
    await jsm.add_stream(config)
    filler = f"{options.subject_prefix}.{_FILLER}"
    expected = first
    for n, m in enumerate(messages, start=1):
        while expected < m.seq:
            # A gap: take the sequence with a filler and delete it, so that the next message
            # lands where it was.
            ack = await js.publish(filler, b"", stream=options.stream)
            await jsm.delete_msg(options.stream, ack.seq)
            expected = ack.seq + 1
        ack = await js.publish(
            m.subject, rewrites.get(m.seq, m.body()), stream=options.stream, headers=m.headers
        )
        if ack.seq != m.seq:
            raise StoreIOError(
                f"NATS stream {options.stream}: message {m.seq} written back at {ack.seq}; "
                f"restore it with `gpumesh events redact --restore {backup}`"
            )
        expected = ack.seq + 1
        if n % 10_000 == 0:
            progress(f"written back {n} of {len(messages)} messages")


async def drop_snapshots(nc: Client, options: JetStreamOptions, clusters: Sequence[str]) -> int:
    js = nc.jetstream(timeout=options.request_timeout_s)
    try:
        kv = await js.key_value(options.bucket)
    except Exception:
        return 0
    dropped = 0
    for name in clusters:
        key = f"cluster.{name}"
        with contextlib.suppress(Exception):
            await kv.purge(key)
            dropped += 1
    return dropped


async def redact_jetstream(
    nc: Client,
    options: JetStreamOptions,
    *,
    backup_dir: Path,
    stamp: str,
    store_value: Callable[[str, str], Any],
    dry_run: bool = False,
    progress: Progress = print,
) -> Report:
    """The whole procedure of the module's doc on the stream `options.stream`."""
    progress(f"reading NATS stream {options.stream}")
    messages = await read_stream(nc, options)
    report = Report(log=Path(f"nats:{options.stream}"), dry_run=dry_run)
    found = plan(messages, report)
    if dry_run or not found.rewrites:
        return report
    report.backup = backup_dir / f"{options.stream}.before-redact-{stamp}.jsonl"
    try:
        await asyncio.to_thread(write_backup, messages, report.backup)
    except OSError as exc:
        # Before anything on the server is touched: a full disk here loses nothing.
        raise StoreIOError(
            f"cannot write the backup {report.backup}: {exc.strerror or exc}; nothing was changed"
        ) from None
    progress(f"backup of {len(messages)} messages in {report.backup}")
    for ref, value in found.values.items():
        await store_value(ref, value)
    await erase(nc, options, sorted(found.rewrites))
    await rewrite_stream(nc, options, messages, found.rewrites, report.backup, progress)
    clusters = sorted({c.cluster for c in report.changes})
    report.snapshots_dropped = await drop_snapshots(nc, options, clusters)
    return report


async def restore_jetstream(
    nc: Client, options: JetStreamOptions, backup: Path, *, progress: Progress = print
) -> int:
    """Write the stream back from a backup file, every message at its own sequence."""
    messages = await asyncio.to_thread(read_backup, backup)
    await rewrite_stream(nc, options, messages, {}, backup, progress)
    return len(messages)
