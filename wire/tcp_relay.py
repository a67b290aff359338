"""A TCP relay on 127.0.0.1 that can be cut and healed: how `gpumesh up --ha` puts a network
between each controller and the NATS servers on one machine, so that `gpumesh chaos` can cut a
controller off without root (no iptables, no network namespace).

One `TcpRelay` listens on one port and forwards every connection made to it to one target
(host, port), bytes as they come, both ways; it reads nothing of what it carries (TLS passes
through untouched).

`cut()` is a blackhole, not a refusal: the connections open stay open, and nothing more passes
on them either way (what was in flight is held, not dropped); a connection made while cut is
accepted and held, with nothing sent and no connection to the target. Neither end is told
anything, as on a network that drops every packet: a client finds out only by its own timeouts
(a request that gets no answer, its pings). That is the hard case; a closed connection is the
easy one, which a client notices at once. `heal()` lets everything flow again: the held bytes
are delivered, late, as TCP delivers them after a partition heals, and each held new
connection goes on to the target.

Every connection's task belongs to the TaskGroup of `serve()`, which closes them all when it is
cancelled.
"""

from __future__ import annotations

import asyncio

LOOPBACK = "127.0.0.1"
CHUNK = 64 * 1024


class _Link:
    """One client connection and, once made, its connection to the target."""

    def __init__(self, client: asyncio.StreamWriter) -> None:
        self.client = client
        self.target: asyncio.StreamWriter | None = None

    def close(self) -> None:
        for writer in (self.client, self.target):
            if writer is not None:
                writer.transport.abort()


class TcpRelay:
    """Forward connections made to `host:port` (0: a free port, `port` once listening) to
    `target`; `cut()` and `heal()` (module docstring). `listen()`, then run `serve()` as a task
    until it is cancelled."""

    def __init__(
        self, target: tuple[str, int], *, host: str = LOOPBACK, port: int = 0, name: str = ""
    ) -> None:
        self.target = target
        self.host = host
        self.port = port
        self.name = name or f"relay:{port}->{target[1]}"
        self._flowing = asyncio.Event()
        self._flowing.set()
        self._server: asyncio.Server | None = None
        self._tasks: asyncio.TaskGroup | None = None
        self._links: set[_Link] = set()
        self._early: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
        self._stopped = False

    @property
    def is_cut(self) -> bool:
        return not self._flowing.is_set()

    @property
    def connections(self) -> int:
        """Client connections open now (held ones included)."""
        return len(self._links)

    async def listen(self) -> None:
        """Bind the port (known from here on) and listen: connections made before `serve()`
        runs wait in the kernel's backlog or here, and are relayed once it does."""
        if self._server is not None:
            raise RuntimeError(f"{self.name}: already listening")
        self._server = await asyncio.start_server(self._accepted, self.host, self.port)
        self.port = int(self._server.sockets[0].getsockname()[1])

    async def serve(self) -> None:
        """Relay the connections until cancelled; then stop listening and close every
        connection, held or not."""
        if self._server is None:
            await self.listen()
        server = self._server
        assert server is not None
        try:
            async with asyncio.TaskGroup() as tasks:
                self._tasks = tasks
                early, self._early = self._early, []
                for reader, writer in early:
                    self._start(reader, writer)
                try:
                    await asyncio.Future()  # until cancelled
                finally:
                    self._stopped = True
                    server.close()
                    for link in list(self._links):
                        link.close()
        finally:
            self._stopped = True
            for _, writer in self._early:
                writer.transport.abort()
            await server.wait_closed()

    def cut(self) -> None:
        """Stop every byte both ways, on the connections open and on new ones (held)."""
        self._flowing.clear()

    def heal(self) -> None:
        """Let everything flow again: held bytes go on, held connections reach the target."""
        self._flowing.set()

    # -- each connection -------------------------------------------------------------------

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A plain callback (not a coroutine) so that asyncio starts no task of its own: each
        # connection's task is the TaskGroup's of `serve()`, cancelled with it.
        if self._stopped:
            writer.transport.abort()
        elif self._tasks is None:
            self._early.append((reader, writer))
        else:
            self._start(reader, writer)

    def _start(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        assert self._tasks is not None
        self._tasks.create_task(self._relay(reader, writer), name=f"{self.name}:connection")

    async def _relay(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        link = _Link(client_w)
        self._links.add(link)
        try:
            # Made while cut: accepted and held, as a SYN lost on the way would leave it.
            await self._flowing.wait()
            try:
                target_r, link.target = await asyncio.open_connection(*self.target)
            except OSError:
                return  # the target is down (its process died): the client's connection ends
            async with asyncio.TaskGroup() as pumps:
                pumps.create_task(self._pump(client_r, link.target, link))
                pumps.create_task(self._pump(target_r, client_w, link))
        finally:
            self._links.discard(link)
            link.close()

    async def _pump(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, link: _Link
    ) -> None:
        """One direction, until its end closes (or fails): then the whole link closes, as a
        NATS connection is over when either end is gone."""
        try:
            while True:
                await self._flowing.wait()
                data = await reader.read(CHUNK)
                if not data:
                    return
                await self._flowing.wait()  # cut meanwhile: what was read is held
                writer.write(data)
                await writer.drain()
        except (ConnectionError, OSError):
            return
        finally:
            link.close()
