"""DockerDriver: the clear message when no engine answers, the `docker run` it builds, and
its lifecycle against a stand-in CLI (tests/nodeagent/fake_docker.py: exits, GPUs, pulls).
Against a real engine: tests/nodeagent/test_docker_engine.py (no GPU there: `--gpus` needs
the NVIDIA runtime).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from events.cluster import ClusterSpec, DockerOptions
from nodeagent.workload import DriverUnavailable, WorkloadStartError
from nodeagent.workload.docker import DockerDriver, PullProgress, docker_run_argv
from nodeagent.workload.probing import ProbeSettings

FAST = ProbeSettings(readiness_timeout_s=20, readiness_interval_s=0.05, liveness_interval_s=0.05)


def fake_docker(tmp_path: Path, script: str) -> str:
    path = tmp_path / "docker"
    path.write_text(f"#!{sys.executable}\nimport sys\n{script}\n")
    path.chmod(0o755)
    return str(path)


async def test_check_says_docker_is_not_installed(tmp_path: Path) -> None:
    driver = DockerDriver(tmp_path, docker=str(tmp_path / "no-such-docker"))
    with pytest.raises(DriverUnavailable) as caught:
        await driver.check()
    message = str(caught.value)
    assert "docker is not installed" in message
    assert "--workload-driver process" in message
    assert "\n" not in message


async def test_check_says_no_engine_answers_with_dockers_own_reason(tmp_path: Path) -> None:
    docker = fake_docker(
        tmp_path,
        'print("Client:\\n Version: 28.2.2\\n\\nServer:")\n'
        "print('Cannot connect to the Docker daemon at unix:///var/run/docker.sock. "
        "Is the docker daemon running?', file=sys.stderr)\n"
        "sys.exit(1)",
    )
    with pytest.raises(DriverUnavailable) as caught:
        await DockerDriver(tmp_path, docker=docker).check()
    message = str(caught.value)
    assert message.startswith("no docker engine answers (docker info: Cannot connect to the Docker")
    assert message.endswith("start the docker daemon or use --workload-driver process")
    assert "\n" not in message


async def test_check_passes_when_the_engine_answers(tmp_path: Path) -> None:
    await DockerDriver(tmp_path, docker=fake_docker(tmp_path, 'print("28.2.2")')).check()


def test_run_argv_passes_gpus_ports_env_and_the_rendered_command() -> None:
    spec = ClusterSpec(
        name="llama",
        image="vllm/vllm-openai:v0.6.0",
        command="--model {model} --port {port} --devices {gpu_ids}",
        model="meta-llama/Llama-3-8B",
        env={"HF_HOME": "/cache"},
        port=8080,
    )
    argv = docker_run_argv(
        "docker",
        name="gpumesh-r1-2",
        replica_id="r1",
        epoch=2,
        spec=spec,
        gpu_indices=(2, 3),
        host="127.0.0.1",
        host_port=41000,
    )
    assert argv == [
        "docker", "run", "--rm", "-d", "--name", "gpumesh-r1-2",
        "--label", "gpumesh.replica=r1", "--label", "gpumesh.epoch=2",
        "--gpus", '"device=2,3"',
        "-p", "127.0.0.1:41000:8080",
        "--pull", "never",
        "-e", "HF_HOME=/cache",
        "vllm/vllm-openai:v0.6.0",
        # Inside the container the GPUs are renumbered from 0, and the port is the container's.
        "--model", "meta-llama/Llama-3-8B", "--port", "8080", "--devices", "0,1",
    ]  # fmt: skip


def test_run_argv_without_gpus_or_command_uses_the_image_defaults() -> None:
    argv = docker_run_argv(
        "docker",
        name="n",
        replica_id="r",
        epoch=1,
        spec=ClusterSpec(name="x", image="echo:latest"),
        gpu_indices=(),
        host="127.0.0.1",
        host_port=5000,
    )
    assert "--gpus" not in argv
    assert argv[-5:] == ["-p", "127.0.0.1:5000:8000", "--pull", "never", "echo:latest"]


@pytest.fixture
def docker_stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, Path]:
    """An executable `docker` that runs tests/nodeagent/fake_docker.py, and its state dir."""
    state = tmp_path / "docker-state"
    state.mkdir()
    monkeypatch.setenv("FAKE_DOCKER_STATE", str(state))
    script = Path(__file__).with_name("fake_docker.py")
    return fake_docker(
        tmp_path, f"import runpy\nrunpy.run_path({str(script)!r}, run_name='__main__')"
    ), state


@pytest.mark.integration
async def test_the_container_lifecycle_against_a_docker_stand_in(
    tmp_path: Path, docker_stand_in: tuple[str, Path]
) -> None:
    docker, state = docker_stand_in
    driver = DockerDriver(tmp_path / "logs", docker=docker, probes=FAST)
    await driver.check()
    spec = ClusterSpec(name="chat", image="gpumesh/echo:latest", env={"A": "1"})
    workload = await driver.start("r1", 2, spec, (0, 1), 0)
    try:
        assert await workload.wait_ready() is None
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{workload.port}/v1/models") as response,
        ):
            assert response.status == 200
    finally:
        ended = await workload.stop(2.0)
    assert (ended.reason, ended.exit_code) == ("stopped", 0)
    run_args = json.loads((state / "run.json").read_text())
    assert run_args[:4] == ["--rm", "-d", "--name", "gpumesh-r1-2"]
    assert run_args[8:10] == ["--gpus", '"device=0,1"']
    assert f"127.0.0.1:{workload.port}:8000" in run_args
    log = (tmp_path / "logs" / "r1-2.log").read_text()
    assert "fake container log line" in log


@pytest.mark.integration
async def test_a_container_exit_is_detected_with_its_code(
    tmp_path: Path, docker_stand_in: tuple[str, Path]
) -> None:
    docker, state = docker_stand_in
    driver = DockerDriver(tmp_path / "logs", docker=docker, probes=FAST)
    workload = await driver.start("r1", 1, ClusterSpec(name="x", image="x"), (), 0)
    try:
        assert await workload.wait_ready() is None
        os.kill(int((state / "c1.pid").read_text()), signal.SIGKILL)
        (state / "c1.exit").write_text("137")
        ended = await asyncio.wait_for(workload.wait_ended(), 10)
        assert (ended.reason, ended.exit_code) == ("exited", 137)
    finally:
        assert (await workload.stop(1.0)).exit_code == 137


async def test_a_workload_without_an_image_cannot_start(tmp_path: Path) -> None:
    with pytest.raises(WorkloadStartError, match="has no image"):
        await DockerDriver(tmp_path).start("r1", 1, ClusterSpec(name="x"), (), 0)


@pytest.mark.integration
async def test_a_restarted_agent_removes_the_containers_its_node_left(
    tmp_path: Path, docker_stand_in: tuple[str, Path]
) -> None:
    """Containers outlive a killed agent (the engine owns them): its next run finds them by
    the node's label and removes them; another node's agent leaves them alone."""
    docker, state = docker_stand_in
    first = DockerDriver(tmp_path / "logs", docker=docker, probes=FAST, node_id="n1")
    spec = ClusterSpec(name="chat", image="gpumesh/echo:latest")
    workload = await first.start("r1", 1, spec, (), 0)
    assert await workload.wait_ready() is None
    run_args = json.loads((state / "run.json").read_text())
    assert "gpumesh.node=n1" in run_args
    # The agent dies here without stopping it.
    other = DockerDriver(tmp_path / "logs", docker=docker, node_id="n2")
    assert await other.stop_leftovers() == []
    assert not (state / "c1.exit").exists()
    again = DockerDriver(tmp_path / "logs", docker=docker, node_id="n1")
    assert await again.stop_leftovers() == ["c1"]
    assert (state / "c1.exit").exists()
    assert await again.stop_leftovers() == []
    await workload.stop(1.0)


def test_run_argv_passes_the_docker_section() -> None:
    spec = ClusterSpec(
        name="big",
        image="lmsysorg/sglang:latest",
        docker=DockerOptions(
            ipc="host", shm_size="16g", volumes=("/models/hf:/root/.cache/huggingface:ro",)
        ),
    )
    argv = docker_run_argv(
        "docker", name="n", replica_id="r", epoch=1, spec=spec, gpu_indices=(0,),
        host="127.0.0.1", host_port=5000,
    )  # fmt: skip
    pairs = list(itertools.pairwise(argv))
    assert ("--ipc", "host") in pairs and ("--shm-size", "16g") in pairs
    assert ("-v", "/models/hf:/root/.cache/huggingface:ro") in pairs
    assert ("--pull", "never") in pairs  # the driver pulled it first, showing progress
    assert argv[-1] == "lmsysorg/sglang:latest"


def test_pull_progress_counts_the_layers_docker_names() -> None:
    progress = PullProgress()
    for line in (
        "Using default tag: latest", "a1: Pulling fs layer", "b2: Pulling fs layer",
        "b2: Already exists", "a1: Downloading", "Digest: sha256:00", "Status: Downloaded",
        "latest: Pulling from vllm/vllm-openai",
    ):  # fmt: skip
        progress.read(line)
    assert (progress.done, len(progress.layers)) == (1, 2)
    progress.read("a1: Pull complete\n")
    assert (progress.done, len(progress.layers)) == (2, 2)


@pytest.mark.integration
async def test_an_image_is_pulled_once_when_missing_and_each_time_when_always(
    tmp_path: Path, docker_stand_in: tuple[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    docker, state = docker_stand_in
    driver = DockerDriver(tmp_path / "logs", docker=docker, probes=FAST)
    await driver.pull("vllm/vllm-openai:v0.6.0", "missing", replica="r1")
    await driver.pull("vllm/vllm-openai:v0.6.0", "missing", replica="r1")
    assert (state / "pulls.txt").read_text().split() == ["vllm/vllm-openai:v0.6.0"]
    out = capsys.readouterr().out
    assert "image_pull_started" in out and "image_pulled" in out and "layers=2" in out
    await driver.pull("vllm/vllm-openai:v0.6.0", "always")
    assert len((state / "pulls.txt").read_text().split()) == 2


@pytest.mark.integration
async def test_an_image_that_cannot_be_had_is_one_clear_line(
    tmp_path: Path, docker_stand_in: tuple[str, Path]
) -> None:
    docker, state = docker_stand_in
    driver = DockerDriver(tmp_path / "logs", docker=docker, probes=FAST)
    with pytest.raises(WorkloadStartError) as refused:
        await driver.start("r1", 1, ClusterSpec(name="x", image="no-such/engine:1"), (), 0)
    message = str(refused.value)
    assert message.startswith("docker pull no-such/engine:1 failed: Error response from daemon")
    assert "docker login" in message and "\n" not in message
    never = ClusterSpec(
        name="x", image="vllm/vllm-openai:v0.6.0", docker=DockerOptions(pull="never")
    )
    with pytest.raises(WorkloadStartError) as refused:
        await driver.start("r1", 1, never, (), 0)
    assert str(refused.value) == (
        "image vllm/vllm-openai:v0.6.0 is not on this node and docker.pull is never: run "
        "`docker pull vllm/vllm-openai:v0.6.0` there, or set docker.pull to missing"
    )
    assert not (state / "run.json").exists()  # nothing was run


def test_the_nodes_model_cache_fills_the_volumes_and_the_command() -> None:
    spec = ClusterSpec(
        name="v",
        image="vllm/vllm-openai:v0.6.3",
        command="--download-dir {model_cache} --port {port}",
        docker=DockerOptions(volumes=("{model_cache}:/root/.cache/huggingface",)),
    )
    argv = docker_run_argv(
        "docker", name="n", replica_id="r", epoch=1, spec=spec, gpu_indices=(),
        host="127.0.0.1", host_port=5000, model_cache="/srv/models",
    )  # fmt: skip
    assert ("-v", "/srv/models:/root/.cache/huggingface") in list(itertools.pairwise(argv))
    assert argv[-4:] == ["--download-dir", "/srv/models", "--port", "8000"]


@pytest.mark.parametrize(
    ("volumes", "command", "cache", "allowed", "refused"),
    [
        (("/:/host",), "", "/srv/models", (), "docker.volumes: / is not a directory"),
        (("/srv/models/../../etc:/e",), "", "/srv/models", (), "/srv/models/../../etc is not"),
        (("/var/run/docker.sock:/s",), "", "", ("/var/lib",), "/var/run/docker.sock is not"),
        (("{model_cache}:/c",), "", "", (), "uses {model_cache}, and this node has no model"),
        ((), "--dir {model_cache}", "", (), "uses {model_cache}, and this node has no model"),
    ],
)
async def test_a_spec_mounts_only_what_the_node_allows(
    tmp_path: Path,
    volumes: tuple[str, ...],
    command: str,
    cache: str,
    allowed: tuple[str, ...],
    refused: str,
) -> None:
    driver = DockerDriver(
        tmp_path, docker=str(tmp_path / "no-docker"), model_cache=cache, allowed_volumes=allowed
    )
    spec = ClusterSpec(
        name="x", image="i:1", command=command, docker=DockerOptions(volumes=volumes)
    )
    with pytest.raises(WorkloadStartError) as caught:
        await driver.start("r1", 1, spec, (), 0)
    assert refused in str(caught.value) and "\n" not in str(caught.value)


async def test_the_cache_allowed_directories_and_named_volumes_are_mounted(
    tmp_path: Path, docker_stand_in: tuple[str, Path]
) -> None:
    docker, state = docker_stand_in
    driver = DockerDriver(
        tmp_path / "logs", docker=docker, probes=FAST, model_cache="/srv/models",
        allowed_volumes=("/data/shared",),
    )  # fmt: skip
    volumes = ("{model_cache}/hf:/root/.cache/huggingface", "/data/shared/x:/x:ro", "cache:/c")
    spec = ClusterSpec(name="x", image="e:1", docker=DockerOptions(volumes=volumes))
    workload = await driver.start("r1", 1, spec, (), 0)
    try:
        run = json.loads((state / "run.json").read_text())
        mounted = [run[i + 1] for i, a in enumerate(run) if a == "-v"]
        assert mounted == [
            "/srv/models/hf:/root/.cache/huggingface", "/data/shared/x:/x:ro", "cache:/c"
        ]  # fmt: skip
    finally:
        await workload.stop(1.0)
