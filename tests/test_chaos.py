"""`gpumesh chaos` without a stack: command lines, the victims' draw, the plan, the keeper, and
a run against a stand-in bus and gateway whose tasks crash.
The run against a real stack is tests/integration/test_chaos.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from events.contract import subjects
from events.contract.messages import ApiReply
from gpumesh.chaos import kinds, procfs, run as chaos_run
from gpumesh.chaos.cli import render_real
from gpumesh.chaos.gateway import failure_kind
from gpumesh.chaos.plan import plan
from gpumesh.chaos.procfs import Found, Proc
from gpumesh.chaos.stack import Stack
from gpumesh.cli import main
from runtime.env import Msg
from sim.run import RunResult, run_scenario
from sim.scenario import FAULT_KINDS, from_mapping
from wire.nats_bus import NatsBus

AGENT = (
    "/venv/bin/python", "-m", "gpumesh", "agent", "--nats", "nats://127.0.0.1:4222",
    "--node-id", "node-3", "--fake-gpus", "RTX4090:24GiB:2", "--data-dir", "/tmp/d",
)  # fmt: skip


def test_command_lines_are_read_as_the_cli_parses_them() -> None:
    assert procfs.gpumesh_args(AGENT) == list(AGENT[3:])
    assert procfs.gpumesh_args(("/venv/bin/gpumesh", "--data-dir", "d", "up")) == [
        "--data-dir",
        "d",
        "up",
    ]
    assert procfs.gpumesh_args(("python", "-m", "gpumesh.keeper", "1")) is None
    assert procfs.gpumesh_args(("nats-server", "-js")) is None
    assert procfs.subcommand(["--data-dir", "agent", "controller"]) == "controller"
    assert procfs.subcommand(["--log-format=json", "agent", "fault"]) == "agent"
    args = list(AGENT[3:])
    assert procfs.flag(args, "--node-id") == "node-3"
    assert procfs.flag(["--node-id=node-9"], "--node-id") == "node-9"
    assert procfs.flag(args, "--region") is None
    joined = procfs.with_flag(AGENT, "--node-id", "node-7")
    assert procfs.flag(joined, "--node-id") == "node-7" and len(joined) == len(AGENT)
    proc = Proc(pid=1, argv=AGENT, cwd="/")
    assert procfs.data_dir_of(proc) == Path("/tmp/d").resolve()
    assert procfs.ours(proc, Path("/elsewhere"), "nats://127.0.0.1:4222/")
    assert not procfs.ours(proc, Path("/tmp/d"), "nats://127.0.0.1:9999")


def test_failed_requests_are_named_as_the_simulator_names_them() -> None:
    def error(code: str) -> bytes:
        return json.dumps({"error": {"message": "m", "type": "t", "code": code}}).encode()

    assert failure_kind(503, error("no_ready_replica")) == "NoReadyReplica"
    assert failure_kind(404, error("model_not_found")) == "UnknownCluster"
    assert failure_kind(504, error("first_byte_timeout")) == "AttemptsExhausted"
    assert failure_kind(502, b"not json") == "AttemptsExhausted"
    assert failure_kind(429, error("rate_limited")) == "http_429_rate_limited"
    assert failure_kind(500, b"") == "http_500"


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
            for step in plan(scenario, seed, Found(agents=agents))
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
    steps = plan(scenario, 1, Found(up=up), speed=2.0)
    assert [s["action"] for s in steps] == [
        kinds.IN_UP,
        kinds.NETWORK_ONLY,
        "skipped: no nats-server of this stack on this machine",
    ]
    assert steps[0]["at_s"] == 0.5 and steps[0]["duration_s"] == 2.5
    assert set(kinds.KIND_ACTIONS) == set(FAULT_KINDS)


def test_the_summary_says_wall_seconds() -> None:
    result = RunResult(
        scenario="s", seed=1, duration_s=20.0, events=3, digest="0" * 64,
        availability={}, requests_failed=0, detection={}, replacement={}, violations=[],
        timeline=["    3.000  fault  power_loss node-1"],
    )  # fmt: skip
    text = render_real(result)
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
         procfs.start_time(owner.pid), "--", "sh", "-c", f"echo $$ > {pid_file}; exec sleep 60"],
        start_new_session=True,
    )  # fmt: skip
    try:
        assert keeper.wait(10) == 0  # it detaches at once
        deadline = time.monotonic() + 10
        while not (pid_file.exists() and pid_file.read_text().strip()):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        command = int(pid_file.read_text())
        assert procfs.alive(command)
        owner.kill()
        owner.wait()
        deadline = time.monotonic() + 10
        while procfs.alive(command):
            assert time.monotonic() < deadline, "the keeper did not stop its command"
            time.sleep(0.05)
    finally:
        owner.kill()
        owner.wait()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(keeper.pid, signal.SIGKILL)


# -- a task of the run that crashes fails the run ------------------------------------------------


class QuietStack:
    """The control API of an empty stack: an empty log, and every cluster.create accepted."""

    async def request(
        self, subject: str, data: bytes, *, timeout: float, headers: dict[str, str] | None = None
    ) -> Msg:
        page = {"events": [], "next": 0, "head": 0}
        reply = ApiReply(ok=True, data=page if subject == subjects.api("events.list") else None)
        return Msg(subject=subject, data=msgspec.json.encode(reply))

    async def close(self) -> None:
        return None


class BrokenGateway:
    """A client whose requests hit a bug: what a crashed traffic coroutine looks like."""

    async def check(self) -> None:
        return None

    async def send(self, cluster: str) -> str:
        raise RuntimeError(f"boom in {cluster}")

    async def close(self) -> None:
        return None


LONG = """
name = "crashing"
duration_s = 120
settle_s = 60

[[clusters]]
name = "echo"
replicas = 1

[traffic]
rate_per_s = 50
"""


def test_a_crashed_traffic_task_fails_the_run_with_its_cause(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    async def connect(*args: object, **kwargs: object) -> QuietStack:
        return QuietStack()

    monkeypatch.setattr(NatsBus, "connect", connect)
    monkeypatch.setattr(chaos_run, "GatewayClient", lambda gateway, key: BrokenGateway())
    scenario = tmp_path / "crashing.toml"
    scenario.write_text(LONG)
    here = ["--data-dir", str(tmp_path), "--nats", "nats://127.0.0.1:1"]
    code = main(["chaos", str(scenario), *here, "--json"])
    out, err = capsys.readouterr()
    assert code == 1, err
    result = json.loads(out)
    assert result["crashed"] == [
        {"task": "chaos:traffic:echo", "error": "RuntimeError: boom in echo"}
    ]
    assert result["duration_s"] < 60, "the crash ended the run at once"
    timeline = "\n".join(result["timeline"])
    assert "FAILED chaos:traffic:echo: RuntimeError: boom in echo" in timeline
    assert "liveness not judged: the run failed" in timeline
    assert "Traceback" in err and "boom in echo" in err  # where it was raised, on stderr

    code = main(["chaos", str(scenario), *here])
    out, _ = capsys.readouterr()
    assert code == 1
    assert (
        "run FAILED: 1 of its tasks raised\n    chaos:traffic:echo: RuntimeError: boom in echo"
        in (out)
    )


async def join_breaks(self: Stack, known: object) -> None:
    raise ValueError("no node name left")


def controller_breaks(self: Stack) -> None:
    raise KeyError("controller")


@pytest.mark.parametrize(
    ("fault", "patch", "task", "error"),
    [
        ({"kind": "churn", "period_s": 1}, ("join", join_breaks), "chaos:churn",
         "ValueError: no node name left"),
        ({"kind": "controller_crash"}, ("controller", controller_breaks), "chaos:faults",
         "KeyError: 'controller'"),
    ],
)  # fmt: skip
async def test_a_crashed_fault_fails_the_run_with_its_cause(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    fault: dict[str, object],
    patch: tuple[str, object],
    task: str,
    error: str,
) -> None:
    monkeypatch.setattr(Stack, *patch)
    scenario = from_mapping(
        {"name": "f", "duration_s": 60, "settle_s": 60, "faults": [{"at_s": 0.5, **fault}]}
    )
    run = chaos_run.ChaosRun(
        scenario, 1, bus=QuietStack(), nats_url="nats://127.0.0.1:1", data_dir=tmp_path,
        gateway="http://gateway.invalid", client=BrokenGateway(),
    )  # fmt: skip
    await run.prepare()
    await asyncio.wait_for(run.run(), timeout=30)
    result = run.result()
    assert not result.ok
    assert result.crashed == [{"task": task, "error": error}]
    assert result.violations == []  # the run failed; the stack broke no invariant


# -- gpumesh up --ha ------------------------------------------------------------------------------

HA_FAULTS = [
    {"at_s": 1, "kind": "leader_crash"},
    {"at_s": 2, "kind": "leader_pause", "duration_s": 5},
    {"at_s": 3, "kind": "nats_server_loss"},
    {"at_s": 4, "kind": "controller_partition", "duration_s": 5},
]


def _up_ha_json(data_dir: Path, nats: str) -> None:
    rows = [
        {"role": "nats-server", "name": f"nats-{i}", "pid": 100 + i, "port": 4222 + i}
        for i in range(3)
    ] + [
        {"role": "controller", "name": f"ctl-{i}", "pid": 200 + i, "port": None,
         "relays": {f"nats-{j}": 5000 + 10 * i + j for j in range(3)}}
        for i in range(2)
    ] + [
        {"role": "gateway", "name": "gw-0", "pid": 300, "port": 8099},
    ]  # fmt: skip
    text = {
        "nats": nats,
        "gateway": "http://127.0.0.1:8099",
        "control": str(data_dir / "up-ha.sock"),
        "processes": rows,
    }
    (data_dir / "up-ha.json").write_text(json.dumps(text))


def test_up_ha_is_found_from_its_processes_file(tmp_path: Path) -> None:
    from gpumesh.chaos.ha import read_layout

    urls = "tls://127.0.0.1:4222,tls://127.0.0.1:4223,tls://127.0.0.1:4224"
    assert read_layout(tmp_path) is None
    _up_ha_json(tmp_path, urls)
    layout = read_layout(tmp_path, ",".join(reversed(urls.split(","))))  # any order
    assert layout is not None and layout.gateway == "http://127.0.0.1:8099"
    assert [p.name for p in layout.named("controller")] == ["ctl-0", "ctl-1"]
    assert [p.port for p in layout.named("nats-server")] == [4222, 4223, 4224]
    assert read_layout(tmp_path, "nats://127.0.0.1:4222") is None  # another stack's NATS

    scenario = from_mapping({"name": "ha", "duration_s": 60, "faults": HA_FAULTS})
    steps = plan(scenario, 1, Found(), ha=layout)
    assert "ctl-0 pid 200, ctl-1 pid 201" in steps[0]["action"]
    assert steps[1]["action"].startswith("gpumesh up --ha only: SIGSTOP")
    assert "nats-0 pid 100" in steps[2]["action"]
    assert layout.named("controller")[1].relays == (("nats-0", 5010), ("nats-1", 5011),
                                                    ("nats-2", 5012))  # fmt: skip
    assert layout.control == str(tmp_path / "up-ha.sock")
    assert steps[3]["action"].startswith("gpumesh up --ha only: cut the controller")
    assert "ctl-1 pid 201 through :5010, :5011, :5012" in steps[3]["action"]
    assert [s["action"] for s in plan(scenario, 1, Found())] == [kinds.NEEDS_HA] * 3 + [
        kinds.CANNOT_PARTITION
    ]


def test_a_failover_is_over_at_the_leases_next_term_or_renewal() -> None:
    from gpumesh.chaos.ha import Failover, Lease

    before = Lease("ctl-0", term=5, revision=40)
    crash = Failover("leader_crash", 10.0, "controller ctl-0 (pid 1)", before, False)
    assert not crash.seen(None, 11.0)  # nobody leads: the key expired
    assert not crash.seen(Lease("ctl-0", 5, 41), 11.5)  # a renewal that raced the kill
    assert crash.seen(Lease("ctl-1", 42, 42), 12.5)
    data = crash.to_json()
    assert data["leads_again_s"] == 2.5 and data["new_leader"] and data["term_after"] == 42

    pause = Failover("leader_pause", 10.0, "controller ctl-0 (pid 1)", before, False)
    assert not pause.seen(Lease("ctl-0", 5, 41), 11.0)
    pause.thawed = True  # continued within the lease: it renews, and keeps leading
    assert pause.seen(Lease("ctl-0", 5, 42), 12.0) and "kept its lease" in pause.outcome
    assert not pause.to_json()["new_leader"]

    loss = Failover("nats_server_loss", 10.0, "nats-server nats-1 (pid 2)", before, True)
    assert not loss.seen(Lease("ctl-0", 5, 40), 10.5)
    assert loss.seen(Lease("ctl-0", 5, 41), 11.0) and "renewed" in loss.outcome


async def test_the_ha_faults_are_skipped_on_a_stack_without_up_ha(tmp_path: Path) -> None:
    scenario = from_mapping({"name": "ha", "duration_s": 6, "settle_s": 0, "faults": HA_FAULTS})
    run = chaos_run.ChaosRun(
        scenario, 1, bus=QuietStack(), nats_url="nats://127.0.0.1:1", data_dir=tmp_path,
        gateway="http://gateway.invalid", client=BrokenGateway(), speed=3.0,
    )  # fmt: skip
    await run.prepare()
    await asyncio.wait_for(run.run(), timeout=30)
    result = run.result()
    assert result.ok, result.crashed
    skipped = [line.split("skip   ", 1)[1] for line in result.timeline if "skip   " in line]
    assert skipped == [
        f"leader_crash: {kinds.NEEDS_HA}",
        f"leader_pause: {kinds.NEEDS_HA}",
        f"nats_server_loss: {kinds.NEEDS_HA}",
        f"controller_partition: {kinds.CANNOT_PARTITION}",
    ]
    assert result.failovers == []
    assert (
        "invariants checked: contiguous_versions, spread, placement_fits, "
        "no_partial_group_serving, no_gpu_held_twice, liveness, group_serving_or_unschedulable"
    ) in (render_real(result))


def test_the_report_says_each_failover() -> None:
    from gpumesh.chaos.cli import render_failovers

    text = render_failovers(
        [
            {
                "at_s": 3.0, "kind": "leader_crash", "target": "controller ctl-0 (pid 9)",
                "leads_again_s": 2.5, "outcome": "ctl-1 leads (term 12)",
                "requests": {"sent": 40, "failed": 2, "failed_before_first_byte": 2,
                             "failed_by_kind": {"AttemptsExhausted": 2},
                             "failed_sent_s": [2.1, 2.4]},
            }
        ]
    )  # fmt: skip
    assert (
        "t=3.000 leader_crash     controller ctl-0 (pid 9): leads again after 2.500 s: ctl-1 "
        "leads (term 12); requests 40 sent, 2 failed (2 before the first byte): "
        "AttemptsExhausted 2; sent 2.1-2.4 s after the fault"
    ) in text


async def test_ups_control_socket_holds_a_cut_while_its_connection_is_open(
    tmp_path: Path,
) -> None:
    """gpumesh/up_ha.py's ControllerLinks and chaos's Cut, with relays to a stand-in server:
    a cut holds one controller's relays (and only its) until healed, or until the connection
    that asked closes; a name it does not know is refused."""
    from types import SimpleNamespace

    from gpumesh.chaos.errors import ChaosError
    from gpumesh.chaos.ha import Cut
    from gpumesh.up_ha import ControllerLinks
    from tests.integration.up_process import until

    async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(1024):
            writer.write(data)
        writer.close()

    target = await asyncio.start_server(echo, "127.0.0.1", 0)
    port = int(target.sockets[0].getsockname()[1])
    servers = [
        SimpleNamespace(name=f"nats-{i}", port=port, server=SimpleNamespace(url=f"tls://x:{i}"))
        for i in range(3)
    ]
    links = ControllerLinks(tmp_path, ("ctl-0", "ctl-1"), servers)
    await links.listen()
    ports = links.ports("ctl-0")
    assert links.urls("ctl-0") == ",".join(f"tls://127.0.0.1:{p}" for p in ports.values())
    async with asyncio.TaskGroup() as tasks:
        serving = tasks.create_task(links.serve())
        await links.serving.wait()
        assert links.control == str(tmp_path / "up-ha.sock")
        reader, writer = await asyncio.open_connection("127.0.0.1", ports["nats-1"])

        cut = await Cut.open(links.control, "ctl-0")
        assert cut.connections == 1 and links.is_cut("ctl-0") and not links.is_cut("ctl-1")
        assert all(relay.is_cut for relay in links.relays["ctl-0"].values())
        assert not any(relay.is_cut for relay in links.relays["ctl-1"].values())
        writer.write(b"held")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(reader.readexactly(4), timeout=0.2)
        await cut.heal()
        assert not links.is_cut("ctl-0")
        assert await asyncio.wait_for(reader.readexactly(4), timeout=5) == b"held"

        with pytest.raises(ChaosError, match="NAME one of ctl-0, ctl-1"):
            await Cut.open(links.control, "ctl-9")
        dropped = await Cut.open(links.control, "ctl-1")
        assert links.is_cut("ctl-1")
        dropped.drop()  # a chaos that died: `up` heals the cut on its own

        async def healed() -> bool:
            return not links.is_cut("ctl-1")

        await until(healed, 5, "the cut healed once its connection closed")
        writer.close()
        serving.cancel()
    target.close()
    await target.wait_closed()
    assert not (tmp_path / "up-ha.sock").exists()


def test_a_stage_fault_targets_a_ready_pipelines_worker_node() -> None:
    from events import StagePlacement
    from gpumesh.chaos.stack import stage_holders
    from projections.views import ReplicaView

    def group(rid: str, status: str, *nodes: str) -> ReplicaView:
        stages = tuple(StagePlacement(rank=i, node_id=n) for i, n in enumerate(nodes))
        return ReplicaView(
            replica_id=rid, cluster="big", node_id=nodes[0], epoch=1, status=status, stages=stages
        )

    replicas = [
        group("big-0", "ready", "n0", "n3", "n1"),
        group("big-1", "placed", "n2", "n4"),  # not serving yet: not a target
        ReplicaView(replica_id="small-0", cluster="small", node_id="n5", epoch=1, status="ready"),
    ]
    assert stage_holders(replicas) == ["n1", "n3"]  # workers only, never the head
    scenario = from_mapping(
        {
            "name": "stage",
            "duration_s": 60,
            "faults": [{"at_s": 1, "kind": "power_loss", "nodes": "stage"}],
        }
    )
    agents = {f"n{i}": Proc(pid=100 + i, argv=("gpumesh", "agent")) for i in range(3)}
    (step,) = plan(scenario, 1, Found(agents=agents), speed=1.0)
    assert step["victims"] == ["a worker stage's node"]
