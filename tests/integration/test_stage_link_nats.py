"""The stage link over a real nats-server: the worker's and the head's ends on their own NATS
connections, as on two nodes; on a secured server (TLS, NKEY identities) with the node
permissions the stage link needs (tests/integration/stage_link_access.py); and llama.cpp's
RPC backend through it, answering as it does over direct TCP (skipped without the binaries)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import time
import urllib.request
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from events.contract import stage_link as frames
from events.contract.stage_link import StageError, StageOpen
from gpumesh.security import identities
from nodeagent.stage_link import StageLinkClient, StageLinkServer, StageTarget
from runtime.env import Msg
from tests.integration.stage_link_access import with_stage_link_permissions
from tests.nodeagent.test_stage_link import (
    EPOCH,
    RANK,
    REPLICA,
    TARGET,
    echo,
    exchange,
    only,
    running,
    tcp_server,
    until,
)
from wire.nats_access import SecurityLayout, load_credentials
from wire.nats_bus import NatsBus
from wire.nats_server import EmbeddedNats

pytestmark = pytest.mark.integration

Connect = Callable[[str], Awaitable[NatsBus]]


@asynccontextmanager
async def ends(
    worker_bus: NatsBus, head_bus: NatsBus, port: int, **options: Any
) -> AsyncIterator[tuple[StageLinkServer, StageLinkClient, tuple[str, int]]]:
    worker = StageLinkServer(worker_bus, "worker", only(port), **options)
    head = StageLinkClient(head_bus, "head", **options)
    async with running(worker.run, head.run):
        await worker.subscribed.wait()
        await head.ready.wait()
        yield worker, head, await head.forward(TARGET)


@pytest.mark.parametrize("size", [1, 64 * 1024, 20 * 1024 * 1024], ids=["1B", "64KiB", "20MiB"])
async def test_an_echo_over_nats_returns_exactly_what_was_sent(connect: Connect, size: int) -> None:
    data = (hashlib.sha256(b"nats").digest() * (size // 32 + 1))[:size]
    worker_bus, head_bus = await connect("worker"), await connect("head")
    async with tcp_server(echo) as port, ends(worker_bus, head_bus, port) as (worker, head, addr):
        got = await exchange(addr, data)
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
        await until(lambda: worker.in_flight == 0 and head.in_flight == 0)
    assert worker.errors == {} and head.errors == {}


async def test_fifteen_short_connections_over_nats(connect: Connect) -> None:
    worker_bus, head_bus = await connect("worker"), await connect("head")
    async with tcp_server(echo) as port, ends(worker_bus, head_bus, port) as (worker, head, addr):
        for i in range(15):
            message = f"hello {i}".encode() * 100
            assert await exchange(addr, message) == message
        await until(lambda: worker.in_flight == 0)
    assert worker.streams == head.streams == 15 and worker.errors == head.errors == {}


async def test_no_agent_on_the_workers_subject_fails_at_once(connect: Connect) -> None:
    head = StageLinkClient(await connect("head"), "head")
    async with running(head.run):
        await head.ready.wait()
        addr = await head.forward(StageTarget("gone", REPLICA, EPOCH, RANK))
        reader, writer = await asyncio.open_connection(*addr)
        with pytest.raises(ConnectionResetError):
            async with asyncio.timeout(3):
                await reader.read(-1)
        writer.close()
    assert head.last_error == "unreachable: no agent listens for stage links on node gone"


# Secured: TLS, one NKEY identity per node, the stage link's permissions.


@pytest.fixture
def layout(tmp_path: Path) -> SecurityLayout:
    layout = SecurityLayout(tmp_path / "data")
    with with_stage_link_permissions():
        identities.init(layout)
        for name in ("head", "worker", "mallory"):
            identities.issue(layout, name, "node")
    return layout


@pytest.fixture
async def secured(
    nats_server_binary: Path, layout: SecurityLayout, tmp_path: Path
) -> AsyncIterator[Connect]:
    async with EmbeddedNats(
        tmp_path / "nats", binary=nats_server_binary, config_file=layout.server_config
    ) as server:
        opened: list[NatsBus] = []

        async def open_as(name: str) -> NatsBus:
            bus = await NatsBus.connect(
                server.url, name=name, credentials=load_credentials(layout.creds(name))
            )
            opened.append(bus)
            return bus

        try:
            yield open_as
        finally:
            for bus in reversed(opened):
                await bus.close()


async def test_on_a_secured_server_a_node_opens_links_only_as_itself(secured: Connect) -> None:
    worker_bus, head_bus, mallory = (
        await secured("worker"),
        await secured("head"),
        await secured("mallory"),
    )
    admitted: list[str] = []

    def admit(head: str, replica_id: str, epoch: int) -> str:
        admitted.append(head)
        return "" if head == "head" else "not this replica's head"

    async with tcp_server(echo) as port:
        worker = StageLinkServer(worker_bus, "worker", only(port), admit=admit)
        head = StageLinkClient(head_bus, "head")
        async with running(worker.run, head.run):
            await worker.subscribed.wait()
            await head.ready.wait()
            addr = await head.forward(TARGET)
            assert await exchange(addr, b"x" * 100_000) == b"x" * 100_000

            # Mallory's frames claiming to come from the head never reach the worker: NATS
            # refuses the publish (its permissions name only its own sender token).
            open_ = frames.encode_open(StageOpen(replica_id=REPLICA, epoch=EPOCH, rank=RANK))
            await mallory.publish(frames.stagelink_to_stage("worker", "head", "forged"), open_)
            await mallory.publish(frames.stagelink_to_head("head", "worker", "s"), b"junk")
            # Nor can it read another node's link.
            answers: asyncio.Queue[Msg] = asyncio.Queue()
            await mallory.subscribe(
                f"{frames.stagelink('head')}.>", handler=lambda msg: answers.put_nowait(msg)
            )
            # As itself, it is heard, and refused by the worker's check of who is calling.
            back: asyncio.Queue[Msg] = asyncio.Queue()
            await mallory.subscribe(
                f"{frames.stagelink('mallory')}.>", handler=lambda msg: back.put_nowait(msg)
            )
            await mallory.publish(frames.stagelink_to_stage("worker", "mallory", "m1"), open_)
            async with asyncio.timeout(5):
                refusal = frames.decode((await back.get()).data)
            assert refusal.meta == StageError(
                reason="forbidden",
                detail=(
                    "stage 1 of replica r1 at epoch 3 from node mallory: not this replica's head"
                ),
            )
            assert await exchange(addr, b"still fine") == b"still fine"
            assert answers.empty()
    assert admitted == ["head", "mallory", "head"]
    assert worker.garbage == 0 and head.strays == 0


# llama.cpp's RPC backend through the link.

QUESTION = "What is the capital of France?"
EXPECTED = "L'Étoile, la Marseillaise, la femme au martyre, la femme au mart"


def _llama_missing() -> str:
    from gpumesh import demo_sharded

    return demo_sharded.missing()


def _post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        answer: dict[str, Any] = json.load(response)
        return answer


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


async def _ask_through(rpc: str, tmp_path: Path, name: str) -> tuple[str, float, float]:
    """llama-server with its layers offloaded to the RPC worker at `rpc`: the answer, tokens/s
    and seconds from start to healthy (the weights' push over the link)."""
    from nodeagent.workload.extras import smollm2_file
    from nodeagent.workload.llama_cpp import find_binaries
    from tests.real_models import free_port

    binaries = find_binaries()
    assert binaries is not None
    port = free_port()
    argv = [
        str(binaries.server), "-m", str(smollm2_file()), "--host", "127.0.0.1",
        "--port", str(port), "-t", "1", "-c", "2048", "--seed", "1",
        "--rpc", rpc, "-ngl", "15",
    ]  # fmt: skip
    log_path = tmp_path / f"{name}.log"
    with log_path.open("ab") as log:
        server = await asyncio.create_subprocess_exec(
            *argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL
        )
    try:
        started = time.perf_counter()
        async with asyncio.timeout(120):
            while not await asyncio.to_thread(_healthy, port):
                assert server.returncode is None, log_path.read_text()[-3000:]
                await asyncio.sleep(0.2)
        load_s = time.perf_counter() - started
        answer = await asyncio.to_thread(
            _post,
            f"http://127.0.0.1:{port}/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": QUESTION}],
                "temperature": 0,
                "max_tokens": 24,
                "seed": 1,
            },
        )
        text = answer["choices"][0]["message"]["content"]
        return text, float(answer.get("timings", {}).get("predicted_per_second", 0.0)), load_s
    finally:
        await _stop(server)


async def _stop(process: asyncio.subprocess.Process) -> None:
    """Without blocking the loop: llama-server's exit goes through the link (it closes its
    connections, and asks the worker's free memory on a new one), which this loop carries."""
    if process.returncode is None:
        process.terminate()
        try:
            async with asyncio.timeout(10):
                await process.wait()
        except TimeoutError:
            process.kill()
            await process.wait()


@asynccontextmanager
async def rpc_worker(tmp_path: Path, name: str) -> AsyncIterator[int]:
    from nodeagent.workload.llama_cpp import find_binaries
    from tests.real_models import free_port

    binaries = find_binaries()
    assert binaries is not None
    port = free_port()
    with (tmp_path / f"{name}.log").open("ab") as log:
        worker = await asyncio.create_subprocess_exec(
            *(str(binaries.rpc_server), "-H", "127.0.0.1", "-p", str(port), "-t", "1"),
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
        )
    try:
        async with asyncio.timeout(30):
            while True:
                try:
                    _, writer = await asyncio.open_connection("127.0.0.1", port)
                except OSError:
                    await asyncio.sleep(0.1)
                    continue
                writer.close()  # a probe: it serves the next client once this one is gone
                break
        yield port
    finally:
        await _stop(worker)


@pytest.mark.slow
@pytest.mark.timeout(300)
async def test_llama_cpp_rpc_answers_through_the_link_as_it_does_direct(
    connect: Connect, tmp_path: Path
) -> None:
    missing = _llama_missing()
    if missing:
        pytest.skip(missing)
    async with rpc_worker(tmp_path, "rpc-direct") as port:
        direct, direct_tps, direct_load = await _ask_through(
            f"127.0.0.1:{port}", tmp_path, "direct"
        )
    worker_bus, head_bus = await connect("worker"), await connect("head")
    async with (
        rpc_worker(tmp_path, "rpc-tunnel") as port,
        ends(worker_bus, head_bus, port) as (worker, head, (host, fport)),
    ):
        tunnelled, tunnel_tps, tunnel_load = await _ask_through(
            f"{host}:{fport}", tmp_path, "tunnel"
        )
        streams = worker.streams
    print(
        f"\nllama.cpp RPC, SmolLM2-135M, -ngl 15: direct {direct_tps:.1f} tokens/s "
        f"(healthy after {direct_load:.2f} s), through the stage link {tunnel_tps:.1f} tokens/s "
        f"(healthy after {tunnel_load:.2f} s), {streams} streams"
    )
    assert direct == EXPECTED, direct
    assert tunnelled == direct
    assert worker.errors == {} or set(worker.errors) <= {"cancelled"}, worker.errors
    assert head.errors == {} or set(head.errors) <= {"cancelled"}, head.errors
