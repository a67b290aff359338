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
from typing import Any, Literal

import msgspec
from aiohttp import web

from events.messages import RouteEntry
from events.tunnel import HOP_BY_HOP

from .auth import ANONYMOUS, KeyRing, Tenant
from .dispatch import AttemptsExhausted, Dispatcher, NoReadyReplica, UnknownCluster
from .instruments import Instruments
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
_ERROR = msgspec.json.Encoder()
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


def _with_id(response: web.Response, request_id: str) -> web.Response:
    response.headers["X-Request-Id"] = request_id
    return response


def openai_error(status: int, message: str, code: str, **headers: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "upstream_error"
    body = _ERROR.encode({"error": {"message": message, "type": kind, "code": code}})
    return web.Response(
        status=status, body=body, content_type="application/json", headers=headers or None
    )


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
    ) -> None:
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

    async def openai(self, request: web.Request) -> web.StreamResponse:
        """/v1/chat/completions, /v1/completions, /v1/embeddings: routed by `model`."""
        tenant = self._admit(request)
        if isinstance(tenant, web.Response):
            return tenant
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            parsed = _BODY.decode(body)
        except msgspec.DecodeError as exc:
            return openai_error(400, f"the body is not a valid request: {exc}", "invalid_body")
        if not parsed.model:
            return openai_error(400, "`model` is required: one of GET /v1/models", "missing_model")
        # An inference call changes nothing on the replica: repeating it after a failure is
        # what keeps clients from seeing errors a healthy replica could have answered.
        with self._in_flight_here():
            return await self._forward(
                request,
                tenant,
                parsed.model,
                request.path_qs,
                body,
                self._affinity_key(parsed),
                repeatable=True,
            )

    async def passthrough(self, request: web.Request) -> web.StreamResponse:
        """/c/<cluster>/<path>: any other HTTP API of a cluster, forwarded as it is."""
        tenant = self._admit(request)
        if isinstance(tenant, web.Response):
            return tenant
        cluster = request.match_info["cluster"]
        tail = request.match_info.get("tail", "")
        query = f"?{request.query_string}" if request.query_string else ""
        body = await self._read_body(request)
        if isinstance(body, web.Response):
            return body
        # Any API at all: a POST may create something, so it is repeated only when the client
        # says it is safe to (an Idempotency-Key) or the method is idempotent (RFC 9110 9.2.2).
        repeatable = request.method in _IDEMPOTENT_METHODS or "Idempotency-Key" in request.headers
        with self._in_flight_here():
            return await self._forward(
                request, tenant, cluster, f"/{tail}{query}", body, "", repeatable=repeatable
            )

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

    async def models(self, request: web.Request) -> web.Response:
        tenant = self._admit(request)
        if isinstance(tenant, web.Response):
            return tenant
        data = [
            {"id": name, "object": "model", "created": 0, "owned_by": "gpumesh"}
            for name in self.router.models()
            if tenant.reaches(self.router.resolve(name))
        ]
        return web.Response(
            body=_ERROR.encode({"object": "list", "data": data}), content_type="application/json"
        )

    # -- the data path -------------------------------------------------------------------

    def _admit(self, request: web.Request) -> Tenant | web.Response:
        """The caller's tenant, or the answer that turns it away (401, 429)."""
        if not self.keys.enabled:
            return ANONYMOUS
        tenant = self.keys.authenticate(request.headers.get("Authorization"))
        if tenant is None:
            return openai_error(
                401, "missing or unknown API key (Authorization: Bearer <key>)", "invalid_api_key"
            )
        wait = self.keys.admit(tenant)
        if wait > 0:
            self.instruments.rate_limited(tenant.name)
            return openai_error(
                429,
                f"rate limit of tenant {tenant.name!r} exceeded; retry in {wait:.2f} s",
                "rate_limited",
                **{"Retry-After": str(max(1, math.ceil(wait)))},
            )
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
    def _in_flight_here(self) -> Iterator[None]:
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
        request: web.Request,
        tenant: Tenant,
        cluster: str,
        path: str,
        body: bytes,
        key: str,
        *,
        repeatable: bool,
    ) -> web.StreamResponse:
        loop = asyncio.get_running_loop()
        started = loop.time()
        request_id = request.headers.get("X-Request-Id") or self.new_request_id()
        upstream = UpstreamRequest(
            method=request.method,
            path=path,
            # str(): aiohttp's names are `istr`, which a tunnel frame cannot encode.
            headers=[
                *((str(k), v) for k, v in request.headers.items() if k.lower() not in _DROP),
                ("X-Request-Id", request_id),
            ],
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
                return _with_id(
                    openai_error(
                        503,
                        "the gateway has not received a routing table yet",
                        "not_ready",
                        **{"Retry-After": "1"},
                    ),
                    request_id,
                )
            cluster = self.router.resolve(cluster)
            label = cluster if self.router.known(cluster) else "unknown"
            if not tenant.reaches(cluster):
                # Another tenant's cluster does not exist, as far as this key can tell.
                label, status = "unknown", 404
                return _with_id(
                    openai_error(404, f"The model `{cluster}` does not exist", "model_not_found"),
                    request_id,
                )
            broken: StreamBroken | None = None
            for _ in range(self.dispatcher.policy.max_attempts):
                try:
                    route, answer = await self.dispatcher.run(
                        cluster, attempt, key=key, repeatable=repeatable
                    )
                except _TooLarge as exc:
                    status = 413
                    return _with_id(openai_error(413, str(exc), "too_large"), request_id)
                except UnknownCluster:
                    models = self.router.models()
                    reachable = [m for m in models if tenant.reaches(self.router.resolve(m))]
                    known = ", ".join(reachable) or "none"
                    status = 404
                    return _with_id(
                        openai_error(
                            404,
                            f"The model `{cluster}` does not exist (known: {known})",
                            "model_not_found",
                        ),
                        request_id,
                    )
                except NoReadyReplica as exc:
                    status = 503
                    return _with_id(
                        openai_error(
                            503,
                            f"cluster {cluster!r} has no ready replica",
                            "no_ready_replica",
                            **{"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))},
                        ),
                        request_id,
                    )
                except AttemptsExhausted as exc:
                    timed_out = isinstance(exc.last, FirstByteTimeout)
                    status = 504 if timed_out else 502
                    why = ""
                    if not repeatable and not exc.last.never_delivered:
                        why = "; " + _not_repeated(request.method)
                    return _with_id(
                        openai_error(
                            status,
                            f"no replica of {cluster!r} answered after {exc.attempts} "
                            f"attempt(s); last: {exc.last}{why}",
                            exc.last.outcome,
                        ),
                        request_id,
                    )
                self.instruments.first_byte(label, loop.time() - started)
                if not answer.event_stream:
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
                        return _with_id(
                            openai_error(
                                502,
                                f"the answer broke off before its end ({exc}); "
                                + _not_repeated(request.method),
                                "reset",
                            ),
                            request_id,
                        )
                    except TimeoutError:
                        self._finish(route, "first_byte_timeout")
                        await answer.response.aclose()
                        status = 504
                        return _with_id(
                            openai_error(
                                504,
                                f"the answer was not complete within "
                                f"{self.settings.body_timeout_s:g} s",
                                "timeout",
                            ),
                            request_id,
                        )
                status = answer.response.status
                return await self._respond(request, label, route, answer, request_id)
            status = 502
            return _with_id(
                openai_error(
                    502, f"every answer broke off before its end; last: {broken}", "reset"
                ),
                request_id,
            )
        finally:
            elapsed = loop.time() - started
            self.instruments.request(label, status, elapsed)
            if self.settings.access_log:
                self.log.info(
                    "request",
                    request_id=request_id,
                    method=request.method,
                    path=path,
                    cluster=cluster,
                    replica=route.replica_id if route else None,
                    status=status,
                    attempts=attempts,
                    duration_ms=round(elapsed * 1000, 2),
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
        request: web.Request,
        cluster: str,
        route: RouteEntry,
        answer: _Answer,
        request_id: str,
    ) -> web.StreamResponse:
        upstream = answer.response
        headers = [(k, v) for k, v in upstream.headers if k.lower() != "x-request-id"]
        if answer.complete:
            self._finish(route, "ok")
            response = web.Response(status=upstream.status, body=b"".join(answer.buffered))
            _copy_headers(response, headers, request_id)
            return response
        stream = web.StreamResponse(status=upstream.status)
        _copy_headers(stream, headers, request_id)
        outcome: Any = "cancelled"
        task = asyncio.current_task()
        try:
            await stream.prepare(request)
            for chunk in answer.buffered:
                await stream.write(chunk)
            async for chunk in answer.body:
                await stream.write(chunk)
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
                await _write_quietly(stream, _sse_error(message, "stream_broken", request_id))
            else:
                # No in-band way to say it: drop the connection so that the client sees an
                # incomplete body, never a complete-looking truncated one.
                if request.transport is not None:
                    request.transport.abort()
                return stream
        except ConnectionResetError:
            raise  # the client went away; `finally` records it as cancelled
        except asyncio.CancelledError:
            # The client went away (aiohttp cancels its handler), or cut_in_flight() ended the
            # shutdown grace while the client is still connected.
            if not (self._cut and task is not None and answer.event_stream):
                raise
            if _client_gone(request):
                raise
            task.uncancel()  # our own cut, handled here: the handler ends normally
            # Counted as a cut stream; the outcome stays "cancelled", no fault of the replica's.
            self.instruments.stream_broken(cluster)
            self.log.warning("stream_cut_at_shutdown", request_id=request_id, cluster=cluster)
            message = (
                "the gateway is shutting down and its grace period ended; the answer is incomplete"
            )
            await _write_quietly(stream, _sse_error(message, "gateway_shutdown", request_id))
        finally:
            ejection = self.router.finished(route, outcome)
            if ejection is not None:
                self.dispatcher.on_ejection(ejection)
            await upstream.aclose()
        await _write_eof_quietly(stream)
        return stream


def _is_event_stream(headers: Sequence[tuple[str, str]]) -> bool:
    for name, value in headers:
        if name.lower() == "content-type":
            return value.startswith("text/event-stream")
    return False


def _copy_headers(
    response: web.StreamResponse, headers: Sequence[tuple[str, str]], request_id: str
) -> None:
    for name, value in headers:
        response.headers.add(name, value)
    response.headers["X-Request-Id"] = request_id


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
    return b"event: error\ndata: " + _ERROR.encode(error) + b"\n\n"


def _not_repeated(method: str) -> str:
    return f"not retried: a {method} is repeated only with an Idempotency-Key"


def _client_gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


async def _write_quietly(stream: web.StreamResponse, data: bytes) -> None:
    try:
        await stream.write(data)
    except ConnectionResetError:
        pass


async def _write_eof_quietly(stream: web.StreamResponse) -> None:
    try:
        await stream.write_eof()
    except ConnectionResetError:
        pass


__all__ = ["Proxy", "ProxySettings", "openai_error"]
