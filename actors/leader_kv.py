"""The controllers' leader lease on JetStream (actors/leadership.py decides; this only writes).

A KV key is a subject of a stream that keeps one message per subject; that is all this is,
written directly so that each write can carry its own time to live (nats-server 2.11+ per
message TTL, which nats-py's KV wrapper does not pass on an update): create-if-absent is a
publish expecting the subject's last sequence to be 0, a renewal one expecting the sequence it
last wrote, and a hand-over deletes its own message, by sequence, if it is still the last."""

from __future__ import annotations

import asyncio
from typing import Final

import msgspec
import nats.errors
from nats.js.api import DiscardPolicy, StorageType, StreamConfig
from nats.js.errors import APIError, NotFoundError

from events.contract import subjects
from runtime.errors import BusError
from wire.nats_bus import NatsBus, cancellation_kept, describe, ensure_stream

from .errors import ControllerError
from .leadership import LeaderRecord, LeaseLost, LeaseTaken

STREAM: Final = subjects.LEADER_STREAM
SUBJECT: Final = subjects.LEADER
_EXPECTED_LAST_SUBJECT_SEQUENCE: Final = "Nats-Expected-Last-Subject-Sequence"
_WRONG_LAST_SEQUENCE: Final = (10071, 10164)  # JetStream's codes for a failed expectation
_NO_MESSAGE: Final = 10057  # "no message found": the sequence was deleted or expired
_RECORD = msgspec.json.Decoder(LeaderRecord)


class KvLease:
    """The lease on `SUBJECT` in `STREAM`, created on first use with as many copies as the
    cluster allows (NatsBus.stream_replicas)."""

    def __init__(self, bus: NatsBus, *, timeout: float = 5.0) -> None:
        self._bus = bus
        self._js = bus.jetstream(timeout=timeout)
        self._ready = False
        self._setup: asyncio.Task[None] | None = None

    async def _stream(self) -> None:
        """Make sure of the stream, once. The set-up runs as a task of its own that a caller
        giving up on its write (Leadership bounds each attempt to a fraction of a second)
        does not cancel: a set-up that takes longer than one attempt (a stream electing its
        leader, a server down) is waited on by the next, not started over each time."""
        if self._ready:
            return
        setup = self._setup
        if setup is None or (setup.done() and (setup.cancelled() or setup.exception())):
            setup = self._setup = asyncio.create_task(self._make_stream(), name="leader-lease")
            setup.add_done_callback(_retrieve)
        await asyncio.shield(setup)

    async def _make_stream(self) -> None:
        config = StreamConfig(
            name=STREAM,
            description="gpumesh: which controller leads (docs/operations.md)",
            subjects=[SUBJECT],
            storage=StorageType.FILE,
            max_msgs_per_subject=1,
            discard=DiscardPolicy.OLD,
            allow_msg_ttl=True,
        )
        try:
            await ensure_stream(self._js, config, replicas=self._bus.stream_replicas)
        except BusError as exc:  # the backend's own failure: a campaign asks again
            raise ControllerError(str(exc)) from exc
        self._ready = True

    async def _write(self, value: bytes, last: int, ttl_s: float, lost: ControllerError) -> int:
        await self._stream()
        try:
            with cancellation_kept():  # the renewal loop must end when cancelled
                ack = await self._js.publish(
                    SUBJECT,
                    value,
                    headers={_EXPECTED_LAST_SUBJECT_SEQUENCE: str(last)},
                    msg_ttl=ttl_s,
                )
        except APIError as exc:
            if exc.err_code in _WRONG_LAST_SEQUENCE:
                raise lost from None
            raise ControllerError(f"cannot write the lease: {describe(exc)}") from exc
        except nats.errors.Error as exc:
            raise ControllerError(f"cannot write the lease: {describe(exc)}") from exc
        return int(ack.seq)

    async def create(self, value: bytes, ttl_s: float) -> int:
        return await self._write(value, 0, ttl_s, LeaseTaken("another controller holds it"))

    async def renew(self, value: bytes, revision: int, ttl_s: float) -> int:
        lost = LeaseLost(f"the lease is no longer at revision {revision}")
        return await self._write(value, revision, ttl_s, lost)

    async def read(self) -> tuple[bytes, int] | None:
        await self._stream()
        try:
            with cancellation_kept():
                found = await self._js.get_last_msg(STREAM, SUBJECT)
        except NotFoundError:
            return None
        except nats.errors.Error as exc:
            raise ControllerError(f"cannot read the lease: {describe(exc)}") from exc
        if not found.data or found.seq is None:
            return None
        return found.data, int(found.seq)

    async def release(self, revision: int) -> None:
        await self._stream()
        try:
            await self._js.delete_msg(STREAM, revision)
        except NotFoundError:
            pass  # taken over since, or expired: not ours to delete any more
        except APIError as exc:
            if exc.err_code != _NO_MESSAGE:
                raise ControllerError(f"cannot release the lease: {describe(exc)}") from exc
        except nats.errors.Error as exc:
            raise ControllerError(f"cannot release the lease: {describe(exc)}") from exc

    async def leader(self) -> tuple[LeaderRecord, int] | None:
        """Who leads, from the lease's last write, and that write's revision; None when
        nobody does."""
        found = await self.read()
        if found is None:
            return None
        value, revision = found
        return _RECORD.decode(value), revision


def _retrieve(task: asyncio.Task[None]) -> None:
    """A set-up that fails with no caller left waiting on it is asked again by the next."""
    if not task.cancelled():
        task.exception()
