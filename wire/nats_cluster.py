"""A cluster of nats-servers joined by routes, on one machine: what `gpumesh up --ha` and the
tests run so that losing one server loses nothing (clients reconnect to another; JetStream
streams of three replicas keep their quorum).

Each server gets a client port and a route port picked up front (the routes must name them
before any server starts) and its own JetStream directory. Clients dial `urls`, the
comma-separated list nats-py takes (`--nats a,b,c` everywhere in gpumesh).

Secured (`routes=RouteSecurity(...)`, what `gpumesh up --ha` runs), the routes between the
servers are mutual TLS with a certificate of the stack's CA, and each server also presents the
cluster's own user and password: a server that has neither is refused (docs/security.md,
Routes). Route options cannot be given as nats-server flags (its `--routes` and `--cluster`
flags replace the configuration file's cluster block, authorization included), so each server
then gets its own configuration file, `server.conf` in its directory, which includes the
stack's `nats.conf` (clients' TLS and identities) and adds the cluster block."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self
from urllib.parse import quote

import nats.errors
from nats.js.api import StorageType, StreamConfig

from .nats_access import Credentials
from .nats_server import LOOPBACK, ClusterMember, EmbeddedNats, NatsServerError

MEMBER_CONFIG = "server.conf"  # a secured member's own configuration file, in its directory


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


@dataclass(frozen=True, slots=True)
class RouteSecurity:
    """What the servers of a cluster prove to each other on their routes: a certificate signed
    by `ca_file` (each side of a route verifies the other's: mutual TLS), and the cluster's
    own user and password, which a server dialling a route presents and the server it dials
    checks. gpumesh/security/routes.py writes these files."""

    cert_file: Path
    key_file: Path
    ca_file: Path
    user: str
    password: str
    timeout_s: float = 5.0


def member_config(
    member: ClusterMember, routes: RouteSecurity, *, path: Path, include: Path | None
) -> str:
    """A secured member's configuration file (to be written at `path`): `include` (the stack's
    nats.conf: clients' TLS and identities; nats-server takes only a path relative to the
    including file), then its name and its cluster block. Values are JSON, which nats-server's
    configuration format accepts, so no quoting mistakes."""
    auth = f"{quote(routes.user, safe='')}:{quote(routes.password, safe='')}@"
    cluster = {
        "name": member.cluster_name,
        "listen": f"{member.host}:{member.route_port}",
        # nats-server presents the credentials of a route's URL when it dials it, not those
        # of its own authorization block.
        "routes": [peer.replace("nats://", f"nats-route://{auth}", 1) for peer in member.peers],
        "no_advertise": not member.advertise,
        "tls": {
            "cert_file": str(routes.cert_file.resolve()),
            "key_file": str(routes.key_file.resolve()),
            "ca_file": str(routes.ca_file.resolve()),
            "verify": True,
            "timeout": routes.timeout_s,
        },
        "authorization": {
            "user": routes.user,
            "password": routes.password,
            "timeout": routes.timeout_s,
        },
    }
    lines = [
        "# Written by gpumesh (wire/nats_cluster.py) at every start of the cluster; edits are",
        "# lost. It holds the route password: keep it 0600.",
    ]
    if include is not None:
        relative = os.path.relpath(include.resolve(), path.parent.resolve())
        lines.append(f"include {json.dumps(relative)}")
    lines += [
        f"server_name: {json.dumps(member.server_name)}",
        f"cluster: {json.dumps(cluster, indent=2)}",
        # An fsync per write: the default (every 2 minutes) lost acknowledged writes when
        # every server lost power at once (Jepsen, NATS 2.12.1: docs/jetstream-durability.md).
        # The store directory still comes from the command line, which adds to this block.
        'jetstream: {"sync_interval": "always"}',
        "",
    ]
    return "\n".join(lines)


def _write_private(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


class NatsCluster:
    """`size` nats-servers (`nats-0`, `nats-1`, ...) under `root`, clustered as `name`.

    `config_file`: the stack's nats.conf (TLS and NKEY users for clients); `credentials`: who
    the readiness probe connects as then. `routes`: secure the routes too (it needs
    `config_file`: a member's URL says tls:// whenever it has a configuration file)."""

    def __init__(
        self,
        root: Path,
        *,
        size: int = 3,
        name: str = "gpumesh",
        binary: Path | None = None,
        config_file: Path | None = None,
        credentials: Credentials | None = None,
        routes: RouteSecurity | None = None,
        advertise: bool = True,
    ) -> None:
        """`advertise`: False keeps the servers from telling clients of each other
        (ClusterMember.advertise): every client must then be given the whole list."""
        if routes is not None and config_file is None:
            raise ValueError("secured routes need the clients' nats.conf (config_file) too")
        self.root = Path(root)
        self.credentials = credentials
        self.routes = routes
        self._config_file = config_file
        ports = free_ports(2 * size)
        client_ports, route_ports = ports[:size], ports[size:]
        peers = [f"nats://{LOOPBACK}:{port}" for port in route_ports]
        self.members = [
            ClusterMember(
                server_name=f"nats-{i}",
                cluster_name=name,
                route_port=route_ports[i],
                peers=tuple(r for j, r in enumerate(peers) if j != i),
                advertise=advertise,
            )
            for i in range(size)
        ]
        self.servers = [
            EmbeddedNats(
                self.root / member.server_name,
                port=client_ports[i],
                binary=binary,
                config_file=config_file if routes is None else self._member_path(member),
                # Secured, the member's own file holds its cluster block (flags would replace
                # it, its authorization included).
                cluster=member if routes is None else None,
            )
            for i, member in enumerate(self.members)
        ]

    def _member_path(self, member: ClusterMember) -> Path:
        return self.root / member.server_name / MEMBER_CONFIG

    def write_configs(self) -> None:
        """Each secured member's configuration file (nothing to write for plain routes)."""
        if self.routes is None:
            return
        for member in self.members:
            path = self._member_path(member)
            text = member_config(member, self.routes, path=path, include=self._config_file)
            _write_private(path, text)

    @property
    def urls(self) -> str:
        """Every server's client URL, comma-separated (nats-py's convention)."""
        return ",".join(server.url for server in self.servers)

    async def start(self, *, timeout: float = 30.0) -> None:
        """Start every server, and return once JetStream answers: a server is ready before
        its routes are up, and JetStream before its meta group has elected a leader."""
        await asyncio.to_thread(self.write_configs)
        await asyncio.gather(*(server.start() for server in self.servers))
        await wait_for_jetstream(
            self.urls,
            replicas=min(3, len(self.servers)),
            timeout=timeout,
            credentials=self.credentials,
        )

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


async def wait_for_jetstream(
    urls: str,
    *,
    replicas: int = 1,
    timeout: float = 30.0,
    credentials: Credentials | None = None,
) -> None:
    """Until JetStream can place a stream of `replicas` copies through `urls`: a server is
    ready before its routes are up, and JetStream before its meta group has elected a leader
    and learnt its peers. A throwaway in-memory stream is created and deleted to find out."""
    from .nats_bus import NatsBus

    bus = await NatsBus.connect(
        urls, name="gpumesh-cluster-check", reconnect_wait=0.1, credentials=credentials
    )
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
