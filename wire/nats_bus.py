"""The production Bus: nats-py behind the runtime.env.Bus protocol.

Semantics match sim/bus.py (subject wildcards, queue groups, request/reply) so actors cannot tell
the two apart; nats-py's errors are translated here and never reach actor code. The first
connection fails fast with BusUnavailable; once connected, the client reconnects forever and
replays its subscriptions, so a restarted server is survived without the caller doing anything.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any, Final

import nats.errors
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg as NatsMsg
from nats.aio.subscription import Subscription as NatsSubscriptionHandle
from nats.js import JetStreamContext
from nats.js.api import StreamConfig, StreamInfo
from nats.js.errors import BadRequestError

from runtime.env import (
    DEFAULT_MAX_PAYLOAD,
    BusError,
    Msg,
    MsgHandler,
    NoResponders,
    ReconnectCallback,
    RequestTimeout,
)

from .errors import WireError
from .nats_access import Credentials, secure_url, server_list

log = structlog.get_logger("gpumesh.nats")

# JetStream's error code for "stream name already in use with a different configuration".
_STREAM_CONFIG_DIFFERS: Final = 10058

# Messages buffered per subscription for a consumer that lags; beyond that they are dropped and
# counted, as a NATS server does to a slow consumer, rather than buffered without bound.
DEFAULT_PENDING_LIMIT: Final = 65_536
# Consecutive refusals of a once-accepted connection's credentials that mean "revoked".
REFUSALS_MEANING_REVOKED: Final = 3


class BusUnavailable(BusError, WireError):
    """The NATS server could not be reached on the first connection: a Bus error by the Bus's
    contract, and wire/'s own."""

    def __init__(self, url: str, reason: str) -> None:
        self.url = url
        self.reason = reason
        Exception.__init__(self, f"cannot reach NATS at {url}: {reason}")


def _is_refusal(exc: BaseException) -> bool:
    # nats-py reports a refused reconnect as a plain Error carrying the server's -ERR text.
    return isinstance(exc, nats.errors.AuthorizationError) or (
        "authorization violation" in str(exc).lower()
    )


def describe(exc: BaseException, *, timeout: float | None = None) -> str:
    """One line for a connection or driver error, for logs and exception messages."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused"
    if isinstance(exc, TimeoutError) and timeout is not None:
        return f"no answer within {timeout:g} s"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror.lower()
    text = str(exc).replace("\n", " ").strip()
    return text or type(exc).__name__


class NatsSubscription:
    """A subscription as an async iterator of runtime.env.Msg; `unsubscribe()` ends the iteration
    after the messages already received. With a `handler`, each message goes to it instead, in
    nats-py's callback task for this subscription, and the iteration yields nothing."""

    def __init__(
        self,
        bus: NatsBus,
        subject: str,
        queue: str,
        limit: int,
        handler: MsgHandler | None = None,
    ) -> None:
        self.subject = subject
        self.queue = queue
        self.handler = handler
        self._bus = bus
        self._inbox: asyncio.Queue[Msg | None] = asyncio.Queue(maxsize=limit)
        self._handle: NatsSubscriptionHandle | None = None
        self._closed = False
        self._end_marker_queued = False
        self.dropped = 0  # messages lost because the consumer fell `limit` messages behind

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def pending(self) -> int:
        """Messages received from the server and not yet taken by the consumer."""
        queued = self._inbox.qsize() - (1 if self._end_marker_queued else 0)
        held = self._handle.pending_msgs if self._handle is not None else 0
        return max(0, queued) + int(held)

    def __aiter__(self) -> AsyncIterator[Msg]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Msg]:
        while True:
            if self._closed and self._inbox.empty():
                return
            msg = await self._inbox.get()
            if msg is None:
                self._end_marker_queued = False
                return
            yield msg

    async def next_msg(self, timeout: float) -> Msg:
        """The next message; TimeoutError if none within `timeout`, BusError once closed."""
        if self._closed and self._inbox.empty():
            raise BusError(f"subscription to {self.subject} is closed")
        async with asyncio.timeout(timeout):
            msg = await self._inbox.get()
        if msg is None:
            self._end_marker_queued = False
            raise BusError(f"subscription to {self.subject} is closed")
        return msg

    async def unsubscribe(self) -> None:
        if self._closed:
            return
        self._end()
        handle, self._handle = self._handle, None
        self._bus._forget(self)
        if handle is not None:
            try:
                await handle.unsubscribe()
            except (
                nats.errors.ConnectionClosedError,
                nats.errors.ConnectionDrainingError,
                nats.errors.BadSubscriptionError,
            ):
                pass  # the connection is gone or going: there is no interest left to remove

    async def _receive(self, raw: NatsMsg) -> None:
        if self._closed:
            return
        if self.handler is not None:
            # In nats-py's own task for this subscription, in order: no hop through our queue.
            msg = Msg(
                subject=raw.subject, data=raw.data, reply=raw.reply or "", headers=raw.headers
            )
            try:
                self.handler(msg)
            except Exception:
                log.exception("subscription_handler_failed", subject=raw.subject)
            return
        try:
            self._inbox.put_nowait(
                Msg(subject=raw.subject, data=raw.data, reply=raw.reply or "", headers=raw.headers)
            )
        except asyncio.QueueFull:
            # What a NATS server does to a slow consumer: drop, and say so. Blocking here
            # instead would stall the connection's drain on close behind a reader that is gone.
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                log.warning("nats_slow_consumer", subject=self.subject, dropped=self.dropped)

    def _end(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._inbox.put_nowait(None)
            self._end_marker_queued = True
        except asyncio.QueueFull:
            pass  # a full queue wakes no waiter; the iterator sees `closed` once it drains


class _ConnectionEvents:
    """nats-py's callbacks for one connection. Until the first connect succeeds (`bus` is None)
    errors are kept, to explain the failure; after it, they count on the bus and go to the log."""

    def __init__(self, url: str, name: str) -> None:
        self.url = url
        self.name = name
        self.bus: NatsBus | None = None
        self.first_errors: list[BaseException] = []

    async def error(self, exc: Exception) -> None:
        bus = self.bus
        if bus is None:
            self.first_errors.append(exc)
        elif _is_refusal(exc):
            bus._note_refusal(exc)
        elif isinstance(exc, nats.errors.SlowConsumerError):
            log.warning("nats_slow_consumer", subject=exc.subject, name=self.name)
        elif isinstance(exc, OSError | TimeoutError | nats.errors.StaleConnectionError):
            # A dropped connection and every failed reconnect attempt land here: expected
            # while the server is down, and nats_disconnected already said so.
            log.debug("nats_connection_error", url=self.url, error=describe(exc))
        else:
            log.warning("nats_error", url=self.url, error=describe(exc))

    async def disconnected(self) -> None:
        if self.bus is not None and not self.bus._closing:
            self.bus.disconnects += 1
            log.warning("nats_disconnected", url=self.url, name=self.name)

    async def reconnected(self) -> None:
        bus = self.bus
        if bus is not None:
            bus._refusals = 0
            bus.reconnects += 1
            log.info("nats_reconnected", url=self.url, name=self.name, reconnects=bus.reconnects)
            bus._reconnected.set()

    async def closed(self) -> None:
        log.debug("nats_closed", url=self.url, name=self.name)


async def _close_unconnected(client: Client, timeout: float) -> None:
    try:
        # Bounded: after a failed TLS upgrade nats-py's close() was seen never to end.
        async with asyncio.timeout(timeout):
            await client.close()
    except (nats.errors.Error, TimeoutError):
        pass  # never connected: nothing to close


class NatsBus:
    """Bus over one NATS connection. Build it with `await NatsBus.connect(url, name=...)`."""

    def __init__(self, client: Client, url: str, name: str) -> None:
        self._nc = client
        self.url = url
        self.name = name
        self._subscriptions: set[NatsSubscription] = set()
        self._reconnect_callbacks: list[ReconnectCallback] = []
        self._reconnected = asyncio.Event()
        self._callback_runner: asyncio.Task[None] | None = None
        self._closing = False
        self._subscribe_timeout = 2.0
        self.reconnects = 0
        self.disconnects = 0
        self._refusals = 0
        self.credentials_refused = asyncio.Event()

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        name: str,
        connect_timeout: float = 2.0,
        reconnect_wait: float = 0.5,
        drain_timeout: float = 5.0,
        credentials: Credentials | None = None,
    ) -> NatsBus:
        """Connect once, failing fast with BusUnavailable; after that, reconnect forever.

        `url` may name several servers of a cluster, comma-separated: the first connection
        tries them, and a lost connection moves to another (nats-py also learns the others a
        cluster advertises). `credentials`: this identity's NKEY and the CA to trust (a secured
        server: TLS and per-role permissions); None for a server without authentication."""
        client = Client()
        secured: dict[str, Any] = {}
        if credentials is not None:
            secured = credentials.connect_options()
            url = secure_url(url)
        events = _ConnectionEvents(url, name)
        # nats-py either gives up at once or retries forever, for the first connection as for
        # later ones. We want both: fail fast now (one retry, no wait), then retry forever.
        deadline = connect_timeout * 3 + 1.0
        try:
            # nats-py bounds each step by connect_timeout but not the whole: a plain nats://
            # client meeting a server that requires TLS was seen waiting forever.
            async with asyncio.timeout(deadline):
                await client.connect(
                    servers=server_list(url),
                    name=name,
                    connect_timeout=connect_timeout,  # type: ignore[arg-type]
                    allow_reconnect=False,
                    max_reconnect_attempts=1,
                    reconnect_time_wait=0,
                    drain_timeout=drain_timeout,  # type: ignore[arg-type]
                    error_cb=events.error,
                    disconnected_cb=events.disconnected,
                    reconnected_cb=events.reconnected,
                    closed_cb=events.closed,
                    **secured,
                )
        except (OSError, TimeoutError, nats.errors.Error) as exc:
            cause = events.first_errors[0] if events.first_errors else exc
            await _close_unconnected(client, connect_timeout)
            reason = describe(cause, timeout=connect_timeout)
            if credentials is None and isinstance(cause, TimeoutError):
                reason += " (if that server requires TLS and credentials, pass --nats-creds)"
            raise BusUnavailable(url, reason) from cause
        client.options["allow_reconnect"] = True
        client.options["max_reconnect_attempts"] = -1
        client.options["reconnect_time_wait"] = reconnect_wait
        bus = events.bus = cls(client, url, name)
        bus._callback_runner = asyncio.create_task(
            bus._run_reconnect_callbacks(), name=f"nats-reconnect-callbacks:{name}"
        )
        log.debug("nats_connected", url=url, name=name)
        return bus

    def _note_refusal(self, exc: Exception) -> None:
        # One refusal can be a server reloading its configuration; several in a row, after
        # this connection was once accepted, mean this identity was revoked.
        self._refusals += 1
        log.warning("nats_credentials_refused", url=self.url, name=self.name, error=describe(exc))
        if self._refusals >= REFUSALS_MEANING_REVOKED:
            self.credentials_refused.set()

    @property
    def client(self) -> Client:
        """The nats-py client, for JetStream users in this package."""
        return self._nc

    @property
    def is_connected(self) -> bool:
        return bool(self._nc.is_connected)

    @property
    def cluster_size(self) -> int:
        """How many servers the cluster has, as far as this connection can tell: the servers
        the connected one advertises, or the servers this client was given where that is more
        (a cluster that does not advertise, as `up --ha`'s: ClusterMember.advertise). 1 when
        the server is alone."""
        info = self._nc._server_info  # nats-py keeps the server's INFO, with no public getter
        if not info.get("cluster"):
            return 1
        given = len([u for u in self.url.split(",") if u.strip()])
        return max(1, len(info.get("connect_urls") or ()), given)

    @property
    def stream_replicas(self) -> int:
        """Copies a stream of ours should keep: 3 on a cluster of three or more servers (it
        survives the loss of one), else one per server."""
        return min(3, self.cluster_size)

    @property
    def max_payload(self) -> int:
        """The server's max_payload (from its INFO), or its default before the first connect."""
        return int(self._nc.max_payload or DEFAULT_MAX_PAYLOAD)

    @property
    def is_closed(self) -> bool:
        return bool(self._nc.is_closed)

    def new_inbox(self) -> str:
        """A subject unique to this connection (`_INBOX.<nuid>`), for replies to it."""
        return str(self._nc.new_inbox())

    def jetstream(self, *, timeout: float = 5.0) -> JetStreamContext:
        return self._nc.jetstream(timeout=timeout)

    def add_reconnect_callback(self, callback: ReconnectCallback) -> None:
        """Await `callback()` after every reconnect (e.g. to register again). It runs in a task
        owned by the bus, so a slow callback never delays the client's own reconnection."""
        self._reconnect_callbacks.append(callback)

    def remove_reconnect_callback(self, callback: ReconnectCallback) -> None:
        if callback in self._reconnect_callbacks:
            self._reconnect_callbacks.remove(callback)

    async def publish(
        self, subject: str, data: bytes, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        try:
            await self._nc.publish(subject, data, reply=reply, headers=headers)
        except nats.errors.Error as exc:
            raise BusError(f"publish to {subject} failed: {describe(exc)}") from exc

    async def subscribe(
        self,
        subject: str,
        *,
        queue: str = "",
        handler: MsgHandler | None = None,
        pending_limit: int = DEFAULT_PENDING_LIMIT,
    ) -> NatsSubscription:
        sub = NatsSubscription(self, subject, queue, pending_limit, handler)
        try:
            sub._handle = await self._nc.subscribe(subject, queue=queue, cb=sub._receive)
        except nats.errors.Error as exc:
            raise BusError(f"subscribe to {subject} failed: {describe(exc)}") from exc
        self._subscriptions.add(sub)
        if self._nc.is_connected:
            # Like MemoryBus, a subscription is live when this returns: a message published
            # by anyone afterwards reaches it. While disconnected, the client replays the
            # subscription on reconnect, so there is nothing to wait for.
            try:
                await self._round_trip(self._subscribe_timeout)
            except TimeoutError:
                log.debug("nats_subscribe_unconfirmed", subject=subject)
            except nats.errors.ConnectionClosedError as exc:
                raise BusError(f"subscribe to {subject} failed: {describe(exc)}") from exc
        return sub

    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        try:
            with cancellation_kept():
                raw = await self._nc.request(subject, data, timeout=timeout, headers=headers)
        except nats.errors.NoRespondersError:
            raise NoResponders(subject) from None
        except nats.errors.TimeoutError:
            raise RequestTimeout(subject, timeout) from None
        except nats.errors.Error as exc:
            raise BusError(f"request to {subject} failed: {describe(exc)}") from exc
        return Msg(subject=raw.subject, data=raw.data, reply=raw.reply or "", headers=raw.headers)

    async def flush(self, timeout: float = 5.0) -> None:
        """Round trip to the server: everything published before has been processed by it, and
        every message it sent this connection before its reply has been received."""
        try:
            await self._round_trip(timeout)
        except (nats.errors.Error, TimeoutError) as exc:
            raise BusError(f"flush failed: {describe(exc, timeout=timeout)}") from exc

    async def _round_trip(self, timeout: float) -> None:
        # nats-py writes its PING straight to the socket while publishes and subscriptions wait
        # in a buffer for its flusher task, so its flush() alone can overtake them. Push the
        # buffer out first (private API, hence the guard), then PING behind it.
        push = getattr(self._nc, "_flush_pending", None)
        if push is not None and self._nc.is_connected:
            with cancellation_kept():  # nats-py swallows CancelledError in there
                async with asyncio.timeout(timeout):
                    await push(force_flush=True)
        with cancellation_kept():
            await self._nc.flush(timeout=timeout)  # type: ignore[arg-type]

    async def close(self) -> None:
        """Drain (deliver what is in flight, then disconnect) and end every subscription."""
        self._closing = True
        runner, self._callback_runner = self._callback_runner, None
        if runner is not None:
            await cancel_and_wait(runner)
        try:
            if self._nc.is_connected:
                await self._nc.drain()
            else:
                await self._nc.close()
        except (nats.errors.Error, OSError) as exc:
            # A connection the server cut (a revoked identity, a reset) has nothing left to
            # drain; closing must still end everything here rather than raise at shutdown.
            log.debug("nats_close_error", url=self.url, error=describe(exc))
            with contextlib.suppress(nats.errors.Error, OSError):
                await self._nc.close()
        for sub in list(self._subscriptions):
            sub._end()
        self._subscriptions.clear()

    def _forget(self, sub: NatsSubscription) -> None:
        self._subscriptions.discard(sub)

    async def _run_reconnect_callbacks(self) -> None:
        while True:
            await self._reconnected.wait()
            self._reconnected.clear()
            for callback in list(self._reconnect_callbacks):
                try:
                    await callback()
                except Exception:
                    log.exception("nats_reconnect_callback_failed", name=self.name)


@contextlib.contextmanager
def cancellation_kept() -> Iterator[None]:
    """Raise CancelledError after the block if the task was cancelled during it and the block
    swallowed that. nats-py does so in places (its flush), and so does asyncio.wait_for on
    Python 3.11 when the awaited reply lands in the same turn as the cancel (fixed in 3.12):
    a loop around a request then never ends, and its TaskGroup waits forever (a `gpumesh
    chaos` run that did not exit after its end was seen). Inside `asyncio.timeout`, the raise
    becomes its TimeoutError, as it should."""
    task = asyncio.current_task()
    before = task.cancelling() if task is not None else 0
    yield
    if task is not None and task.cancelling() > before:
        raise asyncio.CancelledError()


async def cancel_and_wait(task: asyncio.Task[Any]) -> None:
    """Cancel a task we own and wait for it to finish, without swallowing our own cancellation."""
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise


async def ensure_stream(
    js: JetStreamContext, config: StreamConfig, *, replicas: int = 1
) -> StreamInfo:
    """Create the stream, or bring an existing one to `config`, with `replicas` copies (a
    cluster's `NatsBus.stream_replicas`). JetStream refuses some changes (the retention policy,
    for one); those, like an unreachable server, raise BusError."""
    config.num_replicas = replicas
    try:
        try:
            info: StreamInfo = await js.add_stream(config)
        except BadRequestError as exc:
            if exc.err_code != _STREAM_CONFIG_DIFFERS:
                raise
            # Never fewer copies than the stream has: `replicas` comes from the cluster as
            # the reachable server sees it, which is one short while a server is down, and a
            # stream shrunk then stays shrunk after the server is back.
            existing = await js.stream_info(config.name or "")
            config.num_replicas = max(replicas, existing.config.num_replicas or 1)
            info = await js.update_stream(config)
            log.info("jetstream_stream_updated", stream=config.name)
    except nats.errors.Error as exc:
        raise BusError(f"cannot set up stream {config.name}: {describe(exc)}") from exc
    return info
