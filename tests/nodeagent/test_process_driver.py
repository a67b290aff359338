"""ProcessDriver with real subprocesses on 127.0.0.1: launch, probes, exit, stop, logs."""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from events.cluster import ClusterSpec
from nodeagent.workload import WorkloadStartError
from nodeagent.workload.ports import free_port
from nodeagent.workload.probing import ProbeSettings
from nodeagent.workload.process import ProcessDriver, ProcessWorkload

pytestmark = pytest.mark.integration

TINY = Path(__file__).with_name("tiny_workload.py")
PY = shlex.quote(sys.executable)
FAST = ProbeSettings(
    readiness_timeout_s=20.0,
    readiness_interval_s=0.05,
    liveness_interval_s=0.05,
    liveness_failures=2,
    request_timeout_s=1.0,
)


@pytest.fixture
def driver(tmp_path: Path) -> ProcessDriver:
    return ProcessDriver(tmp_path / "logs", probes=FAST)


@pytest.fixture
async def started() -> AsyncIterator[list[ProcessWorkload]]:
    """Workloads a test starts; whatever they left running is killed afterwards."""
    workloads: list[ProcessWorkload] = []
    yield workloads
    for workload in workloads:
        await workload.stop(0)


def tiny(record: Path, *extra: str) -> str:
    return f"{PY} {shlex.quote(str(TINY))} {shlex.quote(str(record))} {{port}} " + " ".join(extra)


async def read_record(path: Path, timeout: float = 10.0) -> dict[str, Any]:
    async with asyncio.timeout(timeout):
        # The file is the only signal the child process gives.
        while not await asyncio.to_thread(path.exists):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
    result: dict[str, Any] = json.loads(await asyncio.to_thread(path.read_text))
    return result


async def get(url: str) -> int:
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
        session.get(url) as response,
    ):
        return response.status


async def gone(pid: int, timeout: float = 5.0) -> bool:
    """Whether `pid` ends within `timeout`. A killed orphan is a zombie until init reaps it,
    so a zombie counts as gone."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                stat = await asyncio.to_thread(Path(f"/proc/{pid}/stat").read_text)
            except FileNotFoundError:
                return True
            if stat.rpartition(")")[2].split()[0] == "Z":
                return True
            await asyncio.sleep(0.02)  # nothing announces the end of a process not ours


async def test_the_echo_workload_reaches_ready_serves_and_stops_cleanly(
    driver: ProcessDriver, started: list[ProcessWorkload]
) -> None:
    spec = ClusterSpec(
        name="chat",
        model="echo-7b",
        command=f"{PY} -m nodeagent.workload.echo --port {{port}} --model {{model}}",
    )
    workload = await driver.start("r1", 1, spec, (0,), 0)
    started.append(workload)
    assert await workload.wait_ready() is None
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{workload.port}/v1/models") as response,
    ):
        assert (await response.json())["data"][0]["id"] == "echo-7b"
    ended = await workload.stop(5.0)
    assert (ended.reason, ended.exit_code) == ("stopped", 0)  # echo exits cleanly on SIGTERM
    log = driver.log_path("r1", 1).read_text()
    assert "echo: serving model 'echo-7b'" in log
    assert log.startswith("# gpumesh: CUDA_VISIBLE_DEVICES=0 ")


async def test_placeholders_environment_and_gpus_reach_the_process(
    driver: ProcessDriver, started: list[ProcessWorkload], tmp_path: Path
) -> None:
    record = tmp_path / "record.json"
    spec = ClusterSpec(
        name="llama",
        model="my model",  # with a space: still one argument
        command=tiny(record, "{gpu_ids}", "{model}", shlex.quote('--json={"a": 1}')),
        env={"TINY_FLAVOUR": "vanilla"},
    )
    workload = await driver.start("r2", 3, spec, (1, 3), 0)
    started.append(workload)
    info = await read_record(record)
    assert info["argv"][1:] == [str(workload.port), "1,3", "my model", '--json={"a": 1}']
    assert info["cuda"] == "1,3"
    assert info["env"]["TINY_FLAVOUR"] == "vanilla"
    assert info["env"]["GPUMESH_REPLICA_ID"] == "r2"
    assert info["env"]["GPUMESH_EPOCH"] == "3"
    assert await workload.wait_ready() is None


async def test_model_defaults_to_the_cluster_name_and_the_spec_port_is_used(
    driver: ProcessDriver, started: list[ProcessWorkload], tmp_path: Path
) -> None:
    record = tmp_path / "record.json"
    port = free_port()
    spec = ClusterSpec(name="mistral", port=port, command=tiny(record, "{model}"))
    workload = await driver.start("r3", 1, spec, (), 0)
    started.append(workload)
    assert workload.port == port
    info = await read_record(record)
    assert info["argv"][1:] == [str(port), "mistral"]
    assert info["cuda"] == ""  # no GPUs allotted: none visible
    assert await workload.wait_ready() is None


async def test_readiness_times_out_for_a_process_that_never_serves(
    tmp_path: Path, started: list[ProcessWorkload]
) -> None:
    impatient = ProcessDriver(
        tmp_path / "logs", probes=ProbeSettings(readiness_timeout_s=0.5, readiness_interval_s=0.05)
    )
    spec = ClusterSpec(name="slow", command=tiny(tmp_path / "r.json", "--no-serve"))
    workload = await impatient.start("r4", 1, spec, (), 0)
    started.append(workload)
    ended = await workload.wait_ready()
    assert ended is not None
    assert ended.reason == "readiness_timeout"
    assert f"http://127.0.0.1:{workload.port}/health" in ended.detail
    assert (await workload.stop(5.0)).exit_code == -15


async def test_an_exit_before_ready_is_detected_with_its_code(
    driver: ProcessDriver, started: list[ProcessWorkload], tmp_path: Path
) -> None:
    spec = ClusterSpec(name="bad", command=tiny(tmp_path / "r.json", "--exit-now", "3"))
    workload = await driver.start("r5", 1, spec, (), 0)
    started.append(workload)
    ended = await workload.wait_ready()
    assert ended is not None
    assert (ended.reason, ended.exit_code) == ("exited", 3)
    assert "tiny workload on port" in driver.log_path("r5", 1).read_text()


async def test_an_exit_after_ready_is_detected_with_its_code(
    driver: ProcessDriver, started: list[ProcessWorkload], tmp_path: Path
) -> None:
    spec = ClusterSpec(name="crashy", command=tiny(tmp_path / "r.json"))
    workload = await driver.start("r6", 1, spec, (), 0)
    started.append(workload)
    assert await workload.wait_ready() is None
    async with asyncio.timeout(10), asyncio.TaskGroup() as group:
        watching = group.create_task(workload.wait_ended())
        await get(f"http://127.0.0.1:{workload.port}/exit?code=7")
    ended = watching.result()
    assert (ended.reason, ended.exit_code) == ("exited", 7)


async def test_failing_health_checks_end_it_as_liveness_failed(
    driver: ProcessDriver, started: list[ProcessWorkload], tmp_path: Path
) -> None:
    spec = ClusterSpec(name="hangs", command=tiny(tmp_path / "r.json"))
    workload = await driver.start("r7", 1, spec, (), 0)
    started.append(workload)
    assert await workload.wait_ready() is None
    await get(f"http://127.0.0.1:{workload.port}/sick")
    ended = await asyncio.wait_for(workload.wait_ended(), 10)
    assert ended.reason == "liveness_failed"
    assert "HTTP 500" in ended.detail
    assert workload.returncode is None  # still running: the agent stops it


async def test_stop_terminates_the_whole_process_group(
    driver: ProcessDriver, started: list[ProcessWorkload], tmp_path: Path
) -> None:
    record = tmp_path / "r.json"
    spec = ClusterSpec(name="forks", command=tiny(record, "--fork-child"))
    workload = await driver.start("r8", 1, spec, (), 0)
    started.append(workload)
    info = await read_record(record)
    assert await workload.wait_ready() is None
    ended = await workload.stop(5.0)
    assert (ended.reason, ended.exit_code) == ("stopped", -15)
    assert await gone(info["child"])


async def test_stop_kills_after_the_grace_period_a_process_ignoring_sigterm(
    driver: ProcessDriver, started: list[ProcessWorkload], tmp_path: Path
) -> None:
    record = tmp_path / "r.json"
    spec = ClusterSpec(name="stubborn", command=tiny(record, "--ignore-sigterm", "--fork-child"))
    workload = await driver.start("r9", 1, spec, (), 0)
    started.append(workload)
    info = await read_record(record)
    assert await workload.wait_ready() is None
    loop = asyncio.get_running_loop()
    began = loop.time()
    ended = await workload.stop(0.5)
    assert ended.exit_code == -9
    assert 0.45 <= loop.time() - began < 5.0
    assert await gone(info["child"])


async def test_a_cancelled_stop_kills_at_once(
    driver: ProcessDriver, started: list[ProcessWorkload], tmp_path: Path
) -> None:
    record = tmp_path / "r.json"
    spec = ClusterSpec(name="stubborn", command=tiny(record, "--ignore-sigterm"))
    workload = await driver.start("r10", 1, spec, (), 0)
    started.append(workload)
    await read_record(record)
    async with asyncio.TaskGroup() as group:
        stopping = group.create_task(workload.stop(60.0))
        await asyncio.sleep(0)  # it sends SIGTERM, then waits out the grace period
        stopping.cancel()
    assert stopping.cancelled()
    assert await asyncio.wait_for(workload.wait_exit(), 5) == -9


async def test_stop_after_the_process_exited_reports_its_exit_code(
    driver: ProcessDriver, started: list[ProcessWorkload], tmp_path: Path
) -> None:
    spec = ClusterSpec(name="bad", command=tiny(tmp_path / "r.json", "--exit-now", "4"))
    workload = await driver.start("r11", 1, spec, (), 0)
    started.append(workload)
    await workload.wait_ready()
    assert (await workload.stop(1.0)).exit_code == 4


async def test_log_file_is_appended_across_restarts(
    driver: ProcessDriver, started: list[ProcessWorkload], tmp_path: Path
) -> None:
    spec = ClusterSpec(name="bad", command=tiny(tmp_path / "r.json", "--exit-now", "1"))
    for _ in range(2):
        workload = await driver.start("r12", 2, spec, (), 0)
        started.append(workload)
        await workload.wait_ready()
    log = driver.log_path("r12", 2).read_text()
    assert log.count("# gpumesh:") == 2
    assert log.count("tiny workload on port") == 2


@pytest.mark.parametrize(
    ("command", "message"),
    [
        ("", "has no command"),
        ("   ", "has no command"),
        ("python -c 'unclosed", "cannot parse the command"),
        ("/nonexistent/model-server --port {port}", "cannot run '/nonexistent/model-server'"),
        (
            "/nonexistent/bin/vllm serve m --port {port}",
            "the engine 'vllm' is not installed on this node \\(not on its PATH\\): pip "
            "install vllm",
        ),
        (
            "/nonexistent/llama-server -m /m.gguf --port {port}",
            "the engine 'llama-server' is not installed .* `gpumesh workload llm`",
        ),
    ],
)
async def test_start_errors_are_one_clear_line(
    driver: ProcessDriver, command: str, message: str
) -> None:
    with pytest.raises(WorkloadStartError, match=message) as caught:
        await driver.start("r13", 1, ClusterSpec(name="x", command=command), (), 0)
    assert "\n" not in str(caught.value)


async def test_a_command_using_the_model_cache_needs_one(driver: ProcessDriver) -> None:
    spec = ClusterSpec(name="x", command="serve --dir {model_cache} --port {port}")
    with pytest.raises(WorkloadStartError, match=r"uses \{model_cache\}, and this node has no"):
        await driver.start("r13", 1, spec, (), 0)
