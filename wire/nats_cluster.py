"""A cluster of nats-servers joined by routes, on one machine: what `gpumesh up --ha` and the
tests run so that losing one server loses nothing (clients reconnect to another; JetStream
streams of three replicas keep their quorum).

Each server gets a client port and a route port picked up front (the routes must name them
before any server starts) and its own JetStream directory. Clients dial `urls`, the
comma-separated list nats-py takes (`--nats a,b,c` everywhere in gpumesh)."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from types import TracebackType
from typing import Self

import nats.errors
from nats.js.api import StorageType, StreamConfig

from .nats_server import LOOPBACK, ClusterMember, EmbeddedNats, NatsServerError


def free_ports(count: int, host: str = LOOPBACK) -> list[int]:
    """`count` ports free on `host` now. Another process may take one before the server binds
    it; the server then fails to start with a clear line, and a retry picks others."""
    sockets: list[socket.socket] = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind((host, 0))
            sockets.append(sock)
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class NatsCluster:
    """`size` nats-servers (`nats-0`, `nats-1`, ...) under `root`, clustered as `name`."""

    def __init__(
        self,
        root: Path,
        *,
        size: int = 3,
        name: str = "gpumesh",
        binary: Path | None = None,
        config_file: Path | None = None,
    ) -> None:
        ports = free_ports(2 * size)
        client_ports, route_ports = ports[:size], ports[size:]
        routes = [f"nats://{LOOPBACK}:{port}" for port in route_ports]
        self.servers = [
            EmbeddedNats(
                Path(root) / f"nats-{i}",
                port=client_ports[i],
                binary=binary,
                config_file=config_file,
                cluster=ClusterMember(
                    server_name=f"nats-{i}",
                    cluster_name=name,
                    route_port=route_ports[i],
                    peers=tuple(r for j, r in enumerate(routes) if j != i),
                ),
            )
            for i in range(size)
        ]

    @property
    def urls(self) -> str:
        """Every server's client URL, comma-separated (nats-py's convention)."""
        return ",".join(server.url for server in self.servers)

    async def start(self, *, timeout: float = 30.0) -> None:
        """Start every server, and return once JetStream answers: a server is ready before
        its routes are up, and JetStream before its meta group has elected a leader."""
        await asyncio.gather(*(server.start() for server in self.servers))
        await wait_for_jetstream(self.urls, replicas=min(3, len(self.servers)), timeout=timeout)

    async def stop(self) -> None:
        await asyncio.gather(*(server.stop() for server in self.servers))

    async def __aenter__(self) -> Self:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()


async def wait_for_jetstream(urls: str, *, replicas: int = 1, timeout: float = 30.0) -> None:
    """Until JetStream can place a stream of `replicas` copies through `urls`: a server is
    ready before its routes are up, and JetStream before its meta group has elected a leader
    and learnt its peers. A throwaway in-memory stream is created and deleted to find out."""
    from .nats_bus import NatsBus

    bus = await NatsBus.connect(urls, name="gpumesh-cluster-check", reconnect_wait=0.1)
    probe = StreamConfig(
        name="GPUMESH_READY",
        subjects=["gpumesh.ready"],
        storage=StorageType.MEMORY,
        num_replicas=replicas,
    )
    try:
        async with asyncio.timeout(timeout):
            while True:
                js = bus.jetstream(timeout=2.0)
                try:
                    await js.add_stream(probe)
                    await js.delete_stream("GPUMESH_READY")
                    return
                except nats.errors.Error:
                    await asyncio.sleep(0.1)
    except TimeoutError:
        raise NatsServerError(
            f"JetStream could not place {replicas} replicas on {urls} within {timeout:g} s"
        ) from None
    finally:
        await bus.close()
