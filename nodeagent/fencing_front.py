"""The node's HTTP front for the direct transport: the fence the node itself enforces.

With the direct transport the gateway speaks HTTP to a replica's address. Were that the
workload's own port, a node back from a partition would serve a superseded replica to any
gateway that has not yet seen the new routing table: nothing on the node could refuse. So the
agent advertises each replica at `http://<address>:<front port>/replica/<id>/<epoch>` instead,
and this server forwards to the workload only while the node's lease covers that replica at that
epoch (docs/security.md, "Fencing"). Otherwise it answers 503 `fenced`, which the gateway
retries on another replica before the client sees anything.

The gateway appends the request's path to the address, so it needs no change; streaming
responses are relayed chunk by chunk.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import msgspec
import structlog
from aiohttp import web
from multidict import CIMultiDict

from events.contract.tunnel import HOP_BY_HOP, NOT_DELIVERED, NOT_DELIVERED_HEADER

from .tunnel import Fence, Resolve  # the same two questions the tunnel asks

if TYPE_CHECKING:  # opentelemetry is loaded only with the agent's --trace
    from wire.tracing import FrontSpan, FrontTracer

PREFIX: Final = "/replica/"
CONNECT_TIMEOUT_S: Final = 2.0

_log = structlog.get_logger("gpumesh.front")
_ERROR = msgspec.json.Encoder()
# The agent's `--trace` (nodeagent/cli.py) sets it before the front starts: a span per request,
# a child of the gateway's (docs/tracing.md). None: no tracing.
TRACER: FrontTracer | None = None


def front_path(replica_id: str, epoch: int) -> str:
    return f"{PREFIX}{replica_id}/{epoch}"


def _refuse(status: int, code: str, message: str, *, reached: bool = False) -> web.Response:
    """An error of the front's own. Unless the request `reached` the workload, a 5xx says so
    in NOT_DELIVERED_HEADER, so the gateway may send even a POST to another replica."""
    body = _ERROR.encode({"error": {"message": message, "type": "upstream_error", "code": code}})
    headers = {NOT_DELIVERED_HEADER: code} if status >= 500 and not reached else None
    assert headers is None or code in NOT_DELIVERED
    return web.Response(status=status, body=body, content_type="application/json", headers=headers)


class DirectFront:
    """Serves until cancelled; `url` is set once it listens."""

    def __init__(
        self,
        host: str,
        port: int,
        resolve: Resolve,
        fence: Fence,
        *,
        log: Any = None,
        tracer: FrontTracer | None = None,
    ) -> None:
        """`tracer`: a span per request; default: the module's TRACER."""
        self._host = host
        self._port = port
        self._resolve = resolve
        self._fence = fence
        self._log: Any = (log if log is not None else _log).bind(component="front")
        self._session: aiohttp.ClientSession | None = None
        self.port = 0
        self.listening = asyncio.Event()
        self.fenced = 0  # requests refused, for tests and status
        self.tracer = tracer if tracer is not None else TRACER

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
        async with aiohttp.ClientSession(
            timeout=timeout, connector=connector, auto_decompress=False
        ) as session:
            self._session = session
            server = web.Server(self._handle, handler_cancellation=True)
            runner = web.ServerRunner(server, shutdown_timeout=2.0)
            await runner.setup()
            try:
                site = web.TCPSite(runner, self._host, self._port)
                await site.start()
                self.port = int(runner.addresses[0][1])
                self.listening.set()
                self._log.info("front_listening", host=self._host, port=self.port)
                await asyncio.Event().wait()  # until cancelled
            finally:
                await runner.cleanup()

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        parts = request.rel_url.raw_path.removeprefix(PREFIX).split("/", 2)
        if not request.rel_url.raw_path.startswith(PREFIX) or len(parts) < 2:
            return _refuse(404, "not_found", "expected /replica/<id>/<epoch>/<path>")
        replica_id, epoch_text = parts[0], parts[1]
        rest = "/" + parts[2] if len(parts) == 3 else "/"
        try:
            epoch = int(epoch_text)
        except ValueError:
            return _refuse(404, "not_found", f"epoch {epoch_text!r} is not a number")
        if self.tracer is None:
            return await self._pass(request, replica_id, epoch, rest, None)
        span = self.tracer.start(request.headers.get, replica_id, epoch)
        status = 0  # the gateway went away first
        try:
            response = await self._pass(request, replica_id, epoch, rest, span)
            status = response.status
            return response
        finally:
            span.end(status)

    async def _pass(
        self,
        request: web.BaseRequest,
        replica_id: str,
        epoch: int,
        rest: str,
        span: FrontSpan | None,
    ) -> web.StreamResponse:
        why = self._fence(replica_id, epoch)
        if why:
            self.fenced += 1
            if span is not None:
                span.outcome("fenced", why)
            return _refuse(503, "fenced", why)
        base = self._resolve(replica_id, epoch)
        if base is None:
            why = f"replica {replica_id}@{epoch} does not run here"
            if span is not None:
                span.outcome("unknown_replica", why)
            return _refuse(503, "unknown_replica", why)
        return await self._forward(request, base + rest, span)

    async def _forward(
        self, request: web.BaseRequest, url: str, span: FrontSpan | None = None
    ) -> web.StreamResponse:
        assert self._session is not None
        if request.query_string:
            url = f"{url}?{request.query_string}"
        headers: Any = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        if span is not None:
            headers = span.headers(list(headers.items()))  # the workload's parent: this span
        body = await request.read()
        try:
            upstream = await self._session.request(
                request.method, url, headers=headers, data=body, allow_redirects=False
            )
        except aiohttp.ClientConnectorError as exc:
            if span is not None:
                span.outcome("connect_error", str(exc))
            return _refuse(502, "connect_error", f"the workload did not answer: {exc}")
        except (aiohttp.ClientError, OSError) as exc:
            if span is not None:
                span.outcome("reset", str(exc))
            # Connected, so the workload may have seen the request before it went away.
            return _refuse(502, "reset", f"the workload did not answer: {exc}", reached=True)
        async with upstream:
            if upstream.content.is_eof() and request.method != "HEAD":
                return await _whole(upstream, span)
            response = web.StreamResponse(status=upstream.status)
            for name, value in upstream.headers.items():
                if name.lower() not in HOP_BY_HOP:
                    response.headers.add(name, value)
            await response.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await response.write(chunk)
            except (aiohttp.ClientError, OSError):
                # The workload died mid-answer: end the client's connection without a clean
                # end, so the gateway sees a broken stream rather than a short success.
                if request.transport is not None:
                    request.transport.close()
                return response
            await response.write_eof()
            return response


async def _whole(upstream: aiohttp.ClientResponse, span: FrontSpan | None) -> web.StreamResponse:
    """An answer whose body came in with its head (most non-streaming ones) goes on in one
    write, its length known: one TLS record and one send, where relaying it chunk by chunk
    takes more (head and body, then the chunked end). Nothing waits for it."""
    try:
        body = await upstream.read()
    except (aiohttp.ClientError, OSError) as exc:
        if span is not None:
            span.outcome("reset", str(exc))
        return _refuse(502, "reset", f"the workload broke off its answer: {exc}", reached=True)
    headers = [(k, v) for k, v in upstream.headers.items() if k.lower() not in HOP_BY_HOP]
    return web.Response(status=upstream.status, body=body, headers=CIMultiDict(headers))
