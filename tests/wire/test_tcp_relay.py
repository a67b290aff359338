"""wire/tcp_relay.py with real sockets on 127.0.0.1: bytes pass both ways; a cut stops them on
the connections open and holds new ones (a blackhole: nothing is closed, nothing reaches the
target); a heal delivers what was held and takes new connections again; cancelling `serve()`
closes every connection."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import pytest

from wire.tcp_relay import TcpRelay

QUIET_S = 0.3  # how long "nothing arrives" is watched for


class Echo:
    """A target that echoes each connection's bytes back, and records what it received."""

    def __init__(self) -> None:
        self.accepted = 0
        self.received = bytearray()
        self.got = asyncio.Event()  # set at each read
        self.ended = asyncio.Event()  # set when a connection ends
        self.port = 0
        self._writers: list[asyncio.StreamWriter] = []

    async def _echo(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(1024):
                self.received += data
                self.got.set()
                writer.write(data)
                await writer.drain()
        except ConnectionError:
            pass
        finally:
            writer.transport.abort()
            self.ended.set()

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Echo]:
        async with asyncio.TaskGroup() as tasks:

            def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
                self.accepted += 1
                self._writers.append(writer)
                tasks.create_task(self._echo(reader, writer))

            server = await asyncio.start_server(accepted, "127.0.0.1", 0)
            self.port = int(server.sockets[0].getsockname()[1])
            try:
                yield self
            finally:
                server.close()
                self.close_all()

    def close_all(self) -> None:
        for writer in self._writers:  # each connection's task then reads its end
            writer.transport.abort()


@contextlib.asynccontextmanager
async def relay_to(port: int) -> AsyncIterator[TcpRelay]:
    relay = TcpRelay(("127.0.0.1", port))
    await relay.listen()
    async with asyncio.TaskGroup() as tasks:
        serving = tasks.create_task(relay.serve())
        try:
            yield relay
        finally:
            serving.cancel()


async def dial(relay: TcpRelay) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", relay.port)


async def roundtrip(conn: tuple[asyncio.StreamReader, asyncio.StreamWriter], data: bytes) -> bytes:
    reader, writer = conn
    writer.write(data)
    await writer.drain()
    return await asyncio.wait_for(reader.readexactly(len(data)), timeout=5)


async def nothing_within(reader: asyncio.StreamReader, seconds: float = QUIET_S) -> bool:
    try:
        await asyncio.wait_for(reader.read(1), timeout=seconds)
    except TimeoutError:
        return True
    return False


@pytest.fixture
async def echo() -> AsyncIterator[Echo]:
    async with Echo().running() as server:
        yield server


async def test_bytes_pass_both_ways_on_each_connection(echo: Echo) -> None:
    async with relay_to(echo.port) as relay:
        assert relay.port != 0 and relay.port != echo.port
        first, second = await dial(relay), await dial(relay)
        assert await roundtrip(first, b"PING\r\n") == b"PING\r\n"
        big = bytes(range(256)) * 1024  # more than one read's worth
        assert await roundtrip(second, big) == big
        assert echo.accepted == 2 and relay.connections == 2
        for _, writer in (first, second):
            writer.close()


async def test_a_cut_holds_bytes_and_new_connections_and_a_heal_delivers_them(
    echo: Echo,
) -> None:
    async with relay_to(echo.port) as relay:
        open_before = await dial(relay)
        assert await roundtrip(open_before, b"before\n") == b"before\n"
        echo.got.clear()

        relay.cut()
        assert relay.is_cut
        reader, writer = open_before
        writer.write(b"during\n")
        await writer.drain()
        # A blackhole: nothing reaches the target, nothing comes back, nothing is closed.
        assert await nothing_within(reader)
        assert bytes(echo.received) == b"before\n"
        held = await dial(relay)  # accepted by the relay, held: the target never sees it
        held[1].write(b"held\n")
        await held[1].drain()
        assert await nothing_within(held[0])
        assert echo.accepted == 1 and relay.connections == 2

        relay.heal()
        # What was held is delivered, late; the held connection goes on to the target.
        assert await asyncio.wait_for(reader.readexactly(7), timeout=5) == b"during\n"
        assert await asyncio.wait_for(held[0].readexactly(5), timeout=5) == b"held\n"
        assert echo.accepted == 2
        fresh = await dial(relay)
        assert await roundtrip(fresh, b"after\n") == b"after\n"
        assert await roundtrip(open_before, b"again\n") == b"again\n"
        for _, w in (open_before, held, fresh):
            w.close()


async def test_either_end_closing_closes_the_other(echo: Echo) -> None:
    async with relay_to(echo.port) as relay:
        reader, writer = await dial(relay)
        assert await roundtrip((reader, writer), b"x") == b"x"
        writer.close()  # the client's end: the target's connection ends
        await asyncio.wait_for(echo.ended.wait(), timeout=5)

        reader, writer = await dial(relay)
        assert await roundtrip((reader, writer), b"y") == b"y"
        echo.close_all()  # the target's end: the client's connection ends
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""
        writer.close()


async def test_a_target_that_is_down_closes_the_clients_connection() -> None:
    async with Echo().running() as echo:
        port = echo.port
    async with relay_to(port) as relay:  # nothing listens on `port` any more
        reader, writer = await dial(relay)
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""
        writer.close()


async def test_stopping_the_relay_closes_every_connection_held_or_not(echo: Echo) -> None:
    relay = TcpRelay(("127.0.0.1", echo.port))
    await relay.listen()
    async with asyncio.TaskGroup() as tasks:
        serving = tasks.create_task(relay.serve())
        flowing = await dial(relay)
        assert await roundtrip(flowing, b"x") == b"x"
        relay.cut()
        held = await dial(relay)
        assert await nothing_within(held[0], 0.1)
        serving.cancel()
    for reader, writer in (flowing, held):
        assert await asyncio.wait_for(reader.read(), timeout=5) == b""
        writer.close()
    with pytest.raises(OSError):
        await dial(relay)  # no longer listening
