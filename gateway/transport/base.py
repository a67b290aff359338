"""The transport contract: open a request to one replica, get its head, then stream its body.

Retries are decided from the exception class alone (gateway/retry.py), so each transport maps
its own failures onto these four. Before the head arrives nothing reached the client, so the
proxy may try another replica; after it, only `StreamBroken` can happen, and the client is
told in-band (unless the proxy still held the body back: `BrokenWhileHeld`, retried).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from events.contract.messages import RouteEntry

# What happened to one attempt, as the router's passive health counts it.
Outcome = Literal[
    "ok", "connect_error", "reset", "status_5xx", "first_byte_timeout", "stream_broken", "cancelled"
]


class UpstreamError(Exception):
    """An attempt failed; `outcome` says how (the router's failure class).

    `never_delivered` is True only when the request surely did not reach a workload: then even
    a request that is not safe to repeat (a POST on /c/) may go to another replica."""

    outcome: Outcome = "reset"
    never_delivered: bool = False

    def __init__(self, replica_id: str, detail: str) -> None:
        super().__init__(f"replica {replica_id}: {detail}")
        self.replica_id = replica_id
        self.detail = detail


class ConnectFailed(UpstreamError):
    """Refused, unreachable, or no responder: the replica cannot be reached. Surely not
    delivered, unless `maybe_delivered` (an overlay request whose agent never acknowledged
    it: the acknowledgement, not the request, may be what was lost)."""

    outcome: Outcome = "connect_error"

    def __init__(self, replica_id: str, detail: str, *, maybe_delivered: bool = False) -> None:
        super().__init__(replica_id, detail)
        self.never_delivered = not maybe_delivered


class ResetBeforeHead(UpstreamError):
    """The connection broke after the request was sent and before the response head arrived."""

    outcome: Outcome = "reset"


class FirstByteTimeout(UpstreamError):
    """The replica accepted the request but sent no response head within the deadline."""

    outcome: Outcome = "first_byte_timeout"


class UpstreamStatus(UpstreamError):
    """The head arrived with a 5xx status: nothing reached the client yet, so it is retryable."""

    outcome: Outcome = "status_5xx"

    def __init__(self, replica_id: str, status: int) -> None:
        super().__init__(replica_id, f"answered {status}")
        self.status = status


class StreamBroken(UpstreamError):
    """The body broke off after the head: too late to retry, the client must be told."""

    outcome: Outcome = "stream_broken"


class BrokenWhileHeld(StreamBroken):
    """The body broke off while the proxy still held it back (it reads a non-streaming answer
    whole before the client sees a byte): counted against the replica as stream_broken, but
    the client has seen nothing, so a request that may be repeated goes to another replica."""


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    method: str
    path: str  # path and query as the replica should see them, e.g. /v1/chat/completions
    headers: Sequence[tuple[str, str]]  # end-to-end only (no hop-by-hop, no Host); X-Request-Id
    body: bytes
    request_id: str
    first_byte_timeout: float  # seconds until the response head must have arrived
    extra: dict[str, str] = field(default_factory=dict)


class UpstreamResponse(Protocol):
    status: int
    headers: Sequence[tuple[str, str]]  # end-to-end headers of the replica's response

    def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives; raises StreamBroken if it ends early or breaks."""
        ...

    async def aclose(self) -> None:
        """Release the connection (or tell the agent to stop); safe to call twice."""
        ...


class Transport(Protocol):
    name: str

    async def open(self, route: RouteEntry, request: UpstreamRequest) -> UpstreamResponse:
        """Send `request` to `route` and return once the response head is in.

        Raises ConnectFailed, ResetBeforeHead or FirstByteTimeout; never anything else for a
        failure of the replica or the path to it.
        """
        ...

    async def close(self) -> None: ...
