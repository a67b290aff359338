"""The inference data path: pick a ready replica, send, retry around failures, stream back.

Which replica, whether to retry and when to eject are decided by gateway/dispatch.py and
gateway/router.py, which know nothing of HTTP but the status each way of failing earns; this
module only turns HTTP into attempts and attempts back into HTTP. Until the client has seen a
byte, every failure is retried elsewhere; after that, a streamed answer that breaks ends with
an explicit SSE error event. A request that gets no answer ends in a DispatchError, and
`refuse` is the one place where one becomes a reply.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, cast

import msgspec
from aiohttp import web

from events.contract.messages import RouteEntry
from events.contract.tunnel import HOP_BY_HOP

from .access_log import AccessLog, StructlogAccessLog
from .auth import ANONYMOUS, KeyRing, Tenant
from .dispatch import Dispatcher, DispatchError, UnknownCluster
from .instruments import Instruments
from .reply import (
    JSON_HEADERS,
    AiohttpInbound,
    AiohttpSink,
    FlowControlled,
    Headers,
    Inbound,
    Sink,
    error_body,
)
from .router import Router
from .transport.base import (
    BrokenWhileHeld,
    Outcome,
    ResetBeforeHead,
    StreamBroken,
    Transport,
    UpstreamError,
    UpstreamRequest,
    UpstreamResponse,
    UpstreamStatus,
)
from .transport.overlay import RequestTooLarge
from .usage import StreamUsage, body_tokens

if TYPE_CHECKING:  # opentelemetry is loaded only with --trace (docs/tracing.md)
    from .tracing import RequestSpan, RequestTracer

Affinity = Literal["off", "prefix", "user"]

# The inference routes, routed by the body's `model`: served by the front (gateway/front.py)
# and by the aiohttp application (gateway/app.py) alike.
OPENAI_PATHS: tuple[str, ...] = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")


class _OpenAIBody(msgspec.Struct):
    """The fields routing needs; the rest of the body is forwarded untouched, never re-encoded."""

    model: str = ""
    stream: bool = False
    user: str = ""
    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    input: msgspec.Raw = msgspec.Raw()


_BODY = msgspec.json.Decoder(_OpenAIBody)
_JSON = msgspec.json.Encoder()
# RFC 9110 section 9.2.2: repeating one of these has the effect of sending it once.
_IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE", "PUT", "DELETE"})
# Client headers that stop at the gateway: its own credentials, and what each hop sets itself.
_DROP = HOP_BY_HOP | {"authorization", "x-request-id", "accept-encoding"}


@dataclass(frozen=True, slots=True)
class ProxySettings:
    gateway_id: str
    affinity: Affinity = "off"
    affinity_prefix_bytes: int = 512  # of the prompt: long enough to tell system prompts apart
    # A non-streaming answer up to this size is read whole before the client sees a byte, so a
    # replica that dies mid-body is retried instead of truncating the answer.
    buffer_limit: int = 8 * 1024 * 1024
    body_timeout_s: float = 600.0  # a whole non-streaming answer, from arrival
    # A client must deliver its whole request body within this: a body trickled a byte at a
    # time (slow loris) would otherwise hold a connection and a handler forever.
    request_body_timeout_s: float = 30.0
    access_log: bool = True


@dataclass(slots=True)
class _Answer:
    response: UpstreamResponse
    buffered: list[bytes]
    complete: bool  # the whole body is in `buffered`
    event_stream: bool
    # One iterator over the body for the whole request: a second chunks() call would start a
    # second reader (and its clean-up would release the connection under the first).
    body: AsyncIterator[bytes] = field(init=False)

    def __post_init__(self) -> None:
        self.body = self.response.chunks()


def openai_error(status: int, message: str, code: str, **headers: str) -> web.Response:
    return web.Response(
        status=status,
        body=error_body(status, message, code),
        content_type="application/json",
        headers=headers or None,
    )


def split_passthrough(raw_target: str) -> tuple[str, str]:
    """`/c/<cluster>/<path>?<query>` as the client sent it: the cluster segment (still
    percent-encoded) and the target its replica gets, `/<path>?<query>`, unchanged."""
    rest = raw_target[3:]
    cut = len(rest)
    for separator in "/?":
        at = rest.find(separator)
        if 0 <= at < cut:
            cut = at
    tail = rest[cut:]
    return rest[:cut], tail if tail.startswith("/") else "/" + tail


def send_error(
    sink: Sink, status: int, message: str, code: str, request_id: str = "", **headers: str
) -> None:
    """An OpenAI-shaped error answer through `sink`."""
    extra = [*JSON_HEADERS, *headers.items()]
    if request_id:
        extra.append(("X-Request-Id", request_id))
    sink.send(status, extra, error_body(status, message, code))


# What Retry-After may say at most: a limit that could never admit (math.inf) is no reason to
# answer 500 (math.ceil(inf) raises).
_LONGEST_RETRY_AFTER_S = 3600.0


class Proxy:
    def __init__(
        self,
        router: Router,
        dispatcher: Dispatcher,
        transport: Transport,
        instruments: Instruments,
        keys: KeyRing,
        settings: ProxySettings,
        log: Any,
        access_log: AccessLog | None = None,
    ) -> None:
        self.access_log = access_log or StructlogAccessLog(log)
        self.router = router
        self.dispatcher = dispatcher
        self.transport = transport
        self.instruments = instruments
        self.keys = keys
        self.settings = settings
        self.log = log
        self._ids = itertools.count(1)
        # The handlers of requests in flight: when the shutdown grace ends, the gateway cuts
        # them (cut_in_flight) while their clients are still connected, so an event stream can
        # end with an error event instead of a silent cut.
        self._in_flight: set[asyncio.Task[Any]] = set()
        self._cut = False
        # `--trace`: a span per request (gateway/tracing.py). None: no tracing, no cost.
        self.tracer: RequestTracer | None = None

    def cut_in_flight(self) -> None:
        """The shutdown grace is over: cancel every request still in flight. An event stream
        gets `event: error` (code gateway_shutdown) first; any other answer is cut."""
        self._cut = True
        for task in list(self._in_flight):
            task.cancel()

    def new_request_id(self) -> str:
        return f"{self.settings.gateway_id}-{next(self._ids):x}"

    # -- routes --------------------------------------------------------------------------
    # The aiohttp handlers serve what the front hands to aiohttp (gateway/front.py); the
    # serve_* methods are the routes themselves, for either server.

    async def openai(self, request: web.Request) -> web.StreamResponse:
        """OPENAI_PATHS: routed by `model`."""
        inbound, sink = AiohttpInbound(request), AiohttpSink(request)
        if (tenant := self.admit(inbound, sink)) is None:
            return _answer(sink)
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        with self.in_flight_here():
            await self.serve_openai(inbound, sink, tenant, request.path_qs, body)
        return _answer(sink)

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """/c/<cluster>/<path>: any other HTTP API of a cluster, forwarded as it is."""
        inbound, sink = AiohttpInbound(request), AiohttpSink(request)
        if (tenant := self.admit(inbound, sink)) is None:
            return _answer(sink)
        cluster = request.match_info["cluster"]
        _, target = split_passthrough(request.raw_path)
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        with self.in_flight_here():
            await self.serve_passthrough(inbound, sink, tenant, cluster, target, body)
        return _answer(sink)

    async def serve_openai(
        self, inbound: Inbound, sink: Sink, tenant: Tenant, target: str, body: bytes
    ) -> None:
        try:
            parsed = _BODY.decode(body)
        except msgspec.DecodeError as exc:
            send_error(sink, 400, f"the body is not a valid request: {exc}", "invalid_body")
            return
        if not parsed.model:
            send_error(sink, 400, "`model` is required: one of GET /v1/models", "missing_model")
            return
        # An inference call changes nothing on the replica: repeating it after a failure is
        # what keeps clients from seeing errors a healthy replica could have answered.
        request = _Exchange(self, inbound, sink, tenant, parsed.model, target, body)
        await self._forward(request, self._affinity_key(parsed), repeatable=True)

    async def serve_passthrough(
        self, inbound: Inbound, sink: Sink, tenant: Tenant, cluster: str, target: str, body: bytes
    ) -> None:
        # Any API at all: a POST may create something, so it is repeated only when the client
        # says it is safe to (an Idempotency-Key) or the method is idempotent (RFC 9110 9.2.2).
        repeatable = (
            inbound.method in _IDEMPOTENT_METHODS or inbound.header("idempotency-key") is not None
        )
        request = _Exchange(self, inbound, sink, tenant, cluster, target, body)
        await self._forward(request, "", repeatable=repeatable)

    async def _read_body(self, request: web.Request) -> bytes | web.Response:
        limit = self.settings.request_body_timeout_s
        try:
            async with asyncio.timeout(limit):
                return await request.read()
        except TimeoutError:
            answer = openai_error(
                408, f"the request body did not arrive within {limit:g} s", "request_timeout"
            )
            answer.force_close()  # the connection is spent: a body half read
            return answer

    async def models(self, request: web.Request) -> web.StreamResponse:
        sink = AiohttpSink(request)
        tenant = self.admit(AiohttpInbound(request), sink)
        if tenant is None:
            return _answer(sink)
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "gpumesh"}
            for name in self.router.models()
            if tenant.reaches(self.router.resolve(name))
        ]
        return web.Response(
            body=_JSON.encode({"object": "list", "data": data}), content_type="application/json"
        )

    # -- the data path -------------------------------------------------------------------

    def admit(self, inbound: Inbound, sink: Sink) -> Tenant | None:
        """The caller's tenant; or None, having turned it away through `sink` (401, 429)."""
        if not self.keys.enabled:
            return ANONYMOUS
        tenant = self.keys.authenticate(inbound.header("authorization"))
        if tenant is None:
            send_error(
                sink,
                401,
                "missing or unknown API key (Authorization: Bearer <key>)",
                "invalid_api_key",
            )
            return None
        wait = min(self.keys.admit(tenant), _LONGEST_RETRY_AFTER_S)
        if wait > 0:
            self.instruments.rate_limited(tenant.name)
            spent = self.keys.quota(tenant).spent
            what, code = ("token budget", "tokens_exhausted") if spent else ("rate limit", "")
            send_error(
                sink,
                429,
                f"{what} of tenant {tenant.name!r} exceeded; retry in {wait:.2f} s",
                code or "rate_limited",
                **{"Retry-After": str(max(1, math.ceil(wait)))},
            )
            return None
        return tenant

    def _affinity_key(self, body: _OpenAIBody) -> str:
        match self.settings.affinity:
            case "user":
                return body.user
            case "prefix":
                raw = body.messages or body.prompt or body.input
                return bytes(raw)[: self.settings.affinity_prefix_bytes].decode("utf-8", "replace")
            case _:
                return ""

    @contextlib.contextmanager
    def in_flight_here(self) -> Iterator[None]:
        """The current handler, known to cut_in_flight() while inside."""
        task = asyncio.current_task()
        if task is None:
            yield
            return
        self._in_flight.add(task)
        if self._cut:
            task.cancel()  # arrived after the grace: no time left to serve it
        try:
            yield
        finally:
            self._in_flight.discard(task)

    async def _forward(self, request: _Exchange, key: str, *, repeatable: bool) -> None:
        """One request, start to end: its cluster resolved; the dispatcher's way to an answer,
        every attempt and retry its own (each attempt is `request.attempt`, then
        `request.settle`); the answer passed on. Or, if none came, the reply its
        DispatchError earns (`refuse`). Counted, logged (and traced) however it ends."""
        trace = None if self.tracer is None else self.tracer.start(request)
        request.trace = trace
        refused: DispatchError | None = None
        try:
            self._resolve(request)
            route, answer = await self.dispatcher.run(
                request.cluster,
                request.attempt,
                key=key,
                repeatable=repeatable,
                settle=request.settle,
                trace=trace,
            )
            request.status = answer.response.status
            await self._respond(request, route, answer)
        except DispatchError as error:
            refused = error
            request.status = error.status
            refuse(
                request.sink,
                error,
                request.request_id,
                request.inbound.method,
                lambda: self._known_to(request.tenant),
            )
        finally:
            self._record(request)
            if trace is not None:
                trace.end(request, refused)

    def _resolve(self, request: _Exchange) -> None:
        """The request's cluster by its own name, then the one that serves it (its canary's,
        for the canary's share of a split cluster: Dispatcher.pick_cluster), which its
        metrics label, access log line and load count name; or the DispatchError for a
        gateway without a table yet, or a cluster the caller may not reach."""
        if self.router.position == 0:
            raise NotReady()
        cluster = request.cluster = self.router.resolve(request.cluster)
        request.label = cluster if self.router.known(cluster) else "unknown"
        if not request.tenant.reaches(cluster):
            # Another tenant's cluster does not exist, as far as this key can tell.
            request.label = "unknown"
            raise UnknownCluster(cluster, lists_known=False)
        # After the tenant's check: a key that reaches a cluster reaches its canary's share.
        served = self.dispatcher.pick_cluster(cluster)
        if served != cluster:
            request.cluster = request.label = served

    def _known_to(self, tenant: Tenant) -> list[str]:
        """The models this tenant may be told exist."""
        return [m for m in self.router.models() if tenant.reaches(self.router.resolve(m))]

    def _record(self, request: _Exchange) -> None:
        elapsed = asyncio.get_running_loop().time() - request.started
        self.instruments.request(request.label, request.status, elapsed)
        if self.settings.access_log:
            route = request.route
            self.access_log.request(
                {
                    "request_id": request.request_id,
                    "method": request.inbound.method,
                    "path": request.path,
                    "cluster": request.cluster,
                    "replica": route.replica_id if route else None,
                    "status": request.status,
                    "attempts": request.attempts,
                    "duration_ms": round(elapsed * 1000, 2),
                }
            )

    def _finish(self, request: _Exchange, route: RouteEntry, outcome: Outcome) -> None:
        self.dispatcher.finished(request.cluster, route, outcome, request.trace)

    async def _open(self, route: RouteEntry, upstream: UpstreamRequest) -> _Answer:
        response = await self.transport.open(route, upstream)
        if response.status >= 500:
            await response.aclose()
            raise UpstreamStatus(route.replica_id, response.status)
        answer = _Answer(
            response, [], complete=False, event_stream=_is_event_stream(response.headers)
        )
        if answer.event_stream:
            # A stream server sends its head before its first token. Hold the client's head
            # until the first chunk, inside the attempt: a replica that dies before it has said
            # anything is retried elsewhere, invisibly, instead of cutting a stream.
            try:
                answer.buffered.append(await anext(answer.body))
            except StopAsyncIteration:
                answer.complete = True
            except StreamBroken as exc:
                await response.aclose()
                raise ResetBeforeHead(
                    route.replica_id, f"stream ended before its first chunk: {exc.detail}"
                ) from exc
        elif getattr(response, "complete", False):
            # The whole body came with the head (the usual non-streaming answer over the
            # direct transport): no reader, no timer.
            answer.buffered.append(response.take_buffered())  # type: ignore[attr-defined]
            answer.complete = True
        return answer

    async def _buffer(self, answer: _Answer, started: float) -> None:
        """Read a non-streaming answer whole before the client sees a byte, so that a replica
        dying mid-body is retried elsewhere. Bounded by `body_timeout_s` from arrival, not by
        the first-byte timeout: a long generation is not a hung replica."""
        left = self.settings.body_timeout_s - (asyncio.get_running_loop().time() - started)
        size = 0
        try:
            async with asyncio.timeout(max(0.0, left)):
                async for chunk in answer.body:
                    answer.buffered.append(chunk)
                    size += len(chunk)
                    if size > self.settings.buffer_limit:
                        return  # too big to hold: the rest is streamed
        except StreamBroken:
            await answer.response.aclose()
            raise
        answer.complete = True

    async def _respond(self, request: _Exchange, route: RouteEntry, answer: _Answer) -> None:
        upstream = answer.response
        headers = [(k, v) for k, v in upstream.headers if k.lower() != "x-request-id"]
        headers.append(("X-Request-Id", request.request_id))
        if not answer.complete:
            await self._stream(request, route, answer, headers)
            return
        self._finish(request, route, "ok")
        buffered = answer.buffered
        body = buffered[0] if len(buffered) == 1 else b"".join(buffered)
        request.sink.send(upstream.status, headers, body)
        if request.tenant.tokens_per_min > 0 and upstream.status < 300:
            self.keys.charge(request.tenant, body_tokens(body))
        await upstream.aclose()

    async def _stream(
        self, request: _Exchange, route: RouteEntry, answer: _Answer, headers: Headers
    ) -> None:
        """An answer whose body is still arriving, passed on as it comes. Once the client has
        the head, a break can only be told in-band (an event stream's last event) or by
        cutting the connection."""
        sink = request.sink
        # A tenant with a token budget: the chunks are read for their usage as they pass.
        usage = (
            StreamUsage(event_stream=answer.event_stream)
            if request.tenant.tokens_per_min > 0 and answer.response.status < 300
            else None
        )
        # Unless the body ends: the client went away (ConnectionResetError, or its handler
        # cancelled), which says nothing about the replica.
        outcome: Outcome = "cancelled"
        try:
            await _pass_on(sink, answer, headers, None if usage is None else usage.feed)
            outcome = "ok"
        except StreamBroken as exc:
            outcome = "stream_broken"
            self.instruments.stream_broken(request.label)
            self.log.warning(
                "stream_broken",
                request_id=request.request_id,
                cluster=request.label,
                replica=route.replica_id,
                error=exc.detail,
            )
            if not answer.event_stream:
                # No in-band way to say it: drop the connection so that the client sees an
                # incomplete body, never a complete-looking truncated one.
                sink.abort()
                return
            message = f"the replica failed mid-stream ({exc.detail}); the answer is incomplete"
            await _write_quietly(sink, _sse_error(message, "stream_broken", request.request_id))
        except asyncio.CancelledError:
            if not await self._ended_by_cut(request, answer):
                raise
        finally:
            if usage is not None:
                # What was sent was used, however the answer ended.
                self.keys.charge(request.tenant, usage.tokens)
            self._finish(request, route, outcome)
            await answer.response.aclose()
        await sink.end()

    async def _ended_by_cut(self, request: _Exchange, answer: _Answer) -> bool:
        """Whether a cancellation is cut_in_flight()'s (the shutdown grace ended) on an event
        stream whose client is still connected; if so, the client is told, and the handler
        ends normally. Any other (the client went away) is the caller's to re-raise."""
        task = asyncio.current_task()
        if not (self._cut and task is not None and answer.event_stream):
            return False
        if request.sink.client_gone():
            return False
        task.uncancel()  # our own cut, handled here
        # Counted as a cut stream; the outcome stays "cancelled", no fault of the replica's.
        self.instruments.stream_broken(request.label)
        self.log.warning(
            "stream_cut_at_shutdown", request_id=request.request_id, cluster=request.label
        )
        message = (
            "the gateway is shutting down and its grace period ended; the answer is incomplete"
        )
        error = _sse_error(message, "gateway_shutdown", request.request_id)
        await _write_quietly(request.sink, error)
        return True


class _Exchange:
    """One request on its way through the proxy: the two steps the dispatcher runs for each
    attempt (`attempt`, then `settle`), and what the metrics and the access log record."""

    __slots__ = (
        "_proxy",
        "attempts",
        "body",
        "cluster",
        "headers",
        "inbound",
        "label",
        "last_failure",
        "path",
        "request_id",
        "route",
        "sink",
        "started",
        "status",
        "tenant",
        "trace",
    )

    def __init__(
        self,
        proxy: Proxy,
        inbound: Inbound,
        sink: Sink,
        tenant: Tenant,
        cluster: str,
        path: str,
        body: bytes,
    ) -> None:
        self._proxy = proxy
        self.started = asyncio.get_running_loop().time()
        self.inbound = inbound
        self.sink = sink
        self.tenant = tenant
        self.path = path
        self.body = body
        # The metrics label, once resolved: only names the routing table knows.
        self.cluster = self.label = cluster
        self.request_id = request_id = inbound.header("x-request-id") or proxy.new_request_id()
        self.headers = [(k, v) for k, v in inbound.header_items() if k.lower() not in _DROP]
        self.headers.append(("X-Request-Id", request_id))
        self.attempts = 0
        self.last_failure = ""  # the outcome a retry is counted under
        self.route: RouteEntry | None = None  # the last that answered with a head
        self.status = 0  # the client went away first, unless set
        self.trace: RequestSpan | None = None

    async def attempt(self, route: RouteEntry, first_byte_timeout: float) -> _Answer:
        """The replica's head (and an event stream's first chunk)."""
        self.attempts += 1
        if self.attempts > 1:
            # No failure seen here means the dispatcher's own first-byte guard fired.
            self._proxy.instruments.retry(self.label, self.last_failure or "first_byte_timeout")
            self.last_failure = ""
        # Built for each attempt, with its own timeout: cheaper than a frozen copy (replace()).
        upstream = UpstreamRequest(
            method=self.inbound.method,
            path=self.path,
            headers=self.headers,
            body=self.body,
            request_id=self.request_id,
            first_byte_timeout=first_byte_timeout,
        )
        try:
            return await self._proxy._open(route, upstream)
        except RequestTooLarge as exc:
            raise TooLarge(str(exc)) from exc  # no replica can take it: not a retry
        except UpstreamError as exc:
            self.last_failure = exc.outcome
            raise

    async def settle(self, route: RouteEntry, answer: _Answer) -> None:
        """The head is in: a body that is not a stream is read whole, so that one breaking
        off goes back to the dispatcher to be retried elsewhere."""
        proxy = self._proxy
        self.route = route
        proxy.instruments.first_byte(self.label, asyncio.get_running_loop().time() - self.started)
        if answer.event_stream or answer.complete:
            return
        try:
            await proxy._buffer(answer, self.started)
        except StreamBroken as exc:
            self.last_failure = exc.outcome
            raise BrokenWhileHeld(exc.replica_id, exc.detail) from exc
        except TimeoutError:
            await answer.response.aclose()
            raise AnswerTimeout(proxy.settings.body_timeout_s) from None


class NotReady(DispatchError):
    """No routing table has arrived yet: nothing can be routed, and nothing is unknown."""

    retry_after_s = 1.0

    def __init__(self) -> None:
        super().__init__(503, "not_ready", "the gateway has not received a routing table yet")


class TooLarge(DispatchError):
    """The transport cannot carry this request to any replica (the overlay's size limit)."""

    def __init__(self, message: str) -> None:
        super().__init__(413, "too_large", message)


class AnswerTimeout(DispatchError):
    """A non-streaming answer was not complete within the body timeout (from arrival)."""

    outcome: Outcome = "first_byte_timeout"  # counted against its replica, like a silent one

    def __init__(self, limit_s: float) -> None:
        super().__init__(504, "timeout", f"the answer was not complete within {limit_s:g} s")
        self.limit_s = limit_s


def refuse(
    sink: Sink,
    error: DispatchError,
    request_id: str,
    method: str,
    known: Callable[[], Sequence[str]],
) -> None:
    """The one place where a request that got no answer from a replica gets its reply: the
    error's status, code and message, and what only the request knows (`known`: the models
    the caller may be told of; `method`: why it was not repeated)."""
    message = error.message
    if error.lists_known:
        message += f" (known: {', '.join(known()) or 'none'})"
    if error.not_repeated:
        message += "; " + _not_repeated(method)
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    send_error(sink, error.status, message, error.code, request_id, **headers)


async def _pass_on(
    sink: Sink, answer: _Answer, headers: Headers, watch: Callable[[bytes], None] | None = None
) -> None:
    """The head, what was held back, then the rest of the body as it arrives; `watch` sees
    each chunk of the body (which then does not take the zero-copy relay)."""
    upstream = answer.response
    buffered = answer.buffered
    await sink.start(upstream.status, headers, buffered[0] if buffered else b"")
    for chunk in buffered[1:]:
        await sink.write(chunk)
    if watch is not None:
        for chunk in buffered:
            watch(chunk)
        async for chunk in answer.body:
            watch(chunk)
            await sink.write(chunk)
        return
    relay = getattr(upstream, "relay", None)
    writer = sink.relay_writer(cast(FlowControlled, upstream)) if relay else None
    if relay is None or writer is None:
        async for chunk in answer.body:
            await sink.write(chunk)
        return
    # Both ends can: each chunk goes from the replica's socket to the client's in the replica
    # connection's read callback, with no task wake-up per chunk.
    try:
        await relay(writer)
    finally:
        sink.relay_done()
        close = getattr(answer.body, "aclose", None)
        if close is not None:
            await close()  # the iterator the first chunk came from


def _answer(sink: AiohttpSink) -> web.StreamResponse:
    assert sink.response is not None, "the proxy always answers"
    return sink.response


def _is_event_stream(headers: Sequence[tuple[str, str]]) -> bool:
    for name, value in headers:
        if name.lower() == "content-type":
            return value.startswith("text/event-stream")
    return False


def _sse_error(message: str, code: str, request_id: str) -> bytes:
    """The event that ends a stream the client will not get whole."""
    error = {
        "error": {
            "message": message,
            "type": "upstream_error",
            "code": code,
            "request_id": request_id,
        }
    }
    return b"event: error\ndata: " + _JSON.encode(error) + b"\n\n"


def _not_repeated(method: str) -> str:
    return f"not retried: a {method} is repeated only with an Idempotency-Key"


async def _write_quietly(sink: Sink, data: bytes) -> None:
    try:
        await sink.write(data)
    except ConnectionResetError:
        pass


__all__ = [
    "OPENAI_PATHS",
    "AnswerTimeout",
    "NotReady",
    "Proxy",
    "ProxySettings",
    "TooLarge",
    "openai_error",
    "refuse",
    "send_error",
    "split_passthrough",
]
