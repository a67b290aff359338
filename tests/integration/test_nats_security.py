"""A secured nats-server (TLS, one NKEY user per identity, per-role permissions) confines each
role: tested against the real server, with the configuration `gpumesh certs init` writes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import msgspec
import nats.errors
import nkeys
import pytest
from nats.js.api import ConsumerConfig

from events.contract import subjects
from events.contract.messages import StopReplica
from gpumesh.security import identities
from runtime.env import BusError, Msg, NoResponders, RequestTimeout
from wire.nats_access import Credentials, SecurityLayout, load_credentials
from wire.nats_bus import BusUnavailable, NatsBus, NatsSubscription
from wire.nats_commands import JetStreamCommandQueue, consumer_name
from wire.nats_server import EmbeddedNats
from wire.routing_log import ensure_routing_log, last_routing_table

Connect = Callable[[str], Awaitable[NatsBus]]


@pytest.fixture
def layout(tmp_path: Path) -> SecurityLayout:
    layout = SecurityLayout(tmp_path / "data")
    identities.init(layout)
    for name in ("node-a", "node-b"):
        identities.issue(layout, name, "node")
    identities.issue(layout, "analytics", "integrator")
    return layout


@pytest.fixture
async def server(
    nats_server_binary: Path, layout: SecurityLayout, tmp_path: Path
) -> AsyncIterator[EmbeddedNats]:
    async with EmbeddedNats(
        tmp_path / "nats", binary=nats_server_binary, config_file=layout.server_config
    ) as server:
        yield server


@pytest.fixture
async def connect(server: EmbeddedNats, layout: SecurityLayout) -> AsyncIterator[Connect]:
    opened: list[NatsBus] = []

    async def open_as(name: str) -> NatsBus:
        bus = await NatsBus.connect(
            server.url,
            name=name,
            reconnect_wait=0.1,
            credentials=load_credentials(layout.creds(name)),
        )
        opened.append(bus)
        return bus

    try:
        yield open_as
    finally:
        for bus in reversed(opened):
            await bus.close()


async def _next(sub: NatsSubscription, timeout: float = 5.0) -> Msg:
    return await sub.next_msg(timeout)


async def test_the_server_requires_tls(server: EmbeddedNats) -> None:
    assert server.url.startswith("tls://")
    plain = server.url.replace("tls://", "nats://")
    with pytest.raises(BusUnavailable):
        await NatsBus.connect(plain, name="plain", connect_timeout=2.0)


async def test_unauthenticated_connections_are_refused(
    server: EmbeddedNats, layout: SecurityLayout
) -> None:
    # TLS with the right CA, but no key at all.
    ca_only = load_credentials(layout.creds("node-a"))
    with pytest.raises(BusUnavailable, match=r"(?i)authoriz"):
        await NatsBus.connect(
            server.url,
            name="anonymous",
            credentials=msgspec.structs.replace(ca_only, seed=""),
        )


async def test_an_unknown_key_is_refused(server: EmbeddedNats, layout: SecurityLayout) -> None:
    real = load_credentials(layout.creds("node-a"))
    stranger = nkeys.from_seed(nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER))
    forged = msgspec.structs.replace(
        real, seed=stranger.seed.decode(), public_key=stranger.public_key.decode()
    )
    with pytest.raises(BusUnavailable, match=r"(?i)authoriz"):
        await NatsBus.connect(server.url, name="forged", credentials=forged)


async def test_a_server_signed_by_another_ca_is_not_trusted(
    server: EmbeddedNats, layout: SecurityLayout, tmp_path: Path
) -> None:
    other = SecurityLayout(tmp_path / "other")
    identities.init(other)
    wrong_ca = msgspec.structs.replace(
        load_credentials(layout.creds("node-a")), ca_pem=other.ca_cert.read_text()
    )
    with pytest.raises(BusUnavailable, match=r"(?i)certificate"):
        await NatsBus.connect(server.url, name="mitm-victim", credentials=wrong_ca)


async def test_a_node_cannot_publish_another_nodes_heartbeat(connect: Connect) -> None:
    controller = await connect("controller")
    node_a = await connect("node-a")
    beats = await controller.subscribe(subjects.HEARTBEAT_ALL)
    await controller.flush()
    await node_a.publish(subjects.heartbeat("node-b"), b"forged")
    await node_a.publish(subjects.register("node-b"), b"forged")
    await node_a.publish(subjects.heartbeat("node-a"), b"mine")
    # One connection's messages arrive in order: had the forgery passed, it would come first.
    first = await _next(beats)
    assert first.subject == subjects.heartbeat("node-a")
    assert first.data == b"mine"


async def test_a_node_cannot_read_another_nodes_commands(connect: Connect) -> None:
    controller = await connect("controller")
    node_a = await connect("node-a")
    spying = await node_a.subscribe(subjects.command("node-b"))
    own = await node_a.subscribe(subjects.tunnel("node-a"))
    await node_a.flush()
    await controller.publish(subjects.command("node-b"), b"for b only")
    await controller.publish(subjects.tunnel("node-a"), b"for a")
    assert (await _next(own)).data == b"for a"
    with pytest.raises(TimeoutError):
        await _next(spying, timeout=0.3)


async def test_the_controller_asks_a_node_to_measure_its_links_and_no_other_node_hears(
    connect: Connect,
) -> None:
    controller = await connect("controller")
    node_a = await connect("node-a")
    node_b = await connect("node-b")
    asked = await node_a.subscribe(subjects.links("node-a"))
    spying = await node_b.subscribe(subjects.links("node-a"))
    await node_a.flush()
    await node_b.flush()
    inbox = controller.new_inbox()
    answers = await controller.subscribe(inbox)
    await controller.flush()
    await controller.publish(subjects.links("node-a"), b"measure", reply=inbox)
    request = await _next(asked)
    await node_a.publish(request.reply, b"measured")
    assert (await _next(answers)).data == b"measured"
    with pytest.raises(TimeoutError):
        await _next(spying, timeout=0.3)


async def test_a_node_cannot_bind_a_consumer_on_another_nodes_commands(
    connect: Connect,
) -> None:
    controller = await connect("controller")
    await JetStreamCommandQueue.create(controller)
    node_a = await connect("node-a")
    js = node_a.jetstream(timeout=1.0)
    stream = subjects.COMMANDS_STREAM
    for name, filtered in (
        (consumer_name("node-b"), subjects.command("node-b")),  # b's consumer
        (consumer_name("node-a"), subjects.command("node-b")),  # its own name, b's subject
    ):
        config = ConsumerConfig(name=name, durable_name=name, filter_subject=filtered)
        with pytest.raises(Exception):  # noqa: B017 - the server drops it: a timeout
            await js.add_consumer(stream, config)
    with pytest.raises(Exception):  # noqa: B017
        await js.delete_stream(stream)


async def test_a_node_consumes_its_own_commands(connect: Connect) -> None:
    controller = await connect("controller")
    sender = await JetStreamCommandQueue.create(controller)
    node_a = await connect("node-a")
    receiver = await JetStreamCommandQueue.create(node_a, manage_stream=False, poll_interval=0.5)
    command = StopReplica(command_id="cmd-1", replica_id="r-1", epoch=1, reason="test")
    await sender.send("node-a", command)
    deliveries = receiver.consume("node-a")
    try:
        async with asyncio.timeout(10):
            delivery = await anext(deliveries)
        assert delivery.command == command
        await delivery.ack()
    finally:
        await deliveries.aclose()


async def test_tunnel_replies_flow_from_node_to_gateway(
    server: EmbeddedNats, connect: Connect, layout: SecurityLayout
) -> None:
    gateway = await _new_identity(server, layout, "gw-1", "gateway")
    try:
        node_a = await connect("node-a")
        requests = await node_a.subscribe(subjects.tunnel("node-a"))
        await node_a.flush()
        inbox = gateway.new_inbox()
        assert inbox.startswith("_INBOX.gateway.gw-1.")
        frames = await gateway.subscribe(inbox + ".*")
        await gateway.flush()
        await gateway.publish(subjects.tunnel("node-a"), b"GET /", reply=inbox + ".1")
        request = await _next(requests)
        # A streamed response: several replies to one request (allow_responses).
        for i in range(3):
            await node_a.publish(request.reply, f"frame {i}".encode())
        got = [(await _next(frames)).data for _ in range(3)]
        assert got == [b"frame 0", b"frame 1", b"frame 2"]
        # ...but the node may not publish into the gateway's inbox unprompted.
        await node_a.publish(inbox + ".2", b"unsolicited")
        await node_a.publish(request.reply, b"last")
        assert (await _next(frames)).data == b"last"
        # A gateway may not pose as a node.
        beats = await (await connect("controller")).subscribe(subjects.HEARTBEAT_ALL)
        await gateway.publish(subjects.heartbeat("node-a"), b"forged")
        await gateway.flush()
        with pytest.raises(TimeoutError):
            await _next(beats, timeout=0.3)
    finally:
        await gateway.close()


async def test_an_integrator_reads_events_and_changes_nothing(connect: Connect) -> None:
    controller = await connect("controller")
    analytics = await connect("analytics")
    events = await analytics.subscribe(subjects.EVENTS_ALL)
    await analytics.flush()
    api = await controller.subscribe(subjects.API_ALL)
    await controller.flush()
    await controller.publish(subjects.event("node/gpu-1"), b"an event")
    assert (await _next(events)).data == b"an event"
    with pytest.raises((NoResponders, RequestTimeout, BusError)):
        await analytics.request(subjects.api("cluster.delete"), b"{}", timeout=0.5)
    # A read-only verb does reach the control API.
    asking = asyncio.create_task(
        analytics.request(subjects.api("cluster.list"), b"{}", timeout=5.0)
    )
    try:
        first = await _next(api)
        assert first.subject == subjects.api("cluster.list")
        await controller.publish(first.reply, b"{}")
        assert (await asking).data == b"{}"
    finally:
        asking.cancel()


async def test_a_revoked_node_is_cut_off(
    server: EmbeddedNats, connect: Connect, layout: SecurityLayout
) -> None:
    node_b = await connect("node-b")
    creds = load_credentials(layout.creds("node-b"))
    identities.revoke(layout, "node-b")
    assert not layout.creds("node-b").exists()
    server.reload()
    async with asyncio.timeout(15):
        await node_b.credentials_refused.wait()
    assert not node_b.is_connected
    with pytest.raises(BusUnavailable, match=r"(?i)authoriz"):
        await NatsBus.connect(server.url, name="node-b-again", credentials=creds)
    # Nobody else was disturbed.
    node_a = await connect("node-a")
    assert node_a.is_connected


async def _new_identity(
    server: EmbeddedNats, layout: SecurityLayout, name: str, role: identities.Role
) -> NatsBus:
    """Issue `name` a `role` identity, reload the server, and connect as it."""
    identities.issue(layout, name, role)
    server.reload()
    return await _eventually_connect(server, load_credentials(layout.creds(name)))


async def _eventually_connect(server: EmbeddedNats, creds: Credentials) -> NatsBus:
    """A reload is asynchronous in the server: retry briefly until the new user is known."""
    async with asyncio.timeout(10):
        while True:
            try:
                return await NatsBus.connect(server.url, name=creds.name, credentials=creds)
            except BusUnavailable:
                await asyncio.sleep(0.05)


async def test_a_gateway_reads_the_last_routing_table_and_no_other_stream(
    server: EmbeddedNats, connect: Connect, layout: SecurityLayout
) -> None:
    gateway = await _new_identity(server, layout, "gw-2", "gateway")
    try:
        controller = await connect("controller")
        await ensure_routing_log(controller)
        await controller.publish(subjects.ROUTING, b'{"type": "routing_update.v1"}')
        await controller.flush()
        for _ in range(50):  # the stream captures the plain publish a moment later
            if await last_routing_table(gateway) is not None:
                break
            await asyncio.sleep(0.05)
        assert await last_routing_table(gateway) == b'{"type": "routing_update.v1"}'
        # The same request on another stream (the commands, say) is refused.
        with pytest.raises((BusError, nats.errors.Error)):
            await gateway.jetstream().get_last_msg(subjects.COMMANDS_STREAM, "x")
    finally:
        await gateway.close()


async def test_only_the_controller_reads_the_secret_bucket(
    server: EmbeddedNats, connect: Connect, layout: SecurityLayout
) -> None:
    """The controllers' secret store (wire/secret_kv.py): the controller writes and reads it;
    a node, a gateway and an integrator can neither read a value nor open the bucket."""
    from events.secret_store import SecretStoreError, reference
    from wire.secret_kv import BUCKET, STREAM, JetStreamSecretStore

    controller = await connect("controller")
    store = JetStreamSecretStore(controller)
    await store.put(reference("hf_value"), "hf_value")
    assert await store.get(reference("hf_value")) == "hf_value"
    assert await JetStreamSecretStore(controller).get(reference("other")) is None
    gateway = await _new_identity(server, layout, "gw-3", "gateway")
    try:
        for bus in (await connect("node-a"), gateway, await connect("analytics")):
            with pytest.raises(SecretStoreError):
                await JetStreamSecretStore(bus, timeout=1.0).get(reference("hf_value"))
            js = bus.jetstream(timeout=1.0)
            with pytest.raises((BusError, nats.errors.Error)):
                await js.get_last_msg(STREAM, f"$KV.{BUCKET}.{reference('hf_value')[14:]}")
    finally:
        await gateway.close()
