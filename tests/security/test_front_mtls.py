"""A node's front answers only the stack (issue 22, part 1): mutual TLS from the stack's CA.

Each case runs a real front (nodeagent/fencing_front.py) with the certificate `gpumesh certs`
issues a node, in front of a real workload, on loopback, and calls it the way each kind of
caller would: a gateway (the direct transport, gateway/transport/direct.py), a stranger with no
certificate, a holder of another CA's gateway certificate, a node, a revoked gateway. Only
the gateway reaches the workload; the workload's `seen` says so for the others.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import msgspec
import pytest

from events.contract.messages import RouteEntry
from gateway.transport.base import ConnectFailed, UpstreamRequest
from gateway.transport.direct import DirectTransport
from gpumesh.cli import main
from gpumesh.security import identities, pki
from nodeagent.fencing_front import DirectFront, FrontTLS, front_path
from tests.integration.gateway_kit import Upstream
from wire.nats_access import Credentials, SecurityLayout, load_credentials

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
PATH = "/v1/chat/completions"


@pytest.fixture
def layout(tmp_path: Path) -> SecurityLayout:
    """A stack's security files as `gpumesh up` makes them: the built-in `gateway`, node-1, and
    a second gateway gw-2 (`gpumesh certs issue gw-2 --role gateway`)."""
    made = SecurityLayout(tmp_path / "stack")
    identities.init(made)
    identities.issue(made, "node-1", "node")
    identities.issue(made, "gw-2", "gateway")
    return made


def creds(layout: SecurityLayout, name: str) -> Credentials:
    return load_credentials(layout.creds(name))


def _client(identity: Credentials, *, trust: str = "") -> ssl.SSLContext:
    """A client context presenting `identity`'s certificate, trusting `trust` (default its CA)."""
    return msgspec.structs.replace(identity, ca_pem=trust or identity.ca_pem).tls_context(
        server=False
    )


@contextlib.asynccontextmanager
async def node_front(
    layout: SecurityLayout, *, fence: str = "", tls: FrontTLS | None = None
) -> AsyncIterator[tuple[DirectFront, Upstream, str]]:
    """node-1's front, mutual TLS with its issued certificate and the stack's crl.pem, serving
    replica r@1 on a workload: (front, workload, the replica's address as advertised)."""
    node = creds(layout, "node-1")
    workload = await Upstream("workload").start()
    tls = tls or FrontTLS(node.tls_context(server=True), node.ca_pem, layout.crl)
    front = DirectFront(
        "127.0.0.1",
        0,
        lambda replica, epoch: workload.address if (replica, epoch) == ("r", 1) else None,
        lambda replica, epoch: fence,
        tls=tls,
    )
    task = asyncio.create_task(front.run())
    try:
        await front.listening.wait()
        yield front, workload, f"http://127.0.0.1:{front.port}{front_path('r', 1)}"
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await workload.stop()


def _route(address: str) -> RouteEntry:
    return RouteEntry(replica_id="r", node_id="node-1", address=address, epoch=1)


def _request() -> UpstreamRequest:
    return UpstreamRequest(
        "POST", PATH, [("content-type", "application/json")], CHAT, "rid", first_byte_timeout=5
    )


async def _ask(transport: DirectTransport, address: str) -> tuple[int, bytes]:
    answer = await transport.open(_route(address), _request())
    return answer.status, await answer.read()


async def _post(address: str, context: ssl.SSLContext | None) -> int:
    """What anyone with aiohttp would do: POST to the front, with or without a certificate."""
    url = address.replace("http://", "https://" if context else "http://", 1) + PATH
    async with aiohttp.ClientSession() as http, http.post(url, data=CHAT, ssl=context) as reply:
        return reply.status


async def test_a_gateway_is_served_over_one_kept_alive_connection(
    layout: SecurityLayout,
) -> None:
    gateway = DirectTransport(tls=creds(layout, "gateway").tls_context(server=False))
    try:
        async with node_front(layout) as (front, workload, address):
            for _ in range(5):
                status, body = await _ask(gateway, address)
                assert status == 200 and b"chatcmpl-workload" in body
            assert len(workload.seen) == 5
            # Sequential requests share one connection: one handshake, not one per request.
            assert front.tls_connections == 1 and front.refused == 0
    finally:
        await gateway.close()


async def test_a_caller_without_a_certificate_is_refused(layout: SecurityLayout) -> None:
    trusting = ssl.create_default_context(cadata=creds(layout, "gateway").ca_pem)
    async with node_front(layout) as (_, workload, address):
        with pytest.raises(aiohttp.ClientError):
            await _post(address, trusting)  # TLS, but no certificate to show
        with pytest.raises(aiohttp.ClientError):
            await _post(address, None)  # plain HTTP to a TLS port
        assert workload.seen == []


async def test_a_gateway_of_another_ca_is_refused(layout: SecurityLayout, tmp_path: Path) -> None:
    other = SecurityLayout(tmp_path / "other")
    identities.init(other)
    # It trusts our CA, so it is the front that refuses it, not it the front.
    stranger = _client(creds(other, "gateway"), trust=creds(layout, "gateway").ca_pem)
    async with node_front(layout) as (_, workload, address):
        with pytest.raises(aiohttp.ClientError):
            await _post(address, stranger)
        assert workload.seen == []


async def test_a_node_is_refused(layout: SecurityLayout) -> None:
    node = creds(layout, "node-1")
    async with node_front(layout) as (front, workload, address):
        # A node's own certificate serves; as a caller's, TLS refuses it (no client usage).
        with pytest.raises(aiohttp.ClientError):
            await _post(address, _client(node))
        # A node certificate made to dial too passes TLS, and the front refuses the role.
        pem, _ = pki.identity_cert(layout.ca_cert, layout.ca_key, "node", "node-2", client=True)
        dialling = msgspec.structs.replace(node, tls_pem=pem)
        assert await _post(address, _client(dialling)) == 403
        assert front.refused == 1 and workload.seen == []


async def test_a_revoked_gateway_is_cut_off_within_a_second_and_refused_after(
    layout: SecurityLayout,
) -> None:
    """`gpumesh certs revoke gw-2` writes crl.pem; the front, re-reading it, closes gw-2's
    open connection (the read below ends within a second) and refuses it from then on,
    while the other gateway is served on."""
    gw2 = DirectTransport(tls=creds(layout, "gw-2").tls_context(server=False))
    gateway = DirectTransport(tls=creds(layout, "gateway").tls_context(server=False))
    try:
        async with node_front(layout) as (front, workload, address):
            assert (await _ask(gateway, address))[0] == 200
            # gw-2's connection, kept alive after an answer, as the gateway's pool keeps it.
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", front.port, ssl=_client(creds(layout, "gw-2"))
            )
            head = (
                f"POST {front_path('r', 1)}{PATH} HTTP/1.1\r\nHost: node-1\r\n"
                f"Content-Length: {len(CHAT)}\r\n\r\n"
            )
            writer.write(head.encode() + CHAT)
            answer = await reader.readuntil(b"\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 200"), answer
            length = next(
                int(line.partition(b":")[2])
                for line in answer.lower().split(b"\r\n")
                if line.startswith(b"content-length:")
            )
            await reader.readexactly(length)  # the answer, whole: the connection is idle

            revoked = await asyncio.to_thread(
                main, ["--data-dir", str(layout.root.parent), "certs", "revoke", "gw-2"]
            )
            assert revoked == 0
            with contextlib.suppress(ConnectionError, ssl.SSLError):
                # EOF, or a reset: either way the front closed it, within the second.
                assert await asyncio.wait_for(reader.read(), 1.0) == b""
            writer.close()

            status, body = await _ask(gw2, address)  # a new connection: TLS, then refused
            assert status == 403 and b"revoked" in body
            assert (await _ask(gateway, address))[0] == 200
            assert len(workload.seen) == 3  # 2 from gateway, 1 from gw-2 before its revocation
    finally:
        await gw2.close()
        await gateway.close()


async def test_a_list_not_signed_by_the_ca_revokes_nothing_less(
    layout: SecurityLayout, tmp_path: Path
) -> None:
    """A damaged or forged crl.pem is refused: who was revoked stays revoked."""
    gw2 = DirectTransport(tls=creds(layout, "gw-2").tls_context(server=False))
    try:
        async with node_front(layout) as (front, _, address):
            identities.revoke(layout, "gw-2")
            front.check_revocations()
            assert (await _ask(gw2, address))[0] == 403
            other = SecurityLayout(tmp_path / "other")
            identities.init(other)  # another CA's (empty) list, dropped in place of ours
            layout.crl.write_bytes(other.crl.read_bytes())
            front.check_revocations()
            assert (await _ask(gw2, address))[0] == 403
            layout.crl.write_text("not a list")
            front.check_revocations()
            assert (await _ask(gw2, address))[0] == 403
    finally:
        await gw2.close()


async def test_a_gateway_dials_only_a_node_s_front_at_the_address_it_names(
    layout: SecurityLayout,
) -> None:
    """The other way round: the gateway checks the front. The NATS server's certificate (same
    CA, serves 127.0.0.1) is no node's; a node certificate for another address is not this
    one's. Either way the request never leaves: a connect failure, retried elsewhere."""
    gateway = DirectTransport(tls=creds(layout, "gateway").tls_context(server=False))
    nats_cert = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    nats_cert.load_cert_chain(layout.server_cert, layout.server_key)
    nats_cert.load_verify_locations(layout.ca_cert)
    nats_cert.verify_mode = ssl.CERT_REQUIRED
    identities.issue(layout, "far", "node", hosts=["10.9.9.9"])
    far = creds(layout, "far")
    try:
        for impostor in (nats_cert, far.tls_context(server=True)):
            tls = FrontTLS(impostor, far.ca_pem, layout.crl)
            async with node_front(layout, tls=tls) as (_, workload, address):
                with pytest.raises(ConnectFailed) as caught:
                    await _ask(gateway, address)
                assert caught.value.never_delivered and workload.seen == []
    finally:
        await gateway.close()


async def test_the_fence_holds_over_tls(layout: SecurityLayout) -> None:
    """A lapsed lease is refused before the workload, and the gateway knows it was not
    delivered (so even a POST goes to another replica), as over plain HTTP."""
    gateway = DirectTransport(tls=creds(layout, "gateway").tls_context(server=False))
    try:
        async with node_front(layout, fence="lease lapsed") as (front, workload, address):
            with pytest.raises(ConnectFailed, match="fenced") as caught:
                await _ask(gateway, address)
            assert caught.value.never_delivered
            assert front.fenced == 1 and workload.seen == []
    finally:
        await gateway.close()
