"""Durable per-node command queues on JetStream (the production runtime.command_queue.CommandQueue).

One work-queue stream holds every node's commands on `gpumesh.v1.node.<id>.cmd`; each node has
one durable pull consumer, `node-<id>`, filtered on its own subject. So a command sent while the
agent is away waits on disk, an unacknowledged one comes back after `ack_wait`, and a command
is deleted from the stream once acknowledged. `Nats-Msg-Id = command_id` makes a resend inside
the duplicate window (10 minutes) a no-op.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Final

import msgspec
import nats.errors
import structlog
from nats.aio.msg import Msg as NatsMsg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import NoStreamResponseError

from events.contract import subjects
from events.contract.messages import Command
from events.ids import valid_id
from runtime.env import BusError, RequestTimeout

from .nats_bus import NatsBus, cancellation_kept, describe, ensure_stream

log = structlog.get_logger("gpumesh.commands")

DUPLICATE_WINDOW_S: Final = 600.0
DEFAULT_MAX_AGE_S: Final = 7 * 24 * 3600.0

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[Command] = msgspec.json.Decoder(Command)


def consumer_name(node_id: str) -> str:
    return f"node-{node_id}"


class JetStreamDelivery:
    """One delivered command. `ack()` after acting; until then it will be delivered again."""

    def __init__(self, msg: NatsMsg, command: Command, *, ack_timeout: float) -> None:
        self._msg = msg
        self._command = command
        self._ack_timeout = ack_timeout
        self._acked = False

    @property
    def command(self) -> Command:
        return self._command

    @property
    def delivery_count(self) -> int:
        """1 on the first delivery, more on redeliveries."""
        return int(self._msg.metadata.num_delivered)

    @property
    def stream_sequence(self) -> int:
        return int(self._msg.metadata.sequence.stream)

    async def ack(self) -> None:
        """Acknowledge and wait for the server to confirm. Calling it again does nothing.

        BusError if it cannot be confirmed (the server is away): the command will then be
        delivered again, which the agent's epoch and command_id checks make harmless."""
        if self._acked:
            return
        try:
            await self._msg.ack_sync(timeout=self._ack_timeout)
        except nats.errors.Error as exc:
            raise BusError(
                f"ack of command {self._command.command_id} failed: {describe(exc)}"
            ) from exc
        self._acked = True

    async def in_progress(self) -> None:
        """Still working on it: restart the ack_wait clock (for commands that take long)."""
        try:
            await self._msg.in_progress()
        except nats.errors.Error as exc:
            raise BusError(f"in-progress for {self._command.command_id}: {describe(exc)}") from exc


class JetStreamCommandQueue:
    """CommandQueue over JetStream. Build with `await JetStreamCommandQueue.create(bus)`."""

    def __init__(
        self,
        bus: NatsBus,
        *,
        ack_wait: float,
        poll_interval: float,
        request_timeout: float,
        max_age: float,
        manage_stream: bool = True,
    ) -> None:
        self._bus = bus
        self.manage_stream = manage_stream
        self._js: JetStreamContext = bus.jetstream(timeout=request_timeout)
        self.ack_wait = ack_wait
        self.poll_interval = poll_interval
        self.request_timeout = request_timeout
        self.max_age = max_age

    @classmethod
    async def create(
        cls,
        bus: NatsBus,
        *,
        ack_wait: float = 30.0,
        poll_interval: float = 5.0,
        request_timeout: float = 5.0,
        max_age: float = DEFAULT_MAX_AGE_S,
        manage_stream: bool = True,
    ) -> JetStreamCommandQueue:
        """Ensure the commands stream exists. `ack_wait`: seconds before an unacknowledged
        command is delivered again; `poll_interval`: how long one pull waits on the server, which
        bounds how late a consumer notices that a restarted server lost its pending pull.

        `manage_stream=False` is for node agents: the stream is the controller's to create and
        configure (a node's NATS permissions do not allow it), so the agent only binds its own
        consumer and waits, retrying, until the stream exists."""
        queue = cls(
            bus,
            ack_wait=ack_wait,
            poll_interval=poll_interval,
            request_timeout=request_timeout,
            max_age=max_age,
            manage_stream=manage_stream,
        )
        if manage_stream:
            await queue.ensure_stream()
        return queue

    def stream_config(self) -> StreamConfig:
        return StreamConfig(
            name=subjects.COMMANDS_STREAM,
            description="gpumesh per-node command queues (docs/subjects.md)",
            subjects=[subjects.COMMAND_ALL],
            # A work queue deletes a command once acknowledged and allows one consumer per
            # node subject: exactly the per-node queue the CommandQueue protocol describes.
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            duplicate_window=DUPLICATE_WINDOW_S,
            max_age=self.max_age,
        )

    async def ensure_stream(self) -> None:
        await ensure_stream(self._js, self.stream_config(), replicas=self._bus.stream_replicas)

    async def send(self, node_id: str, command: Command) -> None:
        """Store the command for `node_id` and wait for JetStream's ack. A resend of the same
        command_id within the duplicate window is acknowledged and stored nothing."""
        subject = subjects.command(_checked(node_id))
        try:
            try:
                ack = await self._publish(subject, command)
            except NoStreamResponseError:
                if not self.manage_stream:
                    raise
                # A server restarted on an empty store lost the stream; agents no longer create
                # it (they may not), so the sender does, once.
                await self.ensure_stream()
                ack = await self._publish(subject, command)
        except NoStreamResponseError:
            raise BusError(f"no JetStream stream captures {subject}") from None
        except nats.errors.TimeoutError:
            raise RequestTimeout(subject, self.request_timeout) from None
        except nats.errors.Error as exc:
            raise BusError(f"send of {command.command_id} failed: {describe(exc)}") from exc
        if ack.duplicate:
            log.debug("command_duplicate", node_id=node_id, command_id=command.command_id)

    async def _publish(self, subject: str, command: Command) -> PubAck:
        return await self._js.publish(
            subject,
            _encoder.encode(command),
            timeout=self.request_timeout,
            stream=subjects.COMMANDS_STREAM,
            # Per term: a new leader's re-send of a command an older one sent (the agent drops
            # the older one) must not be taken for a duplicate of it.
            headers={"Nats-Msg-Id": f"{command.command_id}@{command.term}"},
        )

    def consume(self, node_id: str) -> AsyncGenerator[JetStreamDelivery, None]:
        """Deliver `node_id`'s commands, oldest unacknowledged first, until closed.

        It is an async generator: close it (`contextlib.aclosing`) to release the subscription
        at once. Server outages and restarts are waited out; it never raises for them.
        """
        return self._consume(_checked(node_id))

    async def _consume(self, node_id: str) -> AsyncGenerator[JetStreamDelivery, None]:
        pull: JetStreamContext.PullSubscription | None = None
        backoff = _Backoff()
        try:
            while True:
                if self._bus.is_closed:
                    return
                try:
                    if pull is None:
                        pull = await self._bind(node_id)
                    with cancellation_kept():  # or a shutdown may never end this loop
                        msgs = await pull.fetch(1, timeout=self.poll_interval)
                except nats.errors.TimeoutError:
                    continue  # nothing to do within one poll (or the server is away)
                except nats.errors.ConnectionClosedError:
                    return
                except (nats.errors.Error, BusError) as exc:
                    # The stream or the consumer may be gone (a server restarted on an empty
                    # store): bind again, which recreates both.
                    log.warning("command_consumer_retry", node_id=node_id, error=describe(exc))
                    if pull is not None:
                        await _unsubscribe(pull)
                        pull = None
                    await backoff.wait()
                    continue
                backoff.reset()
                for msg in msgs:
                    delivery = await self._decode(node_id, msg)
                    if delivery is not None:
                        yield delivery
        finally:
            if pull is not None:
                await _unsubscribe(pull)

    async def _bind(self, node_id: str) -> JetStreamContext.PullSubscription:
        if self.manage_stream:
            await self.ensure_stream()
        config = ConsumerConfig(
            name=consumer_name(node_id),
            durable_name=consumer_name(node_id),
            filter_subject=subjects.command(node_id),
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait,
        )
        # Create-or-update: an existing durable keeps its position and takes the new ack_wait.
        await self._js.add_consumer(subjects.COMMANDS_STREAM, config)
        return await self._js.pull_subscribe_bind(
            consumer_name(node_id), stream=subjects.COMMANDS_STREAM
        )

    async def _decode(self, node_id: str, msg: NatsMsg) -> JetStreamDelivery | None:
        try:
            command = _decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            # Redelivering it would fail the same way forever: terminate it and go on.
            log.error(
                "command_undecodable",
                node_id=node_id,
                subject=msg.subject,
                error=str(exc),
                data=msg.data[:200].decode(errors="replace"),
            )
            try:
                await msg.term()
            except nats.errors.Error as term_exc:
                log.warning("command_term_failed", node_id=node_id, error=describe(term_exc))
            return None
        return JetStreamDelivery(msg, command, ack_timeout=self.request_timeout)


class _Backoff:
    """Exponential back-off between retries, reset by success."""

    def __init__(self, first: float = 0.1, limit: float = 2.0) -> None:
        self._first = first
        self._limit = limit
        self._next = first

    def reset(self) -> None:
        self._next = self._first

    async def wait(self) -> None:
        delay, self._next = self._next, min(self._next * 2, self._limit)
        await asyncio.sleep(delay)


async def _unsubscribe(pull: JetStreamContext.PullSubscription) -> None:
    try:
        await pull.unsubscribe()
    except nats.errors.Error:
        pass  # the connection is closed or draining: the interest is gone with it


def _checked(node_id: str) -> str:
    if not valid_id(node_id):
        raise ValueError(f"invalid node id {node_id!r}: use 1-128 of [A-Za-z0-9_-]")
    return node_id
