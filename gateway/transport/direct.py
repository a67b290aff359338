"""The direct transport: HTTP from the gateway to the replica's address, over a keep-alive pool.

One `HttpClient` for every replica: it keeps idle connections per host, so a busy replica is
reached without a TCP handshake per request.

With a TLS context (`secure()`: the gateway's certificate, from its credentials), a node's
front (an address under `/replica/`) is dialled over mutual TLS: the front must show a `node`
certificate of the stack's CA for the address dialled, and it checks ours. The pool keeps
those connections too, so TLS costs a handshake per connection, not per request. Other
addresses (an agent's `--no-direct-fence`: a workload's own port) stay plain HTTP.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Final

from events.contract.messages import RouteEntry
from events.contract.tunnel import HOP_BY_HOP, NOT_DELIVERED_HEADER
from wire.http_client import (
    BodyError,
    ConnectError,
    HeadError,
    HeadTimeout,
    HttpClient,
    Response,
    encode_request,
    origin,
)
from wire.nats_access import tls_identity

from .base import (
    ConnectFailed,
    FirstByteTimeout,
    ResetBeforeHead,
    StreamBroken,
    UpstreamRequest,
)

_NOT_DELIVERED = NOT_DELIVERED_HEADER.lower()
# Where a node's front serves replicas (nodeagent/fencing_front.py PREFIX; the gateway may not
# import the agent's package).
_FRONT: Final = "/replica/"


def node_front(cert: object) -> str:
    """The pool's peer check for fronts: "" for a node's certificate of the stack's CA."""
    found = tls_identity(cert)
    if found is not None and found[0] == "node":
        return ""
    who = f"a {found[0]}'s" if found else "no gpumesh"
    return f"shows {who} certificate, not a node's"


class DirectResponse:
    __slots__ = ("_idle_timeout", "_replica_id", "_response", "content_length", "headers", "status")

    def __init__(self, replica_id: str, response: Response, idle_timeout: float) -> None:
        head = response.head
        assert head is not None
        self._replica_id = replica_id
        self._response = response
        self._idle_timeout = idle_timeout
        self.status = head.status
        self.headers: Sequence[tuple[str, str]] = [
            (k, v) for k, v in head.headers if k.lower() not in HOP_BY_HOP
        ]
        self.content_length = head.content_length

    @property
    def complete(self) -> bool:
        """The whole body has arrived (`take_buffered()` returns all of it)."""
        return self._response.complete

    def take_buffered(self) -> bytes:
        return self._response.take_buffered()

    async def next_chunk(self) -> bytes | None:
        """The next piece of the body, None at its end, or StreamBroken."""
        try:
            return await self._response.next_chunk(self._idle_timeout)
        except BodyError as exc:
            raise StreamBroken(self._replica_id, str(exc)) from exc

    async def relay(self, consumer: Callable[[bytes], None]) -> None:
        """The rest of the body to `consumer` as it arrives (see Response.relay)."""
        try:
            await self._response.relay(consumer, self._idle_timeout)
        except BodyError as exc:
            raise StreamBroken(self._replica_id, str(exc)) from exc

    def pause(self) -> None:
        self._response.pause()

    def resume(self) -> None:
        self._response.resume()

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            while (chunk := await self.next_chunk()) is not None:
                yield chunk
        finally:
            self._response.close()

    async def read(self) -> bytes:
        """The whole body (a non-streaming answer), or StreamBroken."""
        parts = [chunk async for chunk in self.chunks()]
        return b"".join(parts)

    async def aclose(self) -> None:
        # A body not read to the end drops the connection: the replica sees the client go away
        # and can stop generating.
        self._response.close()


class DirectTransport:
    name = "direct"

    def __init__(
        self,
        *,
        connect_timeout: float = 2.0,
        pool_per_host: int = 0,
        idle_timeout: float = 60.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls`: dial nodes' fronts over mutual TLS with this context (see `secure`)."""
        # A replica that goes silent this long mid-answer (power loss, partition: no RST ever
        # comes) breaks the stream instead of hanging it forever. Same default as the overlay.
        self._idle_timeout = idle_timeout
        self._connect_timeout = connect_timeout
        self._client = HttpClient(connect_timeout=connect_timeout)
        self._fronts: HttpClient = self._client
        if tls is not None:
            self.secure(tls)
        del pool_per_host  # kept for callers; the pool opens what concurrent requests need

    def secure(self, tls: ssl.SSLContext) -> None:
        """Dial nodes' fronts over mutual TLS with `tls` (a client context holding this
        gateway's certificate); before the first request."""
        self._fronts = HttpClient(
            connect_timeout=self._connect_timeout, tls=tls, peer_check=node_front
        )

    @property
    def tls(self) -> bool:
        return self._fronts is not self._client

    async def open(self, route: RouteEntry, request: UpstreamRequest) -> DirectResponse:
        try:
            where = origin(route.address)
        except ValueError as exc:
            raise ConnectFailed(route.replica_id, str(exc)) from exc
        data = encode_request(request.method, request.path, where, request.headers, request.body)
        deadline = asyncio.get_running_loop().time() + request.first_byte_timeout
        client = self._fronts if where.prefix.startswith(_FRONT) else self._client
        try:
            response = await client.request(where.host, where.port, request.method, data, deadline)
        except ConnectError as exc:
            raise ConnectFailed(route.replica_id, str(exc)) from exc
        except HeadTimeout as exc:
            raise FirstByteTimeout(
                route.replica_id, f"no response head within {request.first_byte_timeout:g} s"
            ) from exc
        except HeadError as exc:
            # Connected, so the request may have reached the workload: not a connect failure.
            raise ResetBeforeHead(route.replica_id, str(exc)) from exc
        answer = DirectResponse(route.replica_id, response, self._idle_timeout)
        if answer.status >= 500:
            refused = _header(response, _NOT_DELIVERED)
            if refused:
                # The node's front refused it before the workload saw it (fenced, say): like
                # the overlay's refusals, a connect failure, so even a POST may try another.
                response.close()
                raise ConnectFailed(route.replica_id, f"{answer.status} {refused} from the node")
        return answer

    async def close(self) -> None:
        await self._client.close()
        if self._fronts is not self._client:
            await self._fronts.close()


def _header(response: Response, lower_name: str) -> str:
    assert response.head is not None
    for name, value in response.head.headers:
        if name.lower() == lower_name:
            return value
    return ""
