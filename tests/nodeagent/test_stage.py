"""One stage of a sharded replica on the agent: its command, probe and environment
(nodeagent/stage.py), and the TCP and "none" probes a worker stage may use, against a real
listening socket and a real process on 127.0.0.1."""

from __future__ import annotations

import asyncio
import sys

import pytest

from events.cluster import ClusterSpec, ProbeSpec, ShardingSpec
from events.contract.messages import StageLaunch
from nodeagent.stage import stage_spec, stage_values, worker_address
from nodeagent.workload.probing import NONE_URL, ProbeSettings, probe_urls, wait_ready, watch

SPEC = ClusterSpec(
    name="big",
    command="llama-server -m m.gguf --rpc {peers} -ngl {peer_layers} -ts {peer_split} "
    "--port {port}",
    env={"LOG": "1"},
    sharding=ShardingSpec(
        weights_gib=30,
        layers=32,
        parallelism=("pipeline",),
        worker_command="ggml-rpc-server -H 0.0.0.0 -p {port} # rank {rank} of {world_size}",
    ),
)
HEAD = StageLaunch(
    rank=0,
    world_size=3,
    first_layer=0,
    last_layer=10,
    total_layers=32,
    split=(10, 12, 10),
    head_host="10.0.0.1",
    peers=("10.0.0.2:50052", "10.0.0.3:50053"),
)
WORKER = StageLaunch(
    rank=2, world_size=3, first_layer=22, last_layer=32, total_layers=32, split=(10, 12, 10)
)


def test_the_head_runs_the_spec_command_with_its_peers_and_their_split() -> None:
    spec = stage_spec(SPEC, HEAD)
    assert spec.command == (
        "llama-server -m m.gguf --rpc 10.0.0.2:50052,10.0.0.3:50053 -ngl 22 -ts 12,10 "
        "--port {port}"  # the driver's own placeholders are left for the driver
    )
    assert spec.probes == SPEC.probes  # the head serves the API: probed over HTTP
    assert spec.env["LOG"] == "1"
    assert spec.env["GPUMESH_RANK"] == "0"
    assert spec.env["GPUMESH_PEERS"] == "10.0.0.2:50052,10.0.0.3:50053"
    assert spec.env["GPUMESH_SPLIT"] == "10,12,10"
    assert spec.env["GPUMESH_HEAD_HOST"] == "10.0.0.1"


def test_a_worker_runs_the_worker_command_probed_as_the_spec_says() -> None:
    spec = stage_spec(SPEC, WORKER)
    assert spec.command == "ggml-rpc-server -H 0.0.0.0 -p {port} # rank 2 of 3"
    assert spec.probes.kind == "tcp"
    assert spec.env["GPUMESH_LAYERS"] == "10"
    assert spec.env["GPUMESH_FIRST_LAYER"] == "22" and spec.env["GPUMESH_LAST_LAYER"] == "32"
    plain = ClusterSpec(
        name="x",
        command="serve --port {port}",
        sharding=ShardingSpec(weights_gib=1, worker_probe="http"),
    )
    worker = stage_spec(plain, WORKER)
    assert worker.command == "serve --port {port}" and worker.probes.kind == "http"


def test_every_placeholder_has_a_variable() -> None:
    values = stage_values(HEAD)
    assert set(values) == {
        "{rank}",
        "{world_size}",
        "{first_layer}",
        "{last_layer}",
        "{layers}",
        "{split}",
        "{peer_layers}",
        "{peer_split}",
        "{peers}",
        "{head_host}",
    }
    env = stage_spec(SPEC, HEAD).env
    assert all("GPUMESH_" + k.strip("{}").upper() in env for k in values)


def test_a_worker_address_is_host_and_port() -> None:
    assert worker_address("10.0.0.2", 50052) == "10.0.0.2:50052"
    assert worker_address("::1", 50052) == "[::1]:50052"


def test_probe_urls_by_kind() -> None:
    http = ClusterSpec(name="x", command="c", health_path="/health")
    assert probe_urls(http, "127.0.0.1", 9) == ("http://127.0.0.1:9/health",) * 2
    tcp = ClusterSpec(name="x", command="c", probes=ProbeSpec(kind="tcp"))
    assert probe_urls(tcp, "127.0.0.1", 9) == ("tcp://127.0.0.1:9",) * 2
    none = ClusterSpec(name="x", command="c", probes=ProbeSpec(kind="none"))
    assert probe_urls(none, "127.0.0.1", 9) == (NONE_URL, NONE_URL)


FAST = ProbeSettings(
    readiness_timeout_s=1.0,
    readiness_interval_s=0.05,
    liveness_interval_s=0.05,
    liveness_failures=2,
    request_timeout_s=0.5,
)


async def _never_exits() -> int:
    await asyncio.Event().wait()
    return 0


async def _exits_at_once() -> int:
    return 3


@pytest.mark.integration
def test_the_tcp_probe_is_ready_when_the_port_accepts_and_then_watches_the_process() -> None:
    async def main() -> None:
        async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writer.close()

        server = await asyncio.start_server(hang_up, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        url = f"tcp://127.0.0.1:{port}"
        assert await wait_ready(url, FAST, _never_exits) is None
        server.close()
        await server.wait_closed()
        # Once ready, it is watched by its process alone (a one-client RPC server must not
        # be sent probes behind the head's connection): a closed port is not a failure.
        watching = asyncio.create_task(watch(url, FAST, _never_exits))
        await asyncio.sleep(FAST.liveness_interval_s * (FAST.liveness_failures + 2))
        assert not watching.done()
        watching.cancel()
        exited = await watch(url, FAST, _exits_at_once)
        assert (exited.reason, exited.exit_code) == ("exited", 3)
        refused = await wait_ready(url, FAST, _never_exits)
        assert refused is not None and refused.reason == "readiness_timeout"
        assert refused.detail.startswith(f"no connection to {url} within 1 s")

    asyncio.run(main())


@pytest.mark.integration
def test_the_none_probe_is_ready_once_the_process_has_run_a_second() -> None:
    async def main() -> None:
        quick = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        ended = await wait_ready(NONE_URL, FAST, quick.wait)
        assert ended is not None and ended.reason == "exited"
        lasting = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(30)"
        )
        try:
            assert await wait_ready(NONE_URL, FAST, lasting.wait) is None
        finally:
            lasting.kill()
            await lasting.wait()

    asyncio.run(main())
