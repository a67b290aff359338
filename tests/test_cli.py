"""The `gpumesh` command as a user runs it: real files, real subprocess where it matters."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

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
