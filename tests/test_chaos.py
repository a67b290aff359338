"""`gpumesh chaos` without a stack: command lines, the victims' draw, the plan and the keeper.
The run against a real stack is tests/integration/test_chaos.py."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpumesh import chaos
from gpumesh.chaos import Found, Proc
from gpumesh.cli import main
from sim.run import RunResult, run_scenario
from sim.scenario import FAULT_KINDS, from_mapping

AGENT = (
    "/venv/bin/python", "-m", "gpumesh", "agent", "--nats", "nats://127.0.0.1:4222",
    "--node-id", "node-3", "--fake-gpus", "RTX4090:24GiB:2", "--data-dir", "/tmp/d",
)  # fmt: skip


def test_command_lines_are_read_as_the_cli_parses_them() -> None:
    assert chaos.gpumesh_args(AGENT) == list(AGENT[3:])
    assert chaos.gpumesh_args(("/venv/bin/gpumesh", "--data-dir", "d", "up")) == [
        "--data-dir",
        "d",
        "up",
    ]
    assert chaos.gpumesh_args(("python", "-m", "gpumesh.keeper", "1")) is None
    assert chaos.gpumesh_args(("nats-server", "-js")) is None
    assert chaos.subcommand(["--data-dir", "agent", "controller"]) == "controller"
    assert chaos.subcommand(["--log-format=json", "agent", "fault"]) == "agent"
    args = list(AGENT[3:])
    assert chaos.flag(args, "--node-id") == "node-3"
    assert chaos.flag(["--node-id=node-9"], "--node-id") == "node-9"
    assert chaos.flag(args, "--region") is None
    joined = chaos.with_flag(AGENT, "--node-id", "node-7")
    assert chaos.flag(joined, "--node-id") == "node-7" and len(joined) == len(AGENT)
    proc = Proc(pid=1, argv=AGENT, cwd="/")
    assert chaos.data_dir_of(proc) == Path("/tmp/d").resolve()
    assert chaos._ours(proc, Path("/elsewhere"), "nats://127.0.0.1:4222/")
    assert not chaos._ours(proc, Path("/tmp/d"), "nats://127.0.0.1:9999")


def test_failed_requests_are_named_as_the_simulator_names_them() -> None:
    def error(code: str) -> bytes:
        return json.dumps({"error": {"message": "m", "type": "t", "code": code}}).encode()

    assert chaos.failure_kind(503, error("no_ready_replica")) == "NoReadyReplica"
    assert chaos.failure_kind(404, error("model_not_found")) == "UnknownCluster"
    assert chaos.failure_kind(504, error("first_byte_timeout")) == "AttemptsExhausted"
    assert chaos.failure_kind(502, b"not json") == "AttemptsExhausted"
    assert chaos.failure_kind(429, error("rate_limited")) == "http_429_rate_limited"
    assert chaos.failure_kind(500, b"") == "http_500"


def test_a_seed_picks_the_simulators_victims() -> None:
    scenario = from_mapping(
        {
            "name": "victims",
            "duration_s": 40,
            "settle_s": 5,
            "fleet": {"nodes": 6},
            "faults": [
                {"at_s": 5, "kind": "hang", "nodes": "2", "duration_s": 10},
                {"at_s": 8, "kind": "power_loss", "nodes": "50%", "duration_s": 7},
                {"at_s": 12, "kind": "thermal", "nodes": "1", "value": 95},
                {"at_s": 15, "kind": "power_loss", "nodes": "3", "duration_s": 5},
                {"at_s": 20, "kind": "partition", "nodes": "2"},
                {"at_s": 21, "kind": "slow", "nodes": ["node-5", "node-9"]},
            ],
        }
    )
    agents = {f"node-{i}": Proc(pid=100 + i, argv=AGENT) for i in range(6)}
    for seed in (1, 7, 42):
        result, _ = run_scenario(scenario, seed)
        simulated = [
            (m[1], m[2])
            for line in result.timeline
            if (m := re.search(r"fault  (\w+) (node-\d+)$", line))
        ]
        planned = [
            (step["kind"], victim)
            for step in chaos.plan(scenario, seed, Found(agents=agents))
            for victim in step["victims"]
        ]
        assert planned == simulated, seed


def test_the_plan_says_what_each_kind_does_here() -> None:
    scenario = from_mapping(
        {
            "name": "kinds",
            "duration_s": 60,
            "faults": [
                {"at_s": 1, "kind": "controller_crash", "duration_s": 5},
                {"at_s": 2, "kind": "one_way_partition"},
                {"at_s": 3, "kind": "nats_outage", "duration_s": 5},
            ],
        }
    )
    up = Proc(pid=10, argv=("python", "-m", "gpumesh", "up"))
    steps = chaos.plan(scenario, 1, Found(up=up), speed=2.0)
    assert [s["action"] for s in steps] == [
        chaos.IN_UP,
        chaos.NETWORK_ONLY,
        "skipped: no nats-server of this stack on this machine",
    ]
    assert steps[0]["at_s"] == 0.5 and steps[0]["duration_s"] == 2.5
    assert set(chaos.KIND_ACTIONS) == set(FAULT_KINDS)


def test_the_summary_says_wall_seconds() -> None:
    result = RunResult(
        scenario="s", seed=1, duration_s=20.0, events=3, digest="0" * 64,
        availability={}, requests_failed=0, detection={}, replacement={}, violations=[],
        timeline=["    3.000  fault  power_loss node-1"],
    )  # fmt: skip
    text = chaos.render_real(result)
    assert "timeline (wall seconds since the start)" in text
    assert "summary (20 s on the real stack, 3 events" in text
    assert "virtual" not in text and "simulated" not in text


def test_dry_run_without_a_stack(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    here = ["--data-dir", str(tmp_path), "--nats", "nats://127.0.0.1:1"]
    code = main(["chaos", "power-outage", *here, "--dry-run", "--json"])
    out, _ = capsys.readouterr()
    assert code == 0
    plan = json.loads(out)
    assert plan["processes"]["agents"] == {}
    assert plan["nats"] == "nats://127.0.0.1:1"
    assert [s["kind"] for s in plan["faults"]] == ["power_loss"]
    assert plan["faults"][0]["victims"] == []  # no agent here to draw from
    code = main(["chaos", "power-outage", *here, "--dry-run"])
    out, _ = capsys.readouterr()
    assert code == 0 and "agents:      none" in out and "SIGKILL the agent" in out


@pytest.mark.integration
def test_the_keeper_stops_its_command_when_the_owner_is_gone(tmp_path: Path) -> None:
    owner = subprocess.Popen(["sleep", "60"])
    pid_file = tmp_path / "pid"
    keeper = subprocess.Popen(
        [sys.executable, "-m", "gpumesh.keeper", str(owner.pid),
         chaos.start_time(owner.pid), "--", "sh", "-c", f"echo $$ > {pid_file}; exec sleep 60"],
        start_new_session=True,
    )  # fmt: skip
    try:
        assert keeper.wait(10) == 0  # it detaches at once
        deadline = time.monotonic() + 10
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        command = int(pid_file.read_text())
        assert chaos.alive(command)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while chaos.alive(command):
            assert time.monotonic() < deadline, "the keeper did not stop its command"
            time.sleep(0.05)
    finally:
        owner.kill()
        owner.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(keeper.pid, signal.SIGKILL)
