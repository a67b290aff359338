"""A sharded replica on real processes (docs/sharding.md): nats-server, a controller process and
3 agent processes with one fake 24 GiB GPU each, so that a 30 GiB model needs a pipeline of 2
stages on 2 nodes. Both stages run the echo workload; the gateway (in this process) routes to
the group's head. Then the worker stage's node loses power: the group fails whole and is placed
again at epoch 2 on the nodes left, and serves. tests/control/test_sharded.py runs the same on
virtual time with scripted agents; bench/failover.py --sharded measures it under load.
"""

from __future__ import annotations

import shlex
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from events.envelope import Envelope
from tests.integration.gateway_kit import running_gateway, until
from tests.integration.stack import Stack, Workload, echo_spec, payload, pid_alive

pytestmark = [pytest.mark.integration, pytest.mark.slow]

AGENTS = 3
GPU = "RTX4090:24GiB:1"  # 21.6 GiB usable of each: 30 GiB takes two, one node left over
# `env` puts the stage placeholders in the command line (what an engine's flags would carry,
# e.g. llama-server --rpc {peers}), so the workload's log header shows them substituted.
SPEC: dict[str, Any] = {
    **echo_spec(1, "big"),
    "sharding": {
        "weights_gib": 30,
        "layers": 32,
        "parallelism": ["pipeline"],
        "worker_probe": "tcp",
        # The stack's agents take the regions in turn, all on this one machine.
        "cross_region": True,
    },
}
SPEC["command"] = "env SEEN_PEERS={peers} SEEN_RANK={rank} " + SPEC["command"]


@pytest.fixture
async def stack(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[Stack]:
    """started_stack's contract (every process gone at teardown), with one GPU per node."""
    s = Stack(tmp_path / "stack", agents=AGENTS, fake_gpus=GPU, nats_binary=nats_server_binary)
    try:
        await s.start()
        yield s
    finally:
        left = await s.close()
        assert left == [], f"processes survived the teardown: {left}"


def environ(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/environ", "rb") as f:
        raw = f.read()
    return dict(
        item.decode(errors="replace").split("=", 1) for item in raw.split(b"\0") if b"=" in item
    )


def stage_process(stack: Stack, node_id: str, epoch: int) -> Workload:
    (found,) = [w for w in stack.workloads(node_id) if w.epoch == epoch]
    return found


async def ask(url: str, model: str = "big", text: str = "one two three") -> tuple[int, str]:
    body = {"model": model, "messages": [{"role": "user", "content": text}]}
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.post(f"{url}/v1/chat/completions", json=body) as resp,
    ):
        if resp.status != 200:
            return resp.status, await resp.text()
        answer = await resp.json()
        return 200, answer["choices"][0]["message"]["content"]


async def group_serving(stack: Stack, epoch: int) -> tuple[Envelope, Envelope]:
    """The placement and the worker's stage_ready at `epoch`, once the head is ready and both
    stages run under their nodes' agents (and no process of another epoch is left)."""
    placed = await stack.wait_for_event("replica.placed.v1", replica_id="big-0", epoch=epoch)
    up = await stack.wait_for_event("replica.stage_ready.v1", replica_id="big-0", epoch=epoch)
    await stack.wait_for_event("replica.ready.v1", replica_id="big-0", epoch=epoch, timeout=30)
    nodes = [s["node_id"] for s in payload(placed)["stages"]]
    await stack.wait_until(
        lambda: (
            sorted((w.epoch, w.ppid) for w in stack.workloads())
            == sorted((epoch, stack.agent_pid(n)) for n in nodes)
        ),
        timeout=10,
        why=f"exactly the 2 stages of epoch {epoch} running",
    )
    return placed, up


def check_pipeline(stack: Stack, placed: Envelope, up: Envelope, epoch: int) -> None:
    stages = payload(placed)["stages"]
    assert [s["rank"] for s in stages] == [0, 1]
    head_node, worker_node = stages[0]["node_id"], stages[1]["node_id"]
    assert head_node != worker_node
    assert payload(placed)["node_id"] == head_node
    assert (stages[0].get("first_layer", 0), stages[0]["last_layer"]) == (0, 16)
    assert (stages[1]["first_layer"], stages[1]["last_layer"]) == (16, 32)
    ready = payload(up)
    assert (ready["rank"], ready["node_id"]) == (1, worker_node)
    worker = stage_process(stack, worker_node, epoch)
    assert ready["address"] == f"127.0.0.1:{worker.port}"  # host:port, no scheme: for the head
    head = stage_process(stack, head_node, epoch)
    head_env, worker_env = environ(head.pid), environ(worker.pid)
    assert head_env["GPUMESH_PEERS"] == head_env["SEEN_PEERS"] == ready["address"]
    assert (head_env["GPUMESH_RANK"], head_env["GPUMESH_WORLD_SIZE"]) == ("0", "2")
    assert (worker_env["GPUMESH_RANK"], worker_env["SEEN_RANK"]) == ("1", "1")
    assert (worker_env["GPUMESH_FIRST_LAYER"], worker_env["GPUMESH_LAST_LAYER"]) == ("16", "32")
    assert worker_env["GPUMESH_PEERS"] == ""
    # The process driver's log header: the command line as run, {peers} substituted.
    log = stack.root / "logs" / "replicas" / head_node / f"big-0-{epoch}.log"
    header = log.read_text().splitlines()[0]
    assert shlex.split(header)[3:5] == ["env", f"SEEN_PEERS={ready['address']}"], header


async def test_a_two_stage_group_serves_and_is_placed_again_when_its_worker_node_dies(
    stack: Stack,
) -> None:
    await stack.create_cluster(SPEC)
    placed, up = await group_serving(stack, 1)
    check_pipeline(stack, placed, up, 1)
    head_node, worker_node = (s["node_id"] for s in payload(placed)["stages"])
    spare = next(n for n in stack.node_ids if n not in (head_node, worker_node))

    async with running_gateway(stack.bus) as gw:
        await until(lambda: len(gw.router.routes("big")) == 1, within=10)
        assert await ask(gw.url) == (200, "one two three")

        killed = await stack.kill_agent(worker_node)
        offline = await stack.wait_for_event(
            "node.health_changed.v1", node_id=worker_node, state="offline"
        )
        failed = await stack.wait_for_event("replica.failed.v1", replica_id="big-0", epoch=1)
        assert payload(failed)["reason"] == "node_offline"
        assert failed.position > offline.position
        placed2, up2 = await group_serving(stack, 2)
        check_pipeline(stack, placed2, up2, 2)
        nodes2 = {s["node_id"] for s in payload(placed2)["stages"]}
        assert nodes2 == {head_node, spare}  # the surviving node's GPU was freed with the group
        assert not any(pid_alive(w.pid) for w in killed.workloads)

        await until(lambda: [r.epoch for r in gw.router.routes("big")] == [2], within=10)
        assert await ask(gw.url, text="after the failover") == (200, "after the failover")
