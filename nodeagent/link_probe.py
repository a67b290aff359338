"""Measuring the links between nodes, for the pipeline planner (docs/sharding.md, Measuring
links).

Pipeline stages reach each other directly, node to node (not over the NATS overlay), so that is
how a link is measured: each agent runs a small **responder**, and, asked by the controller on
`gpumesh.v1.node.<id>.links` (LinksRequest), its **prober** dials each peer's responder and
times two things over one connection:

* `rtt_ms`: the median of `pings` round trips of one byte each (a token's hop forward and the
  sampled token's way back are each about one such trip);
* `gbps`: one push of `push_bytes` (1 MiB by default), which the peer acknowledges with one
  byte once it has read them all; the push takes the bytes' transfer plus one round trip, so
  throughput = bytes x 8 / (time - median round trip), the round trip being at most half of
  the time taken (a push lost in the noise of its round trip reads as a lower bound).

`measure` does the timing, on the running loop's clock (virtual in the simulator), whatever
carries the bytes: a `LinkDialer` opens a `LinkChannel` to a peer's endpoint. `TcpDialer` and
`TcpResponder` are the real ones (a one-byte opcode protocol, below); sim/world.py has one whose
round trips and throughput come from the simulated network, so its `slow` fault changes what
is measured. The agent gets them injected (`LinkProbing`), so the same agent code runs on both.

The wire protocol, on a TCP connection to the responder: `P` -> `P` (a ping); `T` + 8 bytes
big-endian length N + N bytes -> `T` (a push, N at most LINKS_MAX_PUSH_BYTES). Anything else
closes the connection. It carries nothing but the bytes pushed, which are discarded.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from events.contract.messages import LINKS_MAX_PUSH_BYTES, LinkPeer
from events.node import LinkMeasurement

from .errors import AgentError

PING = b"P"
PUSH = b"T"
_CHUNK = 64 * 1024
_IDLE_S = 30.0  # a responder's connection with nothing to read for this long is closed


class LinkUnreachable(AgentError):
    """A peer's responder cannot be reached (refused, no route, a bad endpoint)."""


class LinkChannel(Protocol):
    async def ping(self) -> None:
        """One byte there and back."""
        ...

    async def push(self, nbytes: int) -> None:
        """`nbytes` there, and the peer's acknowledgement of the last one back."""
        ...

    async def close(self) -> None: ...


class LinkDialer(Protocol):
    method: str  # how the bytes travel, for the record: "tcp", "sim"

    async def dial(self, endpoint: str) -> LinkChannel: ...


class LinkResponder(Protocol):
    @property
    def endpoint(self) -> str:
        """Where peers reach it, `host:port` ('' until it listens)."""
        ...

    async def run(self) -> None:
        """Serve until cancelled; set `listening` once peers can dial it."""
        ...

    @property
    def listening(self) -> asyncio.Event: ...


@dataclass(frozen=True, slots=True)
class LinkProbing:
    """What an agent measures links with: its dialer and its own responder (None: it answers
    no peer's measurements, and reports no endpoint)."""

    dialer: LinkDialer
    responder: LinkResponder | None = None


def describe(method: str, pings: int, push_bytes: int) -> str:
    return f"{method}: median of {pings} pings, {push_bytes} bytes pushed"


async def measure(
    dialer: LinkDialer, peer: LinkPeer, *, pings: int, push_bytes: int, timeout_s: float
) -> LinkMeasurement:
    """The link to `peer`, measured within `timeout_s`; a failure is the measurement's
    `error`, one line, never an exception."""
    clock: Callable[[], float] = asyncio.get_running_loop().time
    try:
        async with asyncio.timeout(timeout_s):
            channel = await dialer.dial(peer.endpoint)
            try:
                trips: list[float] = []
                for _ in range(max(1, pings)):
                    start = clock()
                    await channel.ping()
                    trips.append(clock() - start)
                took = 0.0
                if push_bytes > 0:
                    start = clock()
                    await channel.push(push_bytes)
                    took = clock() - start
            finally:
                with contextlib.suppress(Exception):
                    await channel.close()
    except TimeoutError:
        return LinkMeasurement(peer=peer.node_id, error=f"no answer within {timeout_s:g} s")
    except LinkUnreachable as exc:
        return LinkMeasurement(peer=peer.node_id, error=exc.reason)
    except (OSError, asyncio.IncompleteReadError) as exc:
        return LinkMeasurement(peer=peer.node_id, error=_one_line(exc))
    rtt = statistics.median(trips)
    gbps = 0.0
    if push_bytes > 0 and took > 0:
        gbps = push_bytes * 8 / max(took - rtt, took / 2) / 1e9
    return LinkMeasurement(peer=peer.node_id, rtt_ms=round(rtt * 1e3, 3), gbps=round(gbps, 3))


def _one_line(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    return text.splitlines()[0][:200] if text else type(exc).__name__


def split_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise LinkUnreachable(f"bad link endpoint {endpoint!r}: expected host:port")
    return host.strip("[]"), int(port)


class TcpChannel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def ping(self) -> None:
        self._writer.write(PING)
        await self._writer.drain()
        if await self._reader.readexactly(1) != PING:
            raise LinkUnreachable("the peer's responder answered a ping with something else")

    async def push(self, nbytes: int) -> None:
        self._writer.write(PUSH + nbytes.to_bytes(8, "big"))
        chunk = bytes(min(nbytes, _CHUNK))
        left = nbytes
        while left > 0:
            self._writer.write(chunk[: min(left, _CHUNK)])
            left -= _CHUNK
            await self._writer.drain()
        if await self._reader.readexactly(1) != PUSH:
            raise LinkUnreachable("the peer's responder answered a push with something else")

    async def close(self) -> None:
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


class TcpDialer:
    """Dials a peer's TcpResponder directly, as pipeline stages reach each other."""

    method = "tcp"

    async def dial(self, endpoint: str) -> LinkChannel:
        host, port = split_endpoint(endpoint)
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError as exc:
            raise LinkUnreachable(f"cannot connect to {endpoint}: {_one_line(exc)}") from None
        return TcpChannel(reader, writer)


class TcpResponder:
    """Answers peers' pings and pushes on `bind`:`port` (0: any free port), advertised as
    `advertise`:port (the node's registered address)."""

    def __init__(self, bind: str, port: int, advertise: str, *, log: Any = None) -> None:
        self._bind = bind
        self._port = port
        self._advertise = advertise
        self._log = log
        self._listening = asyncio.Event()
        self.port = 0
        self._handlers: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    @property
    def listening(self) -> asyncio.Event:
        return self._listening

    @property
    def endpoint(self) -> str:
        if not self.port:
            return ""
        host = f"[{self._advertise}]" if ":" in self._advertise else self._advertise
        return f"{host}:{self.port}"

    async def run(self) -> None:
        server = await asyncio.start_server(self._serve, self._bind, self._port)
        try:
            self.port = server.sockets[0].getsockname()[1]
            self._listening.set()
            if self._log is not None:
                self._log.info("link_responder_listening", endpoint=self.endpoint)
            await asyncio.Future()  # until cancelled
        finally:
            server.close()
            # Closed, not cancelled: each handler reads its end and returns (asyncio's
            # stream callback reports a handler task cancelled mid-read as an error).
            for writer in list(self._writers):
                writer.close()
            handlers = list(self._handlers)
            if handlers:
                await asyncio.wait(handlers, timeout=1.0)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._handlers.add(task)
        self._writers.add(writer)
        try:
            await answer(reader, writer)
        except (OSError, asyncio.IncompleteReadError, TimeoutError):
            pass  # the peer went away, said nothing for too long, or the responder stops
        finally:
            if task is not None:
                self._handlers.discard(task)
            self._writers.discard(writer)
            writer.close()


async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """The responder's side of one connection: pings and pushes until EOF or garbage."""
    read = _timed(reader)
    while True:
        op = await read(1)
        if op == PING:
            writer.write(PING)
        elif op == PUSH:
            size = int.from_bytes(await read(8), "big")
            if size > LINKS_MAX_PUSH_BYTES:
                return
            while size > 0:
                got = await read(min(size, _CHUNK))
                size -= len(got)
            writer.write(PUSH)
        else:
            return
        await writer.drain()


def _timed(reader: asyncio.StreamReader) -> Callable[[int], Awaitable[bytes]]:
    async def read(n: int) -> bytes:
        async with asyncio.timeout(_IDLE_S):
            return await reader.readexactly(n)

    return read
