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

With `FrontTLS` (a secured stack: `gpumesh up`, or an agent with NATS credentials) the front
is mutual TLS: it serves only a caller whose certificate the stack's CA signed, names the
`gateway` role, and is not in the CA's revocation list, which it re-reads when it changes,
closing the connections of a certificate it newly revokes (docs/security.md, "The node
front"). Without it the front checks no caller: the development path, announced by the agent.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

import aiohttp
import msgspec
import structlog
from aiohttp import web
from multidict import CIMultiDict

from events.contract.tunnel import HOP_BY_HOP, NOT_DELIVERED, NOT_DELIVERED_HEADER
from wire.crl_share import read_crl
from wire.nats_access import tls_identity

from .tunnel import Fence, Resolve  # the same two questions the tunnel asks

if TYPE_CHECKING:  # opentelemetry is loaded only with the agent's --trace
    from wire.tracing import FrontSpan, FrontTracer

PREFIX: Final = "/replica/"
CONNECT_TIMEOUT_S: Final = 2.0
# How often the revocation list's file is looked at: a revoked gateway's connections close
# within this (and the time to read the list) of the new list landing.
CRL_POLL_S: Final = 0.25
SERVES: Final = "gateway"  # the one role a front serves

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


@dataclass(frozen=True, slots=True)
class FrontTLS:
    """Mutual TLS for a front: `context` serves the node's certificate and requires a
    certificate of the stack's CA (`ca_pem`) of every caller; `crl`, the CA's revocation list,
    is re-read when it changes (a missing file: nothing revoked yet)."""

    context: ssl.SSLContext
    ca_pem: str
    crl: Path | None = None


@dataclass(frozen=True, slots=True)
class _Caller:
    role: str
    name: str
    serial: int


class _Server(web.Server):
    """aiohttp's low-level server, noting each TLS connection's caller as it is made: the
    front checks it on every request, and closes it when its certificate is revoked."""

    def __init__(self, front: DirectFront, **kwargs: Any) -> None:
        super().__init__(front._handle, **kwargs)
        self._front = front

    def connection_made(self, handler: Any, transport: asyncio.Transport) -> None:
        super().connection_made(handler, transport)
        self._front._connected(handler, transport)

    def connection_lost(self, handler: Any, exc: BaseException | None = None) -> None:
        super().connection_lost(handler, exc)
        self._front._callers.pop(handler, None)


class DirectFront:
    """Serves until cancelled; `port` is set once it listens."""

    def __init__(
        self,
        host: str,
        port: int,
        resolve: Resolve,
        fence: Fence,
        *,
        log: Any = None,
        tracer: FrontTracer | None = None,
        tls: FrontTLS | None = None,
    ) -> None:
        """`tracer`: a span per request; default: the module's TRACER. `tls`: serve only
        gateways, over mutual TLS; None: anyone, in plain HTTP."""
        self._host = host
        self._port = port
        self._resolve = resolve
        self._fence = fence
        self._log: Any = (log if log is not None else _log).bind(component="front")
        self._session: aiohttp.ClientSession | None = None
        self._tls = tls
        # Each open TLS connection's caller (by its aiohttp protocol), and the serials the
        # CA's list revokes.
        self._callers: dict[Any, tuple[asyncio.Transport, _Caller | None]] = {}
        self._revoked: frozenset[int] = frozenset()
        self._crl_seen: tuple[int, int, int] | None = None
        self.port = 0
        self.listening = asyncio.Event()
        self.fenced = 0  # requests refused, for tests and status
        self.refused = 0  # callers refused (no gateway certificate, or a revoked one)
        self.handshakes = 0  # TLS connections accepted: with keep-alive, far fewer than requests
        self.tracer = tracer if tracer is not None else TRACER

    def configure(self, *, host: str, tls: FrontTLS | None) -> None:
        """Where to listen and whether mutual TLS, when whoever runs the front knows better
        than whoever built it (the agent's command line); before `run()`."""
        assert not self.listening.is_set(), "the front already listens"
        self._host = host
        self._tls = tls

    @property
    def tls(self) -> bool:
        return self._tls is not None

    @property
    def crl(self) -> tuple[Path, str] | None:
        """The revocation list's file and the CA it must be signed by (None: no TLS)."""
        if self._tls is None or self._tls.crl is None:
            return None
        return self._tls.crl, self._tls.ca_pem

    @property
    def tls_connections(self) -> int:
        """Open TLS connections (a gateway keeps a few alive: a handshake per connection)."""
        return len(self._callers)

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=CONNECT_TIMEOUT_S)
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=60.0)
        tls = self._tls
        async with aiohttp.ClientSession(
            timeout=timeout, connector=connector, auto_decompress=False
        ) as session:
            self._session = session
            self.check_revocations()  # before the first caller
            server = _Server(self, handler_cancellation=True)
            runner = web.ServerRunner(server, shutdown_timeout=2.0)
            await runner.setup()
            try:
                site = web.TCPSite(
                    runner, self._host, self._port, ssl_context=tls.context if tls else None
                )
                try:
                    await site.start()
                except OSError as exc:
                    self._log.error(
                        "front_cannot_listen",
                        host=self._host,
                        port=self._port,
                        error=str(exc),
                        hint="is the address this machine's? Behind NAT give the agent "
                        "--front-listen with a local address (or 0.0.0.0)",
                    )
                    raise
                self.port = int(runner.addresses[0][1])
                self.listening.set()
                self._log.info(
                    "front_listening",
                    host=self._host,
                    port=self.port,
                    tls="mutual, gateways only" if tls else "none: anyone is served",
                )
                if tls is not None and tls.crl is not None:
                    while True:  # until cancelled
                        await asyncio.sleep(CRL_POLL_S)
                        self.check_revocations()
                else:
                    await asyncio.Event().wait()  # until cancelled
            finally:
                await runner.cleanup()

    # -- who calls ---------------------------------------------------------------------------

    def _connected(self, handler: Any, transport: asyncio.Transport) -> None:
        if self._tls is None:
            return
        self.handshakes += 1
        cert = transport.get_extra_info("peercert")
        found = tls_identity(cert)
        caller = None
        if found is not None and cert:
            caller = _Caller(found[0], found[1], int(cert.get("serialNumber", "0"), 16))
        self._callers[handler] = (transport, caller)

    def _refusal(self, request: web.BaseRequest) -> str:
        """Why this TLS caller is not served; "" when it is a gateway in good standing."""
        found = self._callers.get(request.protocol)
        caller = found[1] if found is not None else None
        if caller is None:
            return "the caller's certificate names no gpumesh identity"
        if caller.role != SERVES:
            return f"a {caller.role}'s certificate ({caller.name}): this front serves gateways"
        if caller.serial in self._revoked:
            return f"gateway {caller.name}'s certificate is revoked"
        return ""

    def check_revocations(self) -> None:
        """Read the revocation list again if its file changed, and cut the connections of the
        certificates it newly revokes. The front does it every CRL_POLL_S."""
        if self._tls is None or self._tls.crl is None:
            return
        path, ca_pem = self._tls.crl, self._tls.ca_pem
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return  # none yet; a list that disappears revokes nothing less than before
        except OSError as exc:
            self._log.warning("front_crl_unreadable", path=str(path), error=str(exc))
            return
        seen = (st.st_mtime_ns, st.st_size, st.st_ino)
        if seen == self._crl_seen:
            return
        self._crl_seen = seen
        try:
            revoked = read_crl(path.read_bytes(), ca_pem)
        except (OSError, ValueError) as exc:
            # Keep the list in force: a damaged or forged file must not let anyone back in.
            self._log.error("front_crl_rejected", path=str(path), error=str(exc))
            return
        added = revoked - self._revoked
        self._revoked = self._revoked | revoked
        if not added:
            return
        cut = 0
        for transport, caller in list(self._callers.values()):
            if caller is not None and caller.serial in added:
                transport.abort()
                cut += 1
        self._log.info("front_crl_loaded", revoked=len(self._revoked), connections_closed=cut)

    # -- requests ----------------------------------------------------------------------------

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        if self._tls is not None:
            why = self._refusal(request)
            if why:
                self.refused += 1
                self._log.warning("front_refused", reason=why)
                refusal = _refuse(403, "forbidden", why)
                refusal.force_close()
                return refusal
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
