"""A real model split across two agents: `gpumesh up --demo sharded` serves SmolLM2-135M as a
2-stage pipeline (llama.cpp's ggml-rpc-server on one node, llama-server --rpc at the head on
another; docs/sharding.md), the official openai client streams a chat through the gateway, and
the answer at temperature 0 is the one llama-server gives alone, token for token.

Needs SmolLM2's weights and the binaries of `gpumesh workload build llama-cpp` (.ci/run builds
them once into the cache, about 6 min on 2 cores); without them it skips, naming the command.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest

from gpumesh import demo_sharded
from nodeagent.workload.extras import smollm2_file
from nodeagent.workload.llama_cpp import find_binaries
from tests.integration.test_real_models import up
from tests.integration.up_process import api
from tests.real_models import free_port

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(bool(demo_sharded.missing()), reason=demo_sharded.missing() or "-"),
]

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TOKENS = 24


def _ask(base_url: str, model: str) -> str:
    """The whole answer, streamed, at temperature 0."""
    import openai

    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=model,
        messages=QUESTION,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=TOKENS,
        seed=1,
        stream=True,
    )
    return "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


def _unsharded_answer(tmp_path: Path) -> str:
    """The same binary and model in one process, every layer on the CPU."""
    binaries = find_binaries()
    assert binaries is not None
    port = free_port()
    argv = [
        str(binaries.server), "-m", str(smollm2_file()), "--host", "127.0.0.1",
        "--port", str(port), "--alias", "alone", "-t", "1", "-c", str(demo_sharded.CONTEXT),
        "--seed", "1", "-ngl", "0",
    ]  # fmt: skip
    with (tmp_path / "alone.log").open("ab") as log:
        server = subprocess.Popen(argv, stdout=log, stderr=log, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                return _ask(f"http://127.0.0.1:{port}/v1", "alone")
            except Exception:
                assert server.poll() is None, (tmp_path / "alone.log").read_text()[-2000:]
                assert time.monotonic() < deadline, "llama-server alone never answered"
                time.sleep(0.2)
    finally:
        server.terminate()
        server.wait(10)


async def _stage_address(stack: Any, replica_id: str, epoch: int) -> str:
    """The worker's own host:port, as its replica.stage_ready.v1 recorded it."""
    after = 0
    while True:
        page = await api(stack.bus, "events.list", {"after": after, "limit": 1000})
        for event in page["events"]:
            payload = event["payload"]
            if (
                event["type"] == "replica.stage_ready.v1"
                and payload["replica_id"] == replica_id
                and payload["epoch"] == epoch
            ):
                return str(payload["address"])
        if not page["events"] or page["next"] >= page["head"]:
            raise AssertionError(f"no stage_ready for {replica_id}@{epoch}")
        after = page["next"]


def test_a_model_split_over_two_agents_answers_as_it_does_whole(tmp_path: Path) -> None:
    async def main() -> None:
        async with up(tmp_path, "--demo", "sharded") as stack:
            cluster = await stack.wait_ready("sharded", 1)
            (replica,) = cluster["replicas"]
            # Fake cards of 192 and 128 MiB: the plan's 2 stages, layers split 18:12.
            log = stack.replica_log(replica["replica_id"], replica["epoch"])
            assert " -ngl 12 -ts 12" in log and " --rpc 127.0.0.1:" in log, log[:2000]
            sharded = await asyncio.to_thread(_ask, stack.gateway + "/v1", "sharded")
            alone = await asyncio.to_thread(_unsharded_answer, tmp_path)
            assert sharded and sharded == alone, (sharded, alone)

            # The same pipeline with its stage link carried over NATS (TLS, the nodes' own
            # identities): the head dials a local port its agent forwards to the worker's.
            await api(stack.bus, "cluster.delete", {"name": "sharded"})
            overlay = demo_sharded.spec(name="sharded-overlay", stage_links="overlay")
            await api(stack.bus, "cluster.create", msgspec.to_builtins(overlay))
            cluster = await stack.wait_ready("sharded-overlay", 1)
            (replica,) = cluster["replicas"]
            log = stack.replica_log(replica["replica_id"], replica["epoch"])
            rpc = re.search(r" --rpc (127\.0\.0\.1:\d+) ", log)
            assert rpc is not None, log[:2000]
            worker = await _stage_address(stack, replica["replica_id"], replica["epoch"])
            assert rpc.group(1) != worker  # not the worker's own port: the agent's forward
            over = await asyncio.to_thread(_ask, stack.gateway + "/v1", "sharded-overlay")
            assert over == alone, (over, alone)

    asyncio.run(main())
