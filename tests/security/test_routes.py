"""The routes between the nats-servers of a cluster (`gpumesh up --ha`) are mutual TLS with a
certificate of the stack's CA, plus the cluster's own user and password (docs/security.md,
Routes). A server that lacks any of them cannot join; one that has them joins.

Real nats-servers on loopback: a secured cluster of three, and four servers that dial one of
its members' route ports: without TLS (the right password), with a certificate of another CA
(the right password), with the stack's certificate but no password, and with the stack's
files. Each refusal is read where it happens (the member's log) and checked on the dialler's
own monitoring endpoint (`/routez`: no route); the last one's messages reach the cluster.
"""

from __future__ import annotations

import asyncio
import json
import stat
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from gpumesh.cli import main
from gpumesh.security import identities, pki, routes
from gpumesh.up_ha import NATS_DIR
from wire.nats_access import SecurityLayout, load_credentials
from wire.nats_bus import BusUnavailable, NatsBus
from wire.nats_cluster import NatsCluster, RouteSecurity, free_ports, member_config
from wire.nats_server import ClusterMember, EmbeddedNats, find_nats_server

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_certs_init_makes_the_routes_certificate_and_password(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.x509.oid import ExtendedKeyUsageOID

    layout = SecurityLayout(tmp_path)
    created = identities.init(layout, [*pki.DEFAULT_HOSTS, "nats-a.example.org"])
    assert str(routes.cert_path(layout)) in created and str(routes.auth_path(layout)) in created
    cert = x509.load_pem_x509_certificate(routes.cert_path(layout).read_bytes())
    usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    # Both ends of a route: it serves the route and it dials it.
    assert set(usages) == {ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH}
    assert set(pki.certificate_hosts(routes.cert_path(layout))) == {
        "127.0.0.1",
        "localhost",
        "nats-a.example.org",
    }
    for secret in (routes.key_path(layout), routes.auth_path(layout)):
        assert stat.S_IMODE(secret.stat().st_mode) == 0o600, secret
    first = routes.route_security(layout)
    assert len(first.password) == 64 and first.user == routes.ROUTE_USER
    # Kept, never replaced: every server of the cluster must hold the same.
    assert identities.init(layout) == [] and routes.route_security(layout) == first
    # A data directory made before routes had credentials gets them on first use.
    routes.auth_path(layout).unlink()
    assert routes.route_security(layout).password != first.password


@pytest.fixture
async def secured(tmp_path: Path) -> AsyncIterator[tuple[NatsCluster, SecurityLayout]]:
    layout = SecurityLayout(tmp_path / "stack")
    identities.init(layout)
    cluster = NatsCluster(
        tmp_path / "stack" / NATS_DIR,  # where `up --ha` runs them: `certs` reloads them there
        binary=find_nats_server(),
        config_file=layout.server_config,
        credentials=load_credentials(layout.creds("admin")),
        routes=routes.route_security(layout),
    )
    async with cluster:
        yield cluster, layout


class Dialler:
    """A server outside the cluster that dials one member's route port, with what it has."""

    def __init__(self, root: Path, name: str, target: ClusterMember) -> None:
        route_port, client_port, http_port = free_ports(3)
        self.http_port = http_port
        self.path = root / name / "server.conf"
        self.path.parent.mkdir(parents=True)
        member = ClusterMember(
            server_name=name,
            cluster_name=target.cluster_name,
            route_port=route_port,
            peers=(target.route_url,),
        )
        self.member = member
        self.server = EmbeddedNats(
            root / name, port=client_port, binary=find_nats_server(), config_file=self.path
        )

    def write(self, config: str) -> None:
        self.path.write_text(config + f"\nhttp: {json.dumps(f'127.0.0.1:{self.http_port}')}\n")

    @property
    def url(self) -> str:  # no client TLS on these: the config includes no nats.conf
        return f"nats://127.0.0.1:{self.server.port}"

    async def routes(self) -> int:
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{self.http_port}/routez") as resp,
        ):
            return int((await resp.json())["num_routes"])


def command_line(pid: int) -> bytes:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read()


async def logged(server: EmbeddedNats, needle: str, *, after: int, within: float = 15.0) -> str:
    """The first line of `server`'s log past byte `after` that holds `needle`."""
    deadline = time.monotonic() + within
    while True:
        text = server.log_path.read_bytes()[after:].decode(errors="replace")
        for line in text.splitlines():
            if needle in line:
                return line
        assert time.monotonic() < deadline, f"no {needle!r} in {server.log_path}:\n{text[-2000:]}"
        await asyncio.sleep(0.05)


async def test_routes_refuse_a_server_without_tls_another_ca_or_the_password(
    secured: tuple[NatsCluster, SecurityLayout], tmp_path: Path
) -> None:
    cluster, layout = secured
    good = routes.route_security(layout)
    password = good.password
    # Nothing secret on any server's command line (another local user could read it there).
    for server in cluster.servers:
        assert server.pid is not None
        assert password.encode() not in command_line(server.pid)
        assert server.config_file is not None
        assert stat.S_IMODE(server.config_file.stat().st_mode) == 0o600

    other = SecurityLayout(tmp_path / "other")
    other.root.mkdir(parents=True)
    pki.create_ca(other.ca_cert, other.ca_key, common_name="someone else's CA")
    other_cert, other_key = other.root / "route.pem", other.root / "route-key.pem"
    pki.create_server_cert(other.ca_cert, other.ca_key, other_cert, other_key, client_auth=True)
    foreign = RouteSecurity(
        cert_file=other_cert,
        key_file=other_key,
        ca_file=other.ca_cert,
        user=good.user,
        password=password,
    )
    no_password = replace(good, password="not-the-password")

    root = tmp_path / "outsiders"
    m = cluster.members
    plain = Dialler(root, "plain", m[0])
    plain.write(
        "server_name: " + json.dumps(plain.member.server_name) + "\ncluster: "
        + json.dumps({
            "name": m[0].cluster_name,
            "listen": f"127.0.0.1:{plain.member.route_port}",
            "routes": [f"nats-route://{good.user}:{password}@127.0.0.1:{m[0].route_port}"],
        })
    )  # fmt: skip
    other_ca = Dialler(root, "other-ca", m[1])
    other_ca.write(member_config(other_ca.member, foreign, path=other_ca.path, include=None))
    wrong = Dialler(root, "wrong-password", m[2])
    wrong.write(member_config(wrong.member, no_password, path=wrong.path, include=None))
    member = Dialler(root, "nats-3", m[0])
    member.write(member_config(member.member, good, path=member.path, include=None))

    offsets = [s.log_path.stat().st_size for s in cluster.servers]
    outsiders = [plain, other_ca, wrong, member]
    await asyncio.gather(*(d.server.start() for d in outsiders))
    try:
        refused = await asyncio.gather(
            logged(cluster.servers[0], "TLS Handshake Failure", after=offsets[0]),
            logged(cluster.servers[1], "TLS Handshake Failure", after=offsets[1]),
            logged(cluster.servers[2], "Authentication Failure", after=offsets[2]),
        )
        assert all("Router connection closed" in line for line in refused), refused
        # The one with the stack's certificate and password joins, and carries messages.
        deadline = time.monotonic() + 15
        while await member.routes() < 1:
            assert time.monotonic() < deadline, "the server with the credentials did not join"
            await asyncio.sleep(0.05)
        for outsider in (plain, other_ca, wrong):
            assert await outsider.routes() == 0, outsider.member.server_name
        # A member's file also asks for an fsync per write (docs/jetstream-durability.md), and
        # the server keeps it beside the store directory its command line gives.
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{member.http_port}/varz") as resp,
        ):
            assert (await resp.json())["jetstream"]["config"]["sync_always"] is True
        admin = load_credentials(layout.creds("admin"))
        inside = await NatsBus.connect(cluster.urls, name="inside", credentials=admin)
        joined = await NatsBus.connect(member.url, name="joined")
        try:
            got: list[bytes] = []
            await inside.subscribe("routes.check", handler=lambda msg: got.append(msg.data))
            await inside.flush()
            deadline = time.monotonic() + 10
            while not got:  # interest crosses the new route asynchronously: send until seen
                assert time.monotonic() < deadline, "nothing crossed the route"
                await joined.publish("routes.check", b"over the route")
                await joined.flush()
                await asyncio.sleep(0.05)
            assert got[0] == b"over the route"
        finally:
            await joined.close()
            await inside.close()
    finally:
        await asyncio.gather(*(d.server.stop() for d in outsiders))


async def test_issuing_an_identity_reloads_every_server_of_the_cluster(
    secured: tuple[NatsCluster, SecurityLayout], capsys: pytest.CaptureFixture[str]
) -> None:
    """Each server includes the one nats.conf: `gpumesh node issue` makes all three re-read it,
    so the new node can connect to any of them (and a revoked one to none)."""
    cluster, layout = secured
    data_dir = layout.root.parent
    assert await asyncio.to_thread(main, ["--data-dir", str(data_dir), "node", "issue", "n-1"]) == 0
    out = capsys.readouterr().out
    pids = {str(server.pid) for server in cluster.servers}
    reloaded = next(line for line in out.splitlines() if "reloaded" in line)
    assert all(pid in reloaded for pid in pids), out
    node = load_credentials(layout.creds("n-1"))
    for server in cluster.servers:
        deadline = time.monotonic() + 10
        while True:  # the reload (SIGHUP) is asynchronous: until this server knows the key
            try:
                bus = await NatsBus.connect(server.url, name="n-1", credentials=node)
            except BusUnavailable:
                assert time.monotonic() < deadline, f"{server.url} did not let n-1 in"
                await asyncio.sleep(0.05)
                continue
            await bus.close()
            break
