"""`gpumesh agent`, `gpumesh agent fault` and `gpumesh workload echo`: parsing and the one-line
failures; the echo command as a real process stopped by SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from nodeagent import cli
from nodeagent.workload.ports import free_port

from .cli_main import build_parser

REPO = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def test_agent_options_parse() -> None:
    args = parse(
        "agent", "--node-id", "gpu-1", "--fake-gpus", "A100:80GiB:2", "--label", "tier=gold",
        "--label", "rack = r7", "--price", "1.5", "--heartbeat-interval", "0.5",
        "--workload-driver", "docker", "--region", "eu", "--zone", "eu-1a",
    )  # fmt: skip
    assert args.handler is cli.run_agent
    assert args.node_id == "gpu-1" and args.fake_gpus == "A100:80GiB:2"
    assert args.label == [("tier", "gold"), ("rack", "r7")]
    assert (args.price, args.heartbeat_interval, args.workload_driver) == (1.5, 0.5, "docker")
    assert (args.region, args.zone, args.nats) == ("eu", "eu-1a", None)


def test_fault_parses_and_keeps_a_nats_url_given_before_it() -> None:
    args = parse(
        "agent", "--nats", "nats://h:4222", "fault", "gpu-1", "thermal", "95", "--gpu", "1"
    )
    assert args.handler is cli.send_fault
    assert (args.node, args.kind, args.value, args.gpu) == ("gpu-1", "thermal", 95.0, 1)
    assert args.nats == "nats://h:4222"
    assert parse("agent", "fault", "gpu-1", "clear").value == 0.0


def test_a_throttle_fault_names_its_reasons_as_nvmls_bit_mask() -> None:
    assert parse("agent", "fault", "gpu-1", "throttle", "hw_slowdown").value == 8.0
    both = parse("agent", "fault", "n", "throttle", "hw_slowdown,hw_power_brake_slowdown")
    assert both.value == 8.0 + 128.0
    assert parse("agent", "fault", "gpu-1", "throttle", "none").value == 0.0
    assert parse("agent", "fault", "gpu-1", "xid", "79").value == 79.0


def test_workload_echo_parses() -> None:
    args = parse("workload", "echo", "--port", "0", "--ttft-ms", "20", "--model", "m")
    assert args.handler is cli.run_echo
    assert (args.port, args.ttft_ms, args.model) == (0, 20.0, "m")


@pytest.mark.parametrize(
    "argv",
    [
        ("agent", "--label", "no-equals-sign"),
        ("agent", "fault", "gpu-1", "meteor"),
        ("agent", "fault", "gpu-1", "throttle", "slow"),
        ("workload", "echo"),  # --port is required
    ],
)
def test_bad_arguments_exit_2(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit) as caught:
        parse(*argv)
    assert caught.value.code == 2


async def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str]]:
    args = parse(*argv)
    code: int = await args.handler(args)
    return code, capsys.readouterr().err.strip().splitlines()


async def test_agent_without_gpus_exits_2_with_the_clear_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from nodeagent.gpu import NoGpuError, NvmlProbe

    try:
        probe = await NvmlProbe.open()
    except NoGpuError:
        pass
    else:
        await probe.close()
        pytest.skip("this machine has an NVIDIA GPU")
    code, err = await run(capsys, "agent", "--node-id", "gpu-1", "--nats", "nats://127.0.0.1:1")
    assert code == 2
    (line,) = err
    assert line.startswith("gpumesh: error: no NVIDIA GPU found (NVML: ")
    assert line.endswith("declare fake GPUs with --fake-gpus MODEL:VRAM:COUNT for testing")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("agent",), "agent needs --node-id"),
        (("agent", "--node-id", "a.b"), "invalid node id 'a.b'"),
        (("agent", "--node-id", "n1", "--fake-gpus", "A100:lots:1"), "VRAM 'lots'"),
        (("agent", "--node-id", "n1", "--heartbeat-interval", "0"), "heartbeat interval"),
        (("agent", "fault", "a.b", "clear"), "invalid node id"),
    ],
)
async def test_agent_usage_errors_exit_2_with_one_line(
    capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str
) -> None:
    code, err = await run(capsys, *argv)
    assert code == 2
    (line,) = err
    assert line.startswith("gpumesh: error: ") and message in line


async def test_unreachable_nats_is_one_line_and_exit_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    pytest.importorskip("wire.nats_bus")
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    common = ("--data-dir", str(tmp_path))
    agent = ("agent", "--node-id", "n1", "--fake-gpus", "A100:80GiB:1", "--nats", url)
    code, err = await run(capsys, *common, *agent)
    assert code == 1
    (line,) = err
    assert line.startswith(f"gpumesh: error: cannot reach NATS at {url}")
    code, err = await run(capsys, *common, "agent", "fault", "n1", "thermal", "90", "--nats", url)
    assert code == 1
    assert len(err) == 1 and "cannot reach NATS" in err[0]


async def test_the_nats_url_defaults_to_the_local_stacks(tmp_path: Path) -> None:
    pytest.importorskip("wire.stack")
    args = parse("--data-dir", str(tmp_path), "agent", "--node-id", "n1")
    assert cli._nats_url(args) == "nats://127.0.0.1:4222"
    (tmp_path / "nats.url").write_text("nats://127.0.0.1:4999\n")
    assert cli._nats_url(args) == "nats://127.0.0.1:4999"


@pytest.mark.integration
async def test_workload_echo_serves_until_sigterm_then_exits_0() -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.nodeagent.cli_main", "workload", "echo", "--port", str(port),
        stdout=asyncio.subprocess.PIPE, cwd=REPO,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 20)
        assert line.decode().startswith(f"echo: serving model 'echo' on http://127.0.0.1:{port}")
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://127.0.0.1:{port}/health") as response,
        ):
            assert response.status == 200
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
