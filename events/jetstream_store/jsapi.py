"""The JetStream calls the store makes, on a connected nats-py client, with every failure turned
into the store's own errors at this boundary.

nats-py has no API for atomic batches, batch direct gets or purges with a subject and a
sequence bound; all three are plain requests with headers or JSON, made here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.api import StorageType, StreamConfig
from nats.js.client import JetStreamContext

from events.errors import EventStoreError, StoreFull, StoreIOError

from .options import JetStreamOptions

# JetStream error codes the store acts on.
WRONG_LAST_SEQUENCE: Final = 10071
BATCH_INCOMPLETE: Final = 10176
BATCH_DUPLICATE_MSG_ID: Final = 10201
# "wrong last sequence" with none given: a conditional publish on the same subject is still
# in flight on a clustered stream (nats-server takes one at a time per subject).
EXPECTATION_IN_FLIGHT: Final = 10164
STREAM_NOT_FOUND: Final = 10059
NO_MESSAGE_FOUND: Final = 10037
# Account or server storage exhausted, or the stream's own limit reached.
_FULL_CODES: Final = frozenset({10023, 10028, 10047})
_FULL_WORDS: Final = ("exceeded", "insufficient")

_PAGE: Final = 5000  # messages asked for per batch direct get


class ApiError(msgspec.Struct):
    code: int = 0
    err_code: int = 0
    description: str = ""


class PubAck(msgspec.Struct):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: ApiError | None = None


class _StreamState(msgspec.Struct):
    messages: int = 0
    last_seq: int = 0


class _StreamInfo(msgspec.Struct):
    state: _StreamState = msgspec.field(default_factory=_StreamState)
    error: ApiError | None = None


class _Purged(msgspec.Struct):
    purged: int = 0
    success: bool = False
    error: ApiError | None = None


class _StoredSeq(msgspec.Struct):
    seq: int = 0


class _MsgGot(msgspec.Struct):
    message: _StoredSeq | None = None
    error: ApiError | None = None


_ack_decoder = msgspec.json.Decoder(PubAck)
_msg_get_decoder = msgspec.json.Decoder(_MsgGot)
_info_decoder = msgspec.json.Decoder(_StreamInfo)
_purge_decoder = msgspec.json.Decoder(_Purged)
_json = msgspec.json.Encoder()


class NoStreamResponder(StoreIOError):
    """No server took a publish (status 503): no stream listens on the subject, or, for a
    moment after its leader's server died, the stream has no leader yet."""


class Leaderless:
    """A publish answered "no responders" while its stream elects a leader (its leader's
    server died) is sent again, every 0.1 s, for as long as one request may take."""

    WAIT_S: Final = 0.1

    def __init__(self, options: JetStreamOptions) -> None:
        self._limit_s = options.request_timeout_s
        self._until = 0.0

    async def wait(self) -> bool:
        """Wait before the next try; False once the time for it is over (raise then)."""
        now = asyncio.get_running_loop().time()
        self._until = self._until or now + self._limit_s
        if now > self._until:
            return False
        await asyncio.sleep(self.WAIT_S)
        return True


class _NoDirectResponder(StoreIOError):
    """No server answered a direct get (status 503)."""


_NO_RESPONDER_RETRY_S: Final = 0.05


def api_failure(options: JetStreamOptions, error: ApiError) -> EventStoreError:
    description = " ".join(error.description.split())
    if error.err_code in _FULL_CODES or any(w in description for w in _FULL_WORDS):
        return StoreFull(f"NATS stream {options.stream}")
    return StoreIOError(
        f"event store on NATS stream {options.stream}: {description} (error {error.err_code})"
    )


@contextlib.contextmanager
def translated(options: JetStreamOptions) -> Iterator[None]:
    """nats-py's exceptions never leave the store: callers see StoreIOError instead."""
    try:
        yield
    except nats.js.errors.APIError as exc:
        raise api_failure(
            options, ApiError(exc.code or 0, exc.err_code or 0, exc.description or "")
        ) from exc
    except (TimeoutError, nats.errors.Error, OSError) as exc:
        raise _transport_failure(options, exc) from exc


def _transport_failure(options: JetStreamOptions, exc: BaseException) -> StoreIOError:
    where = f"event store on NATS stream {options.stream}"
    if isinstance(exc, nats.errors.NoRespondersError):
        return StoreIOError(
            f"{where}: JetStream did not answer (no responders: is JetStream enabled on the "
            "server?)"
        )
    if isinstance(exc, TimeoutError):  # nats-py's TimeoutError is one too
        return StoreIOError(
            f"{where}: no answer within {options.request_timeout_s:g} s (is the server reachable?)"
        )
    text = " ".join(str(exc).split()) or type(exc).__name__
    return StoreIOError(f"{where}: {text}")


@dataclass(slots=True)
class Page:
    """What one batch direct get brought back, and how many matching messages lie past it."""

    done: asyncio.Future[None]
    messages: list[Msg] = field(default_factory=list)
    pending: int = 0


class Sent(NamedTuple):
    token: str
    ack: asyncio.Future[Msg]


def sequence_of(msg: Msg) -> int:
    return int(msg.headers["Nats-Sequence"]) if msg.headers else 0


def subject_of(msg: Msg) -> str:
    return msg.headers["Nats-Subject"] if msg.headers else ""


class Api:
    """Requests to one stream, and batch direct gets through one reply subscription."""

    def __init__(self, nc: Client, options: JetStreamOptions) -> None:
        self.nc = nc
        self.options = options
        self._timeout = options.request_timeout_s
        self._direct = f"$JS.API.DIRECT.GET.{options.stream}"
        self._inbox = ""
        self._sub: Subscription | None = None
        self._pages: dict[str, Page] = {}
        self._acks: dict[str, asyncio.Future[Msg]] = {}
        self._deadlines: collections.deque[tuple[float, str]] = collections.deque()
        # Single publishes not yet answered, to send once more after `resend_after_s` if the
        # connection moved to another server since (subject, data, headers, reconnects then).
        self._unanswered: dict[str, tuple[str, bytes, dict[str, str], int]] = {}
        self._resends: collections.deque[tuple[float, str]] = collections.deque()
        self._last_answer = 0.0  # loop time of the last publish acknowledgement
        self._expiry: asyncio.Task[None] | None = None
        self._next_token = 0

    async def start(self) -> None:
        self._inbox = self.nc.new_inbox()
        with translated(self.options):
            self._sub = await self.nc.subscribe(f"{self._inbox}.*", cb=self._on_reply)
        self._expiry = asyncio.get_running_loop().create_task(self._expire())

    async def stop(self) -> None:
        expiry, self._expiry = self._expiry, None
        if expiry is not None:
            expiry.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await expiry
        sub, self._sub = self._sub, None
        if sub is not None:
            with contextlib.suppress(nats.errors.Error, OSError):
                await sub.unsubscribe()

    @property
    def token_source(self) -> str:
        """Unique to this store object: its batch ids are built from it."""
        return self._inbox.rpartition(".")[2]

    # ------------------------------------------------------------------ the stream itself

    async def ensure_stream(self) -> None:
        """Create the stream, or switch on what the store needs on an existing one."""
        o = self.options
        js = self.nc.jetstream(timeout=self._timeout)
        with translated(o):
            try:
                info = await js.stream_info(o.stream)
            except nats.js.errors.NotFoundError:
                await js.add_stream(
                    StreamConfig(
                        name=o.stream,
                        subjects=[o.filter],
                        storage=StorageType(o.storage),
                        num_replicas=o.replicas,
                        duplicate_window=o.duplicate_window_s,
                        allow_direct=True,
                        allow_atomic=True,
                    )
                )
                return
            config = info.config
            if o.filter not in (config.subjects or []):
                raise StoreIOError(
                    f"NATS stream {o.stream} exists without the subject {o.filter} "
                    f"(it has {config.subjects}): choose another stream name or prefix"
                )
            # More copies when the cluster has grown (never fewer: a stream made R3 by a
            # bigger cluster is not shrunk by a store opened with a smaller setting).
            more_copies = (config.num_replicas or 1) < o.replicas
            if not (config.allow_direct and config.allow_atomic) or more_copies:
                config.allow_direct = True
                config.allow_atomic = True
                config.num_replicas = max(config.num_replicas or 1, o.replicas)
                await js.update_stream(config)
                if more_copies:
                    await self._until_copies_current(js)

    async def _until_copies_current(self, js: JetStreamContext) -> None:
        """After the stream gains copies: wait until it has a leader and every new copy has
        caught up, so the first append is not sent into the change-over."""
        deadline = asyncio.get_running_loop().time() + self._timeout
        while True:
            info = await js.stream_info(self.options.stream)
            peers = (info.cluster.replicas or []) if info.cluster else []
            if (
                info.cluster is not None
                and info.cluster.leader
                and len(peers) + 1 >= self.options.replicas
                and all(p.current for p in peers)
            ):
                return
            if asyncio.get_running_loop().time() > deadline:
                raise StoreIOError(
                    f"NATS stream {self.options.stream}: its new copies did not catch up within "
                    f"{self._timeout:g} s"
                )
            await asyncio.sleep(0.05)

    async def last_sequence(self) -> tuple[int, int]:
        """(last sequence, message count) of the stream, from its leader."""
        data = await self._call(f"$JS.API.STREAM.INFO.{self.options.stream}", b"")
        info = _info_decoder.decode(data)
        if info.error is not None:
            raise api_failure(self.options, info.error)
        return info.state.last_seq, info.state.messages

    async def last_on_subject(self, subject: str) -> int:
        """The sequence of the subject's last message as the stream's leader has it (0 for
        none): unlike a direct get, never answered by a copy that lags."""
        request = _json.encode({"last_by_subj": subject})
        data = await self._call(f"$JS.API.STREAM.MSG.GET.{self.options.stream}", request)
        got = _msg_get_decoder.decode(data)
        if got.error is not None:
            if got.error.err_code == NO_MESSAGE_FOUND:
                return 0
            raise api_failure(self.options, got.error)
        return got.message.seq if got.message is not None else 0

    async def purge(self, subject: str, below_seq: int) -> int:
        """Remove the subject's messages with a sequence below `below_seq`; how many went."""
        request = _json.encode({"filter": subject, "seq": below_seq})
        data = await self._call(f"$JS.API.STREAM.PURGE.{self.options.stream}", request)
        purged = _purge_decoder.decode(data)
        if purged.error is not None:
            raise api_failure(self.options, purged.error)
        return purged.purged

    async def delete(self, seq: int) -> bool:
        request = _json.encode({"seq": seq, "no_erase": True})
        data = await self._call(f"$JS.API.STREAM.MSG.DELETE.{self.options.stream}", request)
        purged = _purge_decoder.decode(data)
        if purged.error is not None:
            if purged.error.code == 404 or "not found" in purged.error.description:
                return False
            raise api_failure(self.options, purged.error)
        return purged.success

    async def _call(self, subject: str, payload: bytes) -> bytes:
        with translated(self.options):
            msg = await self.nc.request(subject, payload, timeout=self._timeout)
        return bytes(msg.data)

    # ------------------------------------------------------------------ writes

    async def send(self, subject: str, data: bytes, hdrs: dict[str, str]) -> Sent:
        """Queue a publish on the connection and return at once, its acknowledgement to be
        awaited with `acked`: publishes sent one after another leave in that order."""
        loop = asyncio.get_running_loop()
        sent = Sent(self._token(), loop.create_future())
        self._acks[sent.token] = sent.ack
        now = loop.time()
        self._deadlines.append((now + self._timeout, sent.token))
        if "Nats-Batch-Id" not in hdrs:
            self._unanswered[sent.token] = (subject, data, hdrs, self._reconnects())
            self._resends.append((now + self.options.resend_after_s, sent.token))
        try:
            await self.nc.publish(subject, data, reply=f"{self._inbox}.{sent.token}", headers=hdrs)
        except (nats.errors.Error, OSError) as exc:
            del self._acks[sent.token]
            self._unanswered.pop(sent.token, None)
            raise _transport_failure(self.options, exc) from exc
        return sent

    async def send_only(self, subject: str, data: bytes, hdrs: dict[str, str]) -> None:
        """Queue a publish nobody answers (a batch's messages before its commit)."""
        try:
            await self.nc.publish(subject, data, headers=hdrs)
        except (nats.errors.Error, OSError) as exc:
            raise _transport_failure(self.options, exc) from exc

    def awaiting_acks(self) -> bool:
        """Whether publishes of this store await their acknowledgements."""
        return bool(self._acks)

    async def acked(self, sent: Sent) -> PubAck:
        """Wait for a publish's acknowledgement; JetStream's refusals come back in `error`,
        for the writer to act on."""
        try:
            msg = await sent.ack
        except TimeoutError:
            raise _transport_failure(self.options, TimeoutError()) from None
        finally:
            self._acks.pop(sent.token, None)
            self._unanswered.pop(sent.token, None)
        if msg.headers and msg.headers.get("Status") == "503":
            raise NoStreamResponder(
                f"event store on NATS stream {self.options.stream}: no stream takes "
                "publishes on its subjects (no responders)"
            )
        try:
            return _ack_decoder.decode(msg.data)
        except msgspec.DecodeError as exc:
            raise StoreIOError(
                f"event store on NATS stream {self.options.stream}: not a publish "
                f"acknowledgement: {bytes(msg.data)[:80]!r}"
            ) from exc

    async def _expire(self) -> None:
        """Fail the acknowledgements overdue. One task for all of them: a timer per publish
        costs more than the publish (every deadline is the same distance ahead, so they
        expire in the order they were set)."""
        loop = asyncio.get_running_loop()
        deadlines, resends = self._deadlines, self._resends
        while True:
            await asyncio.sleep(min(0.25, self._timeout / 4, self.options.resend_after_s / 2))
            now = loop.time()
            while resends and resends[0][0] <= now:
                _, token = resends.popleft()
                unanswered = self._unanswered.get(token)
                if unanswered is None:
                    continue
                # Only when the connection has moved since the send, or nothing at all has
                # been answered for as long: a slow answer from a loaded server is not a lost
                # publish, and sending everything twice then would only load it more. Not yet:
                # look again later, until its deadline fails it.
                if (
                    unanswered[3] != self._reconnects()
                    or now - self._last_answer >= self.options.resend_after_s
                ):
                    del self._unanswered[token]
                    await self._resend(token, *unanswered[:3])
                else:
                    resends.append((now + self.options.resend_after_s, token))
            while deadlines and deadlines[0][0] <= now:
                _, token = deadlines.popleft()
                ack = self._acks.get(token)
                if ack is not None and not ack.done():
                    ack.set_exception(TimeoutError())

    async def _resend(self, token: str, subject: str, data: bytes, hdrs: dict[str, str]) -> None:
        """Send an unanswered publish once more, under the same reply token, after the
        connection moved to another server or the stream went silent: a publish written into
        a connection that was already gone, or routed to a stream leader that just died, is
        lost without a word. Safe to repeat: the expected last subject sequence lets at most
        one copy in, and `Nats-Msg-Id` makes the second a duplicate with the first's sequence;
        whichever answer comes first settles the append, and the writer reads its way to the
        truth from either (writer.py)."""
        ack = self._acks.get(token)
        if ack is None or ack.done():
            return
        with contextlib.suppress(nats.errors.Error, OSError):
            await self.nc.publish(subject, data, reply=f"{self._inbox}.{token}", headers=hdrs)

    def _reconnects(self) -> int:
        return int(self.nc.stats.get("reconnects", 0))

    def _token(self) -> str:
        self._next_token += 1
        return str(self._next_token)

    # ------------------------------------------------------------------ reads

    async def get_one(self, request: dict[str, Any]) -> Msg | None:
        """A single direct get (`seq` or `last_by_subj`); None when there is no such message."""
        with translated(self.options):
            msg = await self.nc.request(self._direct, _json.encode(request), timeout=self._timeout)
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            return msg
        if status == "404":
            return None
        raise self._status_failure(msg)

    async def read(self, start: int, limit: int, subject: str | None = None) -> list[Msg]:
        """Messages from sequence `start` on (of `subject` only, if given), at most `limit`."""
        found: list[Msg] = []
        seq = start
        while len(found) < limit:
            want = min(limit - len(found), _PAGE)
            request: dict[str, Any] = {"seq": seq, "batch": want}
            if subject is not None:
                request["next_by_subj"] = subject
            page = await self._page_answered(request)
            found += page.messages
            if not page.messages or (len(page.messages) < want and page.pending == 0):
                break
            seq = sequence_of(page.messages[-1]) + 1
        return found

    async def _page_answered(self, request: dict[str, Any]) -> Page:
        """A page, asked again while no server answers direct gets: for a moment after the
        server that led the stream dies, the cluster's interest in direct gets still points at
        it, and the copies left answer once the routes have noticed."""
        deadline = asyncio.get_running_loop().time() + self._timeout
        while True:
            try:
                return await self._page(request)
            except _NoDirectResponder:
                if asyncio.get_running_loop().time() > deadline:
                    raise
                await asyncio.sleep(_NO_RESPONDER_RETRY_S)

    async def _page(self, request: dict[str, Any]) -> Page:
        if self._sub is None:
            raise StoreIOError(f"event store on NATS stream {self.options.stream}: not started")
        token = self._token()
        page = Page(asyncio.get_running_loop().create_future())
        self._pages[token] = page
        try:
            with translated(self.options):
                await self.nc.publish(
                    self._direct, _json.encode(request), reply=f"{self._inbox}.{token}"
                )
                async with asyncio.timeout(self._timeout):
                    await page.done
        finally:
            del self._pages[token]
        return page

    async def _on_reply(self, msg: Msg) -> None:
        token = msg.subject.rpartition(".")[2]
        ack = self._acks.get(token)
        if ack is not None:
            self._last_answer = asyncio.get_running_loop().time()
            if not ack.done():
                ack.set_result(msg)
            return
        page = self._pages.get(token)
        if page is None or page.done.done():
            return  # a reply after its request timed out
        status = msg.headers.get("Status") if msg.headers else None
        if status is None:
            page.messages.append(msg)
        elif status in ("204", "404"):  # end of the batch; nothing (more) to read
            page.pending = int(msg.headers.get("Nats-Num-Pending", 0)) if msg.headers else 0
            page.done.set_result(None)
        else:
            page.done.set_exception(self._status_failure(msg))

    def _status_failure(self, msg: Msg) -> StoreIOError:
        hdrs = msg.headers or {}
        status = hdrs.get("Status", "")
        if status == "503":
            return _NoDirectResponder(
                f"event store on NATS stream {self.options.stream}: no server answers direct "
                "gets (no responders: is JetStream enabled and the stream there?)"
            )
        return StoreIOError(
            f"event store on NATS stream {self.options.stream}: direct get failed: "
            f"{status} {hdrs.get('Description', '')}".rstrip()
        )
