"""The `gpumesh` command as a user runs it: real files, real subprocess where it matters."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gpumesh.cli import build_parser, main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_generate_rebuild_tail(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = str(tmp_path)
    code, out, _ = run(
        capsys,
        "events",
        "generate",
        "--data-dir",
        data,
        "--events",
        "3000",
        "--nodes",
        "10",
        "--json",
    )
    assert code == 0
    assert json.loads(out)["events"] == 3000

    code, out, _ = run(capsys, "--data-dir", data, "events", "rebuild", "--json")
    assert code == 0
    summary = json.loads(out)
    assert summary["events"] == 3000 and summary["position"] == 3000
    assert summary["nodes"] == 10 and summary["clusters"] == 3
    assert summary["routes"] == 9  # 3 clusters x 3 ready replicas
    assert summary["undecodable_positions"] == []
    with sqlite3.connect(tmp_path / "projections.db") as db:
        assert db.execute("SELECT position FROM checkpoints").fetchone() == (3000,)
        assert db.execute("SELECT count(*) FROM nodes").fetchone() == (10,)

    # The default rebuild skips superseded heartbeats; --full decodes all: the same state.
    code, out, _ = run(capsys, "--data-dir", data, "events", "rebuild", "--json", "--full")
    full = json.loads(out)
    assert full["decoded"] == 3000 and summary["decoded"] < 3000
    same = ("position", "nodes", "clusters", "replicas", "routes")
    assert {k: full[k] for k in same} == {k: summary[k] for k in same}

    code, out, _ = run(capsys, "events", "tail", "--data-dir", data, "--limit", "5", "--json")
    lines = [json.loads(line) for line in out.splitlines()]
    assert [e["position"] for e in lines] == [2996, 2997, 2998, 2999, 3000]

    code, out, _ = run(
        capsys,
        "events",
        "tail",
        "--data-dir",
        data,
        "--from-position",
        "1",
        "--type",
        "replica.placed",
        "--limit",
        "1000",
    )
    assert code == 0
    placed = out.splitlines()
    assert len(placed) >= 9
    assert all("replica.placed.v1" in line and "epoch=" in line for line in placed)

    code, out, _ = run(
        capsys,
        "events",
        "tail",
        "--data-dir",
        data,
        "--from-position",
        "1",
        "--stream",
        "cluster/cluster-0",
        "--json",
    )
    assert [json.loads(line)["type"] for line in out.splitlines()] == ["cluster.created.v1"]


def test_rebuild_reports_a_corrupt_row_and_keeps_going(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run(capsys, "events", "generate", "--data-dir", str(tmp_path), "--events", "500")[0] == 0
    with sqlite3.connect(tmp_path / "events.db") as db:
        db.execute("UPDATE events SET data = x'7b6e6f7065' WHERE position = 100")
    code, out, err = run(capsys, "events", "rebuild", "--data-dir", str(tmp_path), "--full")
    assert code == 0
    assert "rebuilt the log to position 500" in out
    assert "500 decoded" in out
    assert "1 undecodable events kept raw at positions 100" in err
    code, out, _ = run(
        capsys,
        "events",
        "tail",
        "--data-dir",
        str(tmp_path),
        "--from-position",
        "100",
        "--limit",
        "1",
    )
    assert "UNDECODABLE" in out.splitlines()[0]


def test_missing_log_is_one_clear_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "gpumesh", "events", "tail", "--data-dir", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("gpumesh: error: no event log at ")


def test_every_subcommand_has_help() -> None:
    parser = build_parser()
    for argv in (["events", "tail"], ["events", "rebuild"], ["events", "generate"]):
        sub = parser
        for word in argv:
            actions = [a for a in sub._actions if a.__class__.__name__ == "_SubParsersAction"]
            sub = actions[0].choices[word]  # type: ignore[attr-defined]
        assert sub.description, argv
        assert "--data-dir" in sub.format_help()


def test_compact_keeps_projections(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = str(tmp_path)
    assert run(capsys, "events", "generate", "--data-dir", data, "--events", "2000")[0] == 0
    _, before, _ = run(capsys, "events", "rebuild", "--data-dir", data, "--json")
    # The synthetic history is stamped in 2026-01: everything is older than a day.
    code, out, _ = run(
        capsys, "events", "compact", "--data-dir", data, "--older-than", "1d", "--json"
    )
    assert code == 0
    removed = json.loads(out)["removed"]
    assert removed > 1500
    _, after, _ = run(capsys, "events", "rebuild", "--data-dir", data, "--json")
    keep = ("nodes", "clusters", "replicas", "routes", "position")
    assert {k: json.loads(after)[k] for k in keep} == {k: json.loads(before)[k] for k in keep}
    assert json.loads(after)["decoded"] <= 2000 - removed
    with sqlite3.connect(tmp_path / "projections.db") as db:
        rows = db.execute("SELECT node_id, last_heartbeat_at FROM nodes ORDER BY 1").fetchall()
    assert rows and all(at > 0 for _, at in rows)


def test_bad_duration_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["events", "compact", "--older-than", "soon"])
    assert info.value.code == 2
    assert "not a duration: 'soon'" in capsys.readouterr().err


def test_an_unwritable_read_model_is_one_line_and_spares_the_log(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = str(tmp_path)
    assert run(capsys, "events", "generate", "--data-dir", data, "--events", "300")[0] == 0
    (tmp_path / "projections.db").mkdir()  # sqlite cannot open a directory as its file
    code, out, err = run(capsys, "events", "rebuild", "--data-dir", data)
    assert code == 1 and out == ""
    assert err.startswith("gpumesh: error: read model ") and err.count("\n") == 1
    assert "the event log is untouched" in err
    with sqlite3.connect(tmp_path / "events.db") as db:
        assert db.execute("SELECT count(*) FROM events").fetchone() == (300,)


def test_a_user_error_raised_inside_a_task_group_is_still_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpumesh up` runs in a TaskGroup: an agent that dies before registering (here, a bad
    fake-GPU spec) surfaces wrapped in an ExceptionGroup, and must still read as one line."""
    code, _, err = run(
        capsys, "--data-dir", str(tmp_path), "up", "--nodes", "1", "--fake-gpus", "bogus",
        "--gateway", "127.0.0.1:0",
    )  # fmt: skip
    lines = [line for line in err.splitlines() if line.startswith("gpumesh: error:")]
    assert code == 1
    assert lines == [
        "gpumesh: error: agent node-0 exited with code 2 before registering; "
        f"see {tmp_path / 'logs' / 'agent-node-0.log'}"
    ]
    assert "Traceback" not in err


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("garbage = [\n", "not valid TOML: "),
        (
            'name = "bad"\nreplicas = "three"\ncommand = "x"\n',
            "replicas: Expected `int`, got `str`",
        ),
    ],
)
def test_a_malformed_cluster_spec_is_one_line_naming_the_file_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, expected: str
) -> None:
    spec = tmp_path / "bad.toml"
    spec.write_text(text)
    # The spec is read before any connection: no NATS is needed to be told it is bad.
    code, out, err = run(
        capsys, "cluster", "create", "-f", str(spec), "--nats", "nats://127.0.0.1:1"
    )
    assert code == 1 and out == ""
    assert err == f"gpumesh: error: {spec}: {expected}" + err.split(expected, 1)[1]
    assert err.count(str(spec)) == 1 and err.strip().count("\n") == 0


@pytest.mark.parametrize(
    ("argv", "daemon"),
    [
        (["controller"], True),
        (["gateway"], True),
        (["agent", "--node-id", "n1"], True),
        (["up"], True),
        (["cluster", "list"], False),
        (["events", "tail"], False),
    ],
)
def test_long_running_commands_tune_the_collector(argv: list[str], daemon: bool) -> None:
    """Only the processes that live long and allocate per message get gpumesh.gc_tuning."""
    args = build_parser().parse_args(argv)
    assert getattr(args, "daemon", False) is daemon


def test_tune_collector_sets_the_daemon_thresholds() -> None:
    import gc

    from gpumesh.gc_tuning import DAEMON_THRESHOLD, tune_collector

    before = gc.get_threshold()
    try:
        tune_collector()
        assert gc.get_threshold() == DAEMON_THRESHOLD
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


def _log_with_decisions(path: Path) -> tuple[str, str]:
    """An events.db holding one real placement and one real no-fit, as the scheduler made them;
    returns the placement's `why` and the no-fit's `reason`."""
    import asyncio
    import random

    from actors.scheduler import NoFit, Placement, schedule
    from events import ClusterSpec, ClusterUnschedulable, GpuInfo, GpuRequirement, ReplicaPlaced
    from events.sqlite_store import SqliteEventStore
    from projections.views import NodeView
    from tests.factories import EventMaker

    def node(node_id: str, region: str, **fields: Any) -> NodeView:
        gpus = (GpuInfo(index=0, uuid=f"GPU-{node_id}", model="A100", vram_mib=81920),)
        return NodeView(node_id=node_id, region=region, zone="a", gpus=gpus, **fields)

    nodes = [
        node("gpu-eu-1", "eu-west", price_per_hour=1.0),
        node("gpu-eu-2", "eu-west", price_per_hour=2.0),
        node("gpu-us-1", "us-east", price_per_hour=0.5),
        node("gpu-eu-sick", "eu-west", health="unhealthy", health_reason="ecc"),
    ]
    wanted = ClusterSpec(name="llama", command="c", regions=("eu-west",))
    placed = schedule(nodes, wanted, [], random.Random(1))
    assert isinstance(placed, Placement)
    too_big = ClusterSpec(name="big", command="c", gpu=GpuRequirement(count=2))
    blocked = schedule(nodes, too_big, [], random.Random(1))
    assert isinstance(blocked, NoFit)
    make = EventMaker()

    async def write() -> None:
        store = await SqliteEventStore.open(path)
        try:
            await store.append(
                "replica/llama-0",
                [
                    make(
                        ReplicaPlaced(
                            replica_id="llama-0",
                            cluster="llama",
                            node_id=placed.node_id,
                            gpu_indices=placed.gpu_indices,
                            epoch=1,
                            why=placed.why,
                            candidates=placed.candidates,
                        )
                    )
                ],
                0,
            )
            unschedulable = ClusterUnschedulable(
                name="big", missing=1, reason=blocked.reason, candidates=blocked.candidates
            )
            await store.append("cluster/big", [make(unschedulable)], 0)
        finally:
            await store.close()

    asyncio.run(write())
    return placed.why, blocked.reason


def test_events_tail_explains_placements_and_unschedulable_clusters(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    why, reason = _log_with_decisions(tmp_path / "events.db")
    assert len(why) > 80  # long enough that the old 80-character cut would have hidden part

    code, out, _ = run(capsys, "events", "tail", "--data-dir", str(tmp_path))
    assert code == 0
    lines = out.splitlines()
    placed_at = next(i for i, line in enumerate(lines) if "replica.placed.v1" in line)
    assert f"why={why}" in lines[placed_at]  # the winner's whole explanation
    assert lines[placed_at + 1].split() == [
        "ranked:",
        "gpu-eu-1",
        "(chosen),",
        "gpu-eu-2",
    ]
    assert lines[placed_at + 2].strip() == (
        "rejected: gpu-eu-sick: unhealthy (ecc); gpu-us-1: region us-east not in eu-west"
    )
    blocked_at = next(i for i, line in enumerate(lines) if "cluster.unschedulable.v1" in line)
    assert f"reason={reason}" in lines[blocked_at]
    assert reason == "no node fits big: 1 unhealthy, 3 have < 2 free GPU"
    assert lines[blocked_at + 1].strip() == (
        "rejected: gpu-eu-1: 1 A100 free, needs 2; gpu-eu-2: 1 A100 free, needs 2; "
        "gpu-eu-sick: unhealthy (ecc); gpu-us-1: 1 A100 free, needs 2"
    )
    assert len(lines) == 5  # continuation lines only where there are candidates
    assert all(line.startswith(" " * 11) for line in (lines[1], lines[2], lines[4]))

    code, out, _ = run(capsys, "events", "tail", "--data-dir", str(tmp_path), "--json")
    assert code == 0
    placed_json, blocked_json = (json.loads(line) for line in out.splitlines())
    assert placed_json["type"] == "replica.placed.v1"
    assert placed_json["payload"]["why"] == why
    assert placed_json["payload"]["candidates"] == [
        {"node_id": "gpu-eu-1", "score": 2.0},
        {"node_id": "gpu-eu-2", "score": 1.0},
        {"node_id": "gpu-eu-sick", "rejected": "unhealthy (ecc)"},
        {"node_id": "gpu-us-1", "rejected": "region us-east not in eu-west"},
    ]
    assert blocked_json["payload"]["reason"] == reason
    assert {c["node_id"]: c["rejected"] for c in blocked_json["payload"]["candidates"]} == {
        "gpu-eu-1": "1 A100 free, needs 2",
        "gpu-eu-2": "1 A100 free, needs 2",
        "gpu-eu-sick": "unhealthy (ecc)",
        "gpu-us-1": "1 A100 free, needs 2",
    }


def test_a_long_candidate_list_is_cut_with_a_pointer_to_json() -> None:
    from events import Candidate
    from events.cli import MAX_CANDIDATES_SHOWN, candidate_lines

    many = tuple(Candidate(node_id=f"n{i:02d}", rejected="drained") for i in range(20))
    (line,) = candidate_lines(many)
    assert line.count(": drained") == MAX_CANDIDATES_SHOWN
    assert line.endswith(f"; ... {20 - MAX_CANDIDATES_SHOWN} more (--json lists all recorded)")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--weight", "0"], "--weight: must be 1..99 (percent of the requests), got 0"),
        (["--weight", "100"], "--weight: must be 1..99 (percent of the requests), got 100"),
    ],
)
def test_a_canary_weight_outside_its_range_is_one_line_before_any_connection(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], expected: str
) -> None:
    spec = tmp_path / "llama.toml"
    spec.write_text('name = "llama"\ncommand = "serve {port}"\n')
    code, out, err = run(
        capsys,
        "cluster", "canary", "llama", "-f", str(spec), *argv, "--nats", "nats://127.0.0.1:1",
    )  # fmt: skip
    assert code == 1 and out == ""
    assert err.strip() == f"gpumesh: error: {expected}"
