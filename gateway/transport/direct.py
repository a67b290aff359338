"""The direct transport: HTTP from the gateway to the replica's address, over a keep-alive pool.

One aiohttp ClientSession for every replica: its connector keeps idle connections per host, so
a busy replica is reached without a TCP handshake per request.
"""

from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Sequence

import aiohttp

from events.messages import RouteEntry
from events.tunnel import HOP_BY_HOP, NOT_DELIVERED_HEADER

from .base import (
    ConnectFailed,
    FirstByteTimeout,
    ResetBeforeHead,
    StreamBroken,
    UpstreamRequest,
)


class DirectResponse:
    def __init__(self, replica_id: str, response: aiohttp.ClientResponse) -> None:
        self._replica_id = replica_id
        self._response = response
        self.status = response.status
        self.headers: Sequence[tuple[str, str]] = [
            (k.decode("latin-1"), v.decode("latin-1"))
            for k, v in response.raw_headers
            if k.decode("latin-1").lower() not in HOP_BY_HOP
        ]
        self.content_length = response.content_length

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            async for chunk in self._response.content.iter_any():
                yield chunk
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise StreamBroken(self._replica_id, _describe(exc)) from exc
        finally:
            self._response.release()

    async def read(self) -> bytes:
        """The whole body (a non-streaming answer), or StreamBroken."""
        try:
            return await self._response.read()
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise StreamBroken(self._replica_id, _describe(exc)) from exc
        finally:
            self._response.release()

    async def aclose(self) -> None:
        # Closing (not releasing) a response whose body was not read to the end drops the
        # connection: the replica sees the client go away and can stop generating.
        if not self._response.closed:
            self._response.close()


class DirectTransport:
    name = "direct"

    def __init__(
        self, *, connect_timeout: float = 2.0, pool_per_host: int = 0, idle_timeout: float = 60.0
    ) -> None:
        self._connect_timeout = connect_timeout
        # A replica that goes silent this long mid-answer (power loss, partition: no RST ever
        # comes) breaks the stream instead of hanging it forever. Same default as the overlay.
        self._idle_timeout = idle_timeout
        self._pool_per_host = pool_per_host
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        # Created lazily, on the running loop that will use it.
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=0, limit_per_host=self._pool_per_host, keepalive_timeout=60.0
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,  # pass bytes through as the replica sent them
                skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
                timeout=aiohttp.ClientTimeout(
                    total=None, sock_connect=self._connect_timeout, sock_read=self._idle_timeout
                ),
            )
        return self._session

    async def open(self, route: RouteEntry, request: UpstreamRequest) -> DirectResponse:
        session = self._client()
        try:
            async with asyncio.timeout(request.first_byte_timeout):
                context = session.request(
                    request.method,
                    route.address + request.path,
                    headers=list(request.headers),
                    data=_payload(request.body),
                    allow_redirects=False,
                    compress=False,
                )
                response = await context
        except aiohttp.ConnectionTimeoutError as exc:
            # A TimeoutError too, but of the connection (a node that drops SYNs): checked first.
            raise ConnectFailed(route.replica_id, _describe(exc)) from exc
        except TimeoutError as exc:
            raise FirstByteTimeout(
                route.replica_id, f"no response head within {request.first_byte_timeout:g} s"
            ) from exc
        except aiohttp.ClientConnectorError as exc:
            raise ConnectFailed(route.replica_id, _describe(exc)) from exc
        except (aiohttp.ClientError, OSError) as exc:
            # Connected, so the request may have reached the workload: not a connect failure.
            raise ResetBeforeHead(route.replica_id, _describe(exc)) from exc
        refused = response.status >= 500 and response.headers.get(NOT_DELIVERED_HEADER)
        if refused:
            # The node's front refused it before the workload saw it (fenced, say): like the
            # overlay's refusals, a connect failure, so even a POST may try another replica.
            response.close()
            raise ConnectFailed(route.replica_id, f"{response.status} {refused} from the node")
        return DirectResponse(route.replica_id, response)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


_LARGE = 1024 * 1024


def _payload(body: bytes) -> bytes | io.BytesIO | None:
    # aiohttp writes a large bytes body in one go and warns that it may block the loop; a
    # file-like object is written in pieces.
    if not body:
        return None
    return io.BytesIO(body) if len(body) > _LARGE else body


def _describe(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0] if text else type(exc).__name__
