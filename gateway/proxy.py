"""The inference data path: pick a ready replica, send, retry around failures, stream back.

Which replica, whether to retry and when to eject are decided by gateway/dispatch.py and
gateway/router.py, which know nothing of HTTP; this module only turns HTTP into attempts and
attempts back into HTTP. Until the client has seen a byte, every failure is retried elsewhere;
after that, a streamed answer that breaks ends with an explicit SSE error event.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal, cast

import msgspec
from aiohttp import web

from events.contract.messages import RouteEntry
from events.contract.tunnel import HOP_BY_HOP

from .access_log import AccessLog, StructlogAccessLog
from .auth import ANONYMOUS, KeyRing, Tenant
from .dispatch import AttemptsExhausted, Dispatcher, NoReadyReplica, UnknownCluster
from .instruments import Instruments
from .reply import (
    JSON_HEADERS,
    AiohttpInbound,
    AiohttpSink,
    FlowControlled,
    Inbound,
    Sink,
    error_body,
)
from .router import Router
from .transport.base import (
    FirstByteTimeout,
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

Affinity = Literal["off", "prefix", "user"]


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


class _TooLarge(Exception):
    """The transport cannot carry this request to any replica (the overlay's size limit)."""


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
        """/v1/chat/completions, /v1/completions, /v1/embeddings: routed by `model`."""
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
        await self._forward(
            inbound,
            sink,
            tenant,
            parsed.model,
            target,
            body,
            self._affinity_key(parsed),
            repeatable=True,
        )

    async def serve_passthrough(
        self, inbound: Inbound, sink: Sink, tenant: Tenant, cluster: str, target: str, body: bytes
    ) -> None:
        # Any API at all: a POST may create something, so it is repeated only when the client
        # says it is safe to (an Idempotency-Key) or the method is idempotent (RFC 9110 9.2.2).
        repeatable = (
            inbound.method in _IDEMPOTENT_METHODS or inbound.header("idempotency-key") is not None
        )
        await self._forward(inbound, sink, tenant, cluster, target, body, "", repeatable=repeatable)

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
        wait = self.keys.admit(tenant)
        if wait > 0:
            self.instruments.rate_limited(tenant.name)
            send_error(
                sink,
                429,
                f"rate limit of tenant {tenant.name!r} exceeded; retry in {wait:.2f} s",
                "rate_limited",
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

    async def _forward(
        self,
        inbound: Inbound,
        sink: Sink,
        tenant: Tenant,
        cluster: str,
        path: str,
        body: bytes,
        key: str,
        *,
        repeatable: bool,
    ) -> None:
        loop = asyncio.get_running_loop()
        started = loop.time()
        request_id = inbound.header("x-request-id") or self.new_request_id()
        headers = [(k, v) for k, v in inbound.header_items() if k.lower() not in _DROP]
        headers.append(("X-Request-Id", request_id))
        upstream = UpstreamRequest(
            method=inbound.method,
            path=path,
            headers=headers,
            body=body,
            request_id=request_id,
            first_byte_timeout=0.0,
        )
        attempts = 0
        last_failure = ""

        async def attempt(route: RouteEntry, first_byte_timeout: float) -> _Answer:
            nonlocal attempts, last_failure
            attempts += 1
            if attempts > 1:
                # No failure seen here means the dispatcher's own first-byte guard fired.
                self.instruments.retry(label, last_failure or "first_byte_timeout")
                last_failure = ""
            try:
                return await self._attempt(
                    route, replace(upstream, first_byte_timeout=first_byte_timeout)
                )
            except RequestTooLarge as exc:
                raise _TooLarge(str(exc)) from exc  # no replica can take it: not a retry
            except UpstreamError as exc:
                last_failure = exc.outcome
                raise

        status = 0
        route: RouteEntry | None = None
        label = cluster  # the metrics label: only names the routing table knows
        try:
            if self.router.position == 0:
                status = 503
                send_error(
                    sink,
                    503,
                    "the gateway has not received a routing table yet",
                    "not_ready",
                    request_id,
                    **{"Retry-After": "1"},
                )
                return
            cluster = self.router.resolve(cluster)
            label = cluster if self.router.known(cluster) else "unknown"
            if not tenant.reaches(cluster):
                # Another tenant's cluster does not exist, as far as this key can tell.
                label, status = "unknown", 404
                send_error(
                    sink,
                    404,
                    f"The model `{cluster}` does not exist",
                    "model_not_found",
                    request_id,
                )
                return
            broken: StreamBroken | None = None
            for _ in range(self.dispatcher.policy.max_attempts):
                try:
                    route, answer = await self.dispatcher.run(
                        cluster, attempt, key=key, repeatable=repeatable
                    )
                except _TooLarge as exc:
                    status = 413
                    send_error(sink, 413, str(exc), "too_large", request_id)
                    return
                except UnknownCluster:
                    models = self.router.models()
                    reachable = [m for m in models if tenant.reaches(self.router.resolve(m))]
                    known = ", ".join(reachable) or "none"
                    status = 404
                    send_error(
                        sink,
                        404,
                        f"The model `{cluster}` does not exist (known: {known})",
                        "model_not_found",
                        request_id,
                    )
                    return
                except NoReadyReplica as exc:
                    status = 503
                    send_error(
                        sink,
                        503,
                        f"cluster {cluster!r} has no ready replica",
                        "no_ready_replica",
                        request_id,
                        **{"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))},
                    )
                    return
                except AttemptsExhausted as exc:
                    timed_out = isinstance(exc.last, FirstByteTimeout)
                    status = 504 if timed_out else 502
                    why = ""
                    if not repeatable and not exc.last.never_delivered:
                        why = "; " + _not_repeated(inbound.method)
                    send_error(
                        sink,
                        status,
                        f"no replica of {cluster!r} answered after {exc.attempts} "
                        f"attempt(s); last: {exc.last}{why}",
                        exc.last.outcome,
                        request_id,
                    )
                    return
                self.instruments.first_byte(label, loop.time() - started)
                if not answer.event_stream and not answer.complete:
                    try:
                        await self._buffer(answer, started)
                    except StreamBroken as exc:
                        # Nothing reached the client yet: another replica can answer in full,
                        # if the request may be repeated (this one reached a replica).
                        broken = exc
                        last_failure = exc.outcome
                        self._finish(route, "stream_broken")
                        if repeatable:
                            continue
                        status = 502
                        send_error(
                            sink,
                            502,
                            f"the answer broke off before its end ({exc}); "
                            + _not_repeated(inbound.method),
                            "reset",
                            request_id,
                        )
                        return
                    except TimeoutError:
                        self._finish(route, "first_byte_timeout")
                        await answer.response.aclose()
                        status = 504
                        send_error(
                            sink,
                            504,
                            f"the answer was not complete within "
                            f"{self.settings.body_timeout_s:g} s",
                            "timeout",
                            request_id,
                        )
                        return
                status = answer.response.status
                await self._respond(sink, label, route, answer, request_id)
                return
            status = 502
            send_error(
                sink,
                502,
                f"every answer broke off before its end; last: {broken}",
                "reset",
                request_id,
            )
        finally:
            elapsed = loop.time() - started
            self.instruments.request(label, status, elapsed)
            if self.settings.access_log:
                self.access_log.request(
                    {
                        "request_id": request_id,
                        "method": inbound.method,
                        "path": path,
                        "cluster": cluster,
                        "replica": route.replica_id if route else None,
                        "status": status,
                        "attempts": attempts,
                        "duration_ms": round(elapsed * 1000, 2),
                    }
                )

    def _finish(self, route: RouteEntry, outcome: Outcome) -> None:
        ejection = self.router.finished(route, outcome)
        if ejection is not None:
            self.dispatcher.on_ejection(ejection)

    async def _attempt(self, route: RouteEntry, upstream: UpstreamRequest) -> _Answer:
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

    async def _respond(
        self,
        sink: Sink,
        cluster: str,
        route: RouteEntry,
        answer: _Answer,
        request_id: str,
    ) -> None:
        upstream = answer.response
        headers = [(k, v) for k, v in upstream.headers if k.lower() != "x-request-id"]
        headers.append(("X-Request-Id", request_id))
        if answer.complete:
            self._finish(route, "ok")
            buffered = answer.buffered
            sink.send(
                upstream.status, headers, buffered[0] if len(buffered) == 1 else b"".join(buffered)
            )
            await upstream.aclose()
            return
        outcome: Any = "cancelled"
        task = asyncio.current_task()
        try:
            buffered = answer.buffered
            await sink.start(upstream.status, headers, buffered[0] if buffered else b"")
            for chunk in buffered[1:]:
                await sink.write(chunk)
            relay = getattr(upstream, "relay", None)
            writer = sink.relay_writer(cast(FlowControlled, upstream)) if relay else None
            if relay is not None and writer is not None:
                # Both ends can: each chunk goes from the replica's socket to the client's in
                # the replica connection's read callback, with no task wake-up per chunk.
                try:
                    await relay(writer)
                finally:
                    sink.relay_done()
                    close = getattr(answer.body, "aclose", None)
                    if close is not None:
                        await close()  # the iterator the first chunk came from
            else:
                async for chunk in answer.body:
                    await sink.write(chunk)
            outcome = "ok"
        except StreamBroken as exc:
            outcome = "stream_broken"
            self.instruments.stream_broken(cluster)
            self.log.warning(
                "stream_broken",
                request_id=request_id,
                cluster=cluster,
                replica=route.replica_id,
                error=exc.detail,
            )
            if answer.event_stream:
                message = f"the replica failed mid-stream ({exc.detail}); the answer is incomplete"
                await _write_quietly(sink, _sse_error(message, "stream_broken", request_id))
            else:
                # No in-band way to say it: drop the connection so that the client sees an
                # incomplete body, never a complete-looking truncated one.
                sink.abort()
                return
        except ConnectionResetError:
            raise  # the client went away; `finally` records it as cancelled
        except asyncio.CancelledError:
            # The client went away (its handler is cancelled), or cut_in_flight() ended the
            # shutdown grace while the client is still connected.
            if not (self._cut and task is not None and answer.event_stream):
                raise
            if sink.client_gone():
                raise
            task.uncancel()  # our own cut, handled here: the handler ends normally
            # Counted as a cut stream; the outcome stays "cancelled", no fault of the replica's.
            self.instruments.stream_broken(cluster)
            self.log.warning("stream_cut_at_shutdown", request_id=request_id, cluster=cluster)
            message = (
                "the gateway is shutting down and its grace period ended; the answer is incomplete"
            )
            await _write_quietly(sink, _sse_error(message, "gateway_shutdown", request_id))
        finally:
            ejection = self.router.finished(route, outcome)
            if ejection is not None:
                self.dispatcher.on_ejection(ejection)
            await upstream.aclose()
        await sink.end()


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


__all__ = ["Proxy", "ProxySettings", "openai_error", "send_error", "split_passthrough"]
