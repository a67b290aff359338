"""The gateway over real HTTP and a real nats-server: routes, retries, ejection, streams, limits.

A RoutingSource stands in for the controller (the routing table is the only thing the gateway
needs from it); the full stack with a real controller and agents is in test_gateway_stack.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import openai
import pytest

from events.contract import subjects
from events.contract.messages import ReplicaSuspicion
from gateway.auth import KeyRing
from gateway.retry import RetryPolicy
from gateway.router import RouterConfig
from gateway.server import Gateway, GatewayConfig
from nodeagent.fencing_front import DirectFront, front_path
from nodeagent.tunnel import TunnelServer
from tests.integration.gateway_kit import (
    RoutingSource,
    Upstream,
    free_port,
    route,
    running_gateway,
    until,
)
from wire.nats_bus import NatsBus

pytestmark = pytest.mark.integration
Connect = Callable[[str], Any]
StartGateway = Callable[..., AbstractAsyncContextManager[Gateway]]

CHAT = {"model": "llama", "messages": [{"role": "user", "content": "hello brave new world"}]}


@pytest.fixture
async def upstreams() -> AsyncIterator[list[Upstream]]:
    started = [await Upstream(f"u{i}").start() for i in range(3)]
    try:
        yield started
    finally:
        for upstream in started:
            await upstream.stop()


@pytest.fixture(params=["direct", "overlay"])
def transport(request: pytest.FixtureRequest) -> str:
    """Every test runs over both transports: HTTP to the replica, and tunnelled over NATS."""
    name: str = request.param
    return name


@pytest.fixture
async def agents(
    transport: str, upstreams: list[Upstream], connect: Connect
) -> AsyncIterator[None]:
    """For the overlay: one agent-side tunnel server per upstream's node, on its own NATS
    connection, resolving the replica to the upstream's local address."""
    if transport != "overlay":
        yield
        return
    agent_bus = await connect("agents")
    servers = [
        TunnelServer(
            agent_bus, f"node-{u.name}", lambda r, e, u=u: u.address if r == u.name else None
        )
        for u in upstreams
    ]
    async with asyncio.TaskGroup() as tasks:
        running = [tasks.create_task(server.run()) for server in servers]
        for server in servers:
            await asyncio.wait_for(server.subscribed.wait(), 5)
        try:
            yield
        finally:
            for task in running:
                task.cancel()


@pytest.fixture
def gateway(bus: NatsBus, transport: str, agents: None) -> StartGateway:
    def start(
        config: GatewayConfig | None = None, keys: KeyRing | None = None
    ) -> AbstractAsyncContextManager[Gateway]:
        config = config or GatewayConfig(gateway_id="gw-test", port=0)
        return running_gateway(bus, replace(config, transport=transport), keys)

    return start


@pytest.fixture
async def source(bus: NatsBus) -> AsyncIterator[RoutingSource]:
    async with RoutingSource(bus) as s:
        yield s


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def serve_all(source: RoutingSource, upstreams: list[Upstream]) -> None:
    await source.publish({"llama": [route(u.name, u.address) for u in upstreams]})


async def test_openai_client_works_streaming_and_not(
    bus: NatsBus, gateway: StartGateway, source: RoutingSource, upstreams: list[Upstream]
) -> None:
    await serve_all(source, upstreams)
    async with gateway() as gw:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        try:
            answer = await client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "hello gpumesh"}]
            )
            assert answer.choices[0].message.content == "hello gpumesh"
            stream = await client.chat.completions.create(
                model="llama",
                messages=[{"role": "user", "content": "one two three"}],
                stream=True,
            )
            pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
            assert "".join(pieces) == "one two three"
            models = await client.models.list()
            assert [m.id for m in models.data] == ["llama"]
        finally:
            await client.close()


async def test_request_id_reaches_the_replica_and_comes_back(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    await serve_all(source, upstreams)
    async with gateway() as gw:
        async with http.post(
            f"{gw.url}/v1/chat/completions", json=CHAT, headers={"X-Request-Id": "req-42"}
        ) as resp:
            assert resp.status == 200
            assert resp.headers["X-Request-Id"] == "req-42"
        seen = [h for u in upstreams for h in u.seen]
        assert [h.get("X-Request-Id") for h in seen] == ["req-42"]
        assert all("Authorization" not in h for h in seen)
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            generated = resp.headers["X-Request-Id"]
        assert generated.startswith("gw-test-")


async def test_unknown_model_is_404_and_a_bad_body_is_400(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    await serve_all(source, upstreams)
    async with gateway() as gw:
        async with http.post(f"{gw.url}/v1/chat/completions", json={**CHAT, "model": "x"}) as r:
            assert r.status == 404
            error = (await r.json())["error"]
            assert error["code"] == "model_not_found" and "llama" in error["message"]
        async with http.post(f"{gw.url}/v1/completions", data=b"{not json") as r:
            assert r.status == 400
        async with http.post(f"{gw.url}/v1/embeddings", json={"input": "x"}) as r:
            assert r.status == 400
            assert (await r.json())["error"]["code"] == "missing_model"


async def test_a_dead_replica_is_retried_around_then_ejected_and_reported(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    dead = route("dead", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    await source.publish({"llama": [dead, route("u0", upstreams[0].address)]})
    suspicions = await bus.subscribe(subjects.SUSPECT)
    config = GatewayConfig(gateway_id="gw-test", port=0, router=RouterConfig(eject_after=2))
    async with gateway(config) as gw:
        for _ in range(20):
            async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200  # never an error while a replica can serve
        msg = await suspicions.next_msg(timeout=5)
        suspicion = msgspec.json.decode(msg.data, type=ReplicaSuspicion)
        assert (suspicion.replica_id, suspicion.reason) == ("dead", "connect_error")
        assert suspicion.gateway_id == "gw-test" and suspicion.failures == 2
        assert gw.router.is_ejected("dead")
        metrics = await (await http.get(f"{gw.url}/metrics")).text()
        assert 'gpumesh_gateway_retries_total{cluster="llama",reason="connect_error"} 2' in metrics
        assert (
            'gpumesh_gateway_ejections_total{cluster="llama",reason="connect_error"} 1' in metrics
        )
        assert 'gpumesh_gateway_requests_total{cluster="llama",status="200"} 20' in metrics


async def test_a_replica_that_sends_no_first_byte_is_retried_elsewhere(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    upstreams[0].mode = "hang"
    await source.publish({"llama": [route(u.name, u.address) for u in upstreams[:2]]})
    retry = RetryPolicy(first_byte_timeout_s=0.3)
    config = GatewayConfig(
        gateway_id="gw-test", port=0, retry=retry, router=RouterConfig(eject_after=2)
    )
    async with gateway(config) as gw:
        statuses = []
        for _ in range(8):
            async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                statuses.append(resp.status)
                assert resp.headers.get("X-Upstream") == "u1"
        assert statuses == [200] * 8
        assert upstreams[0].hung.is_set()
        assert gw.router.is_ejected("u0")  # consecutive timeouts ejected the hung replica


async def test_a_5xx_before_the_first_byte_is_retried(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    upstreams[0].mode = "error"
    await source.publish({"llama": [route(u.name, u.address) for u in upstreams[:2]]})
    async with gateway() as gw:
        for _ in range(6):
            async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200 and resp.headers["X-Upstream"] == "u1"


async def test_a_stream_cut_mid_answer_ends_with_an_sse_error_event(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    upstreams[0].mode = "cut"
    await source.publish({"llama": [route("u0", upstreams[0].address)]})
    async with gateway() as gw:
        body = {**CHAT, "stream": True}
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            text = (await resp.read()).decode()
        events = [e for e in text.split("\n\n") if e]
        assert events[-1].startswith("event: error\ndata: ")
        error = json.loads(events[-1].split("data: ", 1)[1])["error"]
        assert error["code"] == "stream_broken"
        assert "[DONE]" not in text
        metrics = await (await http.get(f"{gw.url}/metrics")).text()
        assert 'gpumesh_gateway_stream_errors_total{cluster="llama"} 1' in metrics

        # The official client raises on it: no silent truncation.
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="unused", max_retries=0)
        try:
            stream = await client.chat.completions.create(
                model="llama", messages=[{"role": "user", "content": "a b c d"}], stream=True
            )
            with pytest.raises(openai.APIError, match="mid-stream"):
                async for _ in stream:
                    pass
        finally:
            await client.close()


async def test_no_ready_replica_waits_then_503_or_is_served_when_one_appears(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    await source.publish({}, "llama")  # the cluster exists, nothing ready yet
    config = GatewayConfig(gateway_id="gw-test", port=0, retry=RetryPolicy(queue_timeout_s=0.3))
    async with gateway(config) as gw:
        resp = await http.post(f"{gw.url}/v1/chat/completions", json=CHAT)
        assert resp.status == 503
        assert int(resp.headers["Retry-After"]) >= 1
        assert (await resp.json())["error"]["code"] == "no_ready_replica"

    config = GatewayConfig(gateway_id="gw-test", port=0, retry=RetryPolicy(queue_timeout_s=10))
    async with gateway(config) as gw:
        waiting = asyncio.ensure_future(http.post(f"{gw.url}/v1/chat/completions", json=CHAT))
        await asyncio.sleep(0.2)
        assert not waiting.done()
        await serve_all(source, upstreams)
        resp = await asyncio.wait_for(waiting, 5)
        assert resp.status == 200
        resp.release()


async def test_keys_rate_limits_and_the_admin_key(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    await serve_all(source, upstreams)
    key_file = tmp_path / "keys.toml"
    key_file.write_text(
        'admin_keys = ["gm-admin"]\n'
        "[tenants.acme]\n"
        'keys = ["gm-acme"]\n'
        "rate_per_s = 0.01\n"
        "burst = 2\n"
    )
    async with gateway(keys=KeyRing.load(key_file)) as gw:
        url = f"{gw.url}/v1/chat/completions"
        async with http.post(url, json=CHAT) as resp:
            assert resp.status == 401
        acme = {"Authorization": "Bearer gm-acme"}
        for _ in range(2):
            async with http.post(url, json=CHAT, headers=acme) as resp:
                assert resp.status == 200
        async with http.post(url, json=CHAT, headers=acme) as resp:
            assert resp.status == 429
            assert int(resp.headers["Retry-After"]) >= 1
        async with http.get(f"{gw.url}/api/v1/clusters", headers=acme) as resp:
            assert resp.status == 401  # a tenant key is not an admin key
        async with http.get(f"{gw.url}/api/v1/nodes") as resp:
            assert resp.status == 401


async def test_bodies_over_the_limit_get_413(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    await serve_all(source, upstreams)
    config = GatewayConfig(gateway_id="gw-test", port=0, max_body_bytes=1024)
    async with gateway(config) as gw:
        big = {**CHAT, "messages": [{"role": "user", "content": "x" * 4096}]}
        async with http.post(f"{gw.url}/v1/chat/completions", json=big) as resp:
            assert resp.status == 413
            assert (await resp.json())["error"]["code"] == "too_large"
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200


async def test_cluster_passthrough_reaches_any_path(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    await source.publish({"llama": [route("u0", upstreams[0].address)]})
    async with gateway() as gw:
        async with http.get(f"{gw.url}/c/llama/health?deep=1") as resp:
            assert resp.status == 200
            assert await resp.json() == {"status": "ok", "upstream": "u0", "query": "deep=1"}
        async with http.get(f"{gw.url}/c/nope/health") as resp:
            assert resp.status == 404


async def test_a_passthrough_post_is_repeated_only_when_it_is_safe_to(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    """/c/<cluster>/ reaches any API, so a POST there may create something: after a 5xx it is
    not sent to a second replica, unless it carries an Idempotency-Key. A GET is repeated."""
    for upstream in upstreams[:2]:
        upstream.mode = "error"
    await source.publish({"llama": [route(u.name, u.address) for u in upstreams[:2]]})
    path = "/c/llama/v1/chat/completions"

    def tries() -> int:
        return sum(len(u.seen) for u in upstreams[:2])

    async with gateway() as gw:
        async with http.post(f"{gw.url}{path}", json=CHAT) as resp:
            assert resp.status == 502
            assert "Idempotency-Key" in (await resp.json())["error"]["message"]
        assert tries() == 1
        headers = {"Idempotency-Key": "order-7"}
        async with http.post(f"{gw.url}{path}", json=CHAT, headers=headers) as resp:
            assert resp.status == 502
        assert tries() == 1 + 3  # the policy's max_attempts
        # The OpenAI routes are inference calls, repeatable without asking.
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 502
        assert tries() == 1 + 3 + 3


async def test_a_passthrough_post_whose_answer_broke_off_is_not_repeated(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    for upstream in upstreams[:2]:
        upstream.mode = "cutbody"  # the head, then the connection dies mid-body
    await source.publish({"llama": [route(u.name, u.address) for u in upstreams[:2]]})
    async with gateway() as gw:
        async with http.post(f"{gw.url}/c/llama/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 502
            assert "not retried" in (await resp.json())["error"]["message"]
        assert sum(len(u.seen) for u in upstreams[:2]) == 1
        async with http.get(f"{gw.url}/c/llama/health") as resp:
            assert resp.status == 200  # the health route is not cut


async def test_a_passthrough_post_is_retried_when_it_never_reached_a_replica(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    nobody = route("u9", f"http://127.0.0.1:{free_port()}")  # refuses (no tunnel either)
    await source.publish({"llama": [nobody, route("u0", upstreams[0].address)]})
    async with gateway() as gw:
        for _ in range(6):
            async with http.post(f"{gw.url}/c/llama/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200 and resp.headers["X-Upstream"] == "u0"


@pytest.mark.parametrize("transport", ["direct"])  # the overlay's fence: test_fencing.py
async def test_a_passthrough_post_a_fenced_node_refused_goes_to_another_replica(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    """A node whose lease lapsed refuses at its front before the workload sees anything, and
    says so: a POST on /c/ then goes to a replica that can serve, as over the overlay."""
    front = DirectFront(
        "127.0.0.1", 0, lambda r, e: upstreams[1].address, lambda r, e: "lease lapsed"
    )
    async with asyncio.TaskGroup() as tasks:
        serving = tasks.create_task(front.run())
        await front.listening.wait()
        fenced = route("u1", f"http://127.0.0.1:{front.port}{front_path('u1', 1)}")
        await source.publish({"llama": [fenced, route("u0", upstreams[0].address)]})
        try:
            async with gateway() as gw:
                # Enough that the balancer surely picks the fenced one (each pick is 1 in 2).
                for _ in range(20):
                    async with http.post(
                        f"{gw.url}/c/llama/v1/chat/completions", json=CHAT
                    ) as resp:
                        assert resp.status == 200 and resp.headers["X-Upstream"] == "u0"
        finally:
            serving.cancel()
    assert front.fenced >= 1 and upstreams[1].seen == []


async def test_a_stream_still_open_when_the_shutdown_grace_ends_gets_an_error_event(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    upstreams[0].mode = "slowstream"
    await source.publish({"llama": [route("u0", upstreams[0].address)]})
    body = {**CHAT, "stream": True, "messages": [{"role": "user", "content": "a " * 40}]}
    first_chunk = asyncio.Event()
    received = bytearray()

    async def read() -> None:
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            with contextlib.suppress(aiohttp.ClientPayloadError):
                async for data in resp.content.iter_any():
                    received.extend(data)
                    first_chunk.set()

    config = GatewayConfig(gateway_id="gw-test", port=0, shutdown_grace_s=0.3)
    async with asyncio.TaskGroup() as tasks:
        async with gateway(config) as gw:
            reader = tasks.create_task(read())
            await asyncio.wait_for(first_chunk.wait(), 10)
        # The gateway has stopped: its grace ran out with the stream still going.
        await asyncio.wait_for(reader, 10)
    text = received.decode()
    assert text.startswith("data: ")
    assert text.rstrip().split("\n\n")[-1].startswith("event: error\ndata: ")
    assert '"code":"gateway_shutdown"' in text
    assert "[DONE]" not in text


async def test_a_request_still_waiting_when_the_shutdown_grace_ends_is_cut_then(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    """Not a grace of twice the grace plus aiohttp's margin: the gateway cancels what is left
    itself when its grace ends, and the client's connection closes."""
    upstreams[0].mode = "hang"
    await source.publish({"llama": [route("u0", upstreams[0].address)]})
    outcome: list[BaseException] = []

    async def ask() -> None:
        try:
            async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                await resp.read()
        except aiohttp.ClientError as exc:
            outcome.append(exc)

    config = GatewayConfig(gateway_id="gw-test", port=0, shutdown_grace_s=0.3)
    loop = asyncio.get_running_loop()
    async with asyncio.TaskGroup() as tasks:
        async with gateway(config) as gw:
            asker = tasks.create_task(ask())
            await asyncio.wait_for(upstreams[0].hung.wait(), 10)
            stopping = loop.time()
        stopped = loop.time() - stopping
        await asyncio.wait_for(asker, 10)
    assert stopped < 1.2, f"the gateway took {stopped:.2f} s to stop with a 0.3 s grace"
    assert outcome and isinstance(outcome[0], aiohttp.ServerDisconnectedError)


async def test_two_gateways_follow_the_same_table(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    await source.publish({"llama": [route("u0", upstreams[0].address)]})
    async with gateway() as a, gateway() as b:
        await source.publish({"llama": [route("u1", upstreams[1].address)]})
        await until(lambda: a.router.position == b.router.position == source.update.position)
        for gw in (a, b):
            async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.headers["X-Upstream"] == "u1"
        assert a.router.routes("llama") == b.router.routes("llama")


async def test_readiness_and_garbage_on_the_routing_subject(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    await serve_all(source, upstreams)
    async with gateway() as gw:
        async with http.get(f"{gw.url}/readyz") as resp:
            assert resp.status == 200
        await bus.publish(subjects.ROUTING, b"\xff garbage")
        await until(lambda: gw.feed.dropped == 1)
        async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
            assert resp.status == 200  # the table it had still serves


@pytest.fixture
def certificate(tmp_path: Path) -> tuple[Path, Path]:
    import shutil
    import subprocess

    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("no openssl binary to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
         "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    return cert, key


async def test_tls(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    certificate: tuple[Path, Path],
) -> None:
    import ssl

    cert, key = certificate
    await serve_all(source, upstreams)
    config = GatewayConfig(gateway_id="gw-test", port=0, tls_cert=cert, tls_key=key)
    async with gateway(config) as gw:
        assert gw.url.startswith("https://")
        trust = ssl.create_default_context(cafile=str(cert))
        async with aiohttp.ClientSession() as session:
            async with session.post(f"{gw.url}/v1/chat/completions", json=CHAT, ssl=trust) as r:
                assert r.status == 200
            with pytest.raises(aiohttp.ClientConnectorError):
                await session.get(f"{gw.url}/healthz")  # untrusted without the CA


async def test_a_body_the_overlay_cannot_carry_is_413_not_a_retry_storm(
    bus: NatsBus,
    gateway: StartGateway,
    transport: str,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    await serve_all(source, upstreams)
    big = {**CHAT, "messages": [{"role": "user", "content": "word " * 400_000}]}  # 2 MB
    async with gateway() as gw:
        body = io.BytesIO(json.dumps(big).encode())  # aiohttp warns on a raw 2 MB bytes body
        headers = {"Content-Type": "application/json"}
        async with http.post(f"{gw.url}/v1/chat/completions", data=body, headers=headers) as resp:
            if transport == "direct":
                assert resp.status == 200
            else:  # NATS's max_payload (1 MiB by default) bounds a tunnelled request
                assert resp.status == 413
                assert "exceeds" in (await resp.json())["error"]["message"]
        assert not any(gw.router.is_ejected(u.name) for u in upstreams)


async def test_a_spec_model_name_routes_to_its_cluster(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    await source.publish(
        {"llama": [route("u0", upstreams[0].address)]}, models={"llama-3-8b": "llama"}
    )
    async with gateway() as gw:
        body = {**CHAT, "model": "llama-3-8b"}
        async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200 and resp.headers["X-Upstream"] == "u0"
        async with http.get(f"{gw.url}/v1/models") as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["llama-3-8b"]


async def test_before_any_routing_table_it_is_503_not_404(
    bus: NatsBus, gateway: StartGateway, source: RoutingSource, http: aiohttp.ClientSession
) -> None:
    # The source answers with position 0: no table yet.
    async with gateway() as gw, http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
        assert resp.status == 503
        assert resp.headers["Retry-After"] == "1"
        assert resp.headers["X-Request-Id"]
        assert (await resp.json())["error"]["code"] == "not_ready"


async def test_a_long_answer_is_not_a_hung_replica_and_a_cut_one_is_retried(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    upstreams[0].mode = "slowbody"  # head at once, the rest after 0.5 s
    upstreams[1].mode = "cutbody"  # head, five bytes, then the connection dies
    retry = RetryPolicy(first_byte_timeout_s=0.2)
    config = GatewayConfig(gateway_id="gw-test", port=0, retry=retry)
    await source.publish({"llama": [route("u1", upstreams[1].address)]})
    async with gateway(config) as gw:
        await source.publish({"llama": [route(u.name, u.address) for u in upstreams[:2]]})
        await until(lambda: len(gw.router.routes("llama")) == 2)
        for _ in range(4):
            async with http.post(f"{gw.url}/v1/chat/completions", json=CHAT) as resp:
                assert resp.status == 200
                assert (await resp.json())["id"] == "chatcmpl-u0"
        assert not gw.router.is_ejected("u0")


async def test_a_tenant_s_key_reaches_only_its_clusters(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
    tmp_path: Path,
) -> None:
    await source.publish(
        {
            "llama": [route("u0", upstreams[0].address)],
            "secret": [route("u1", upstreams[1].address)],
        }
    )
    key_file = tmp_path / "keys.toml"
    key_file.write_text(
        '[tenants.acme]\nkeys = ["gm-acme"]\nrate_per_s = 0\nclusters = ["llama"]\n'
        '[tenants.ops]\nkeys = ["gm-ops"]\nrate_per_s = 0\n'
    )
    acme = {"Authorization": "Bearer gm-acme"}
    ops = {"Authorization": "Bearer gm-ops"}
    async with gateway(keys=KeyRing.load(key_file)) as gw:
        url = f"{gw.url}/v1/chat/completions"
        async with http.post(url, json=CHAT, headers=acme) as resp:
            assert resp.status == 200
        async with http.post(url, json={**CHAT, "model": "secret"}, headers=acme) as resp:
            assert resp.status == 404  # as if it did not exist
            assert "secret" not in (await resp.json())["error"]["message"].split("`")[2]
        async with http.get(f"{gw.url}/c/secret/health", headers=acme) as resp:
            assert resp.status == 404
        async with http.get(f"{gw.url}/v1/models", headers=acme) as resp:
            assert [m["id"] for m in (await resp.json())["data"]] == ["llama"]
        async with http.post(url, json={**CHAT, "model": "secret"}, headers=ops) as resp:
            assert resp.status == 200  # a tenant without a list reaches every cluster
        assert upstreams[1].seen and len(upstreams[1].seen) == 1


async def test_a_stream_that_dies_before_its_first_token_is_retried_invisibly(
    bus: NatsBus,
    gateway: StartGateway,
    source: RoutingSource,
    upstreams: list[Upstream],
    http: aiohttp.ClientSession,
) -> None:
    upstreams[0].mode = "cut0"  # head sent, then dead: found by bench/failover.py
    await source.publish({"llama": [route("u1", upstreams[1].address)]})
    async with gateway() as gw:
        await source.publish({"llama": [route(u.name, u.address) for u in upstreams[:2]]})
        await until(lambda: len(gw.router.routes("llama")) == 2)
        for _ in range(4):
            body = {**CHAT, "stream": True}
            async with http.post(f"{gw.url}/v1/chat/completions", json=body) as resp:
                text = (await resp.read()).decode()
                assert resp.status == 200 and resp.headers["X-Upstream"] == "u1"
            assert text.rstrip().endswith("data: [DONE]") and "event: error" not in text
        assert upstreams[0].seen  # it was tried, and failed before its first token
