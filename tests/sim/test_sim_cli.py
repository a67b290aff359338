"""`gpumesh sim run|fuzz|replay`: the seed and commit are printed, a run is byte-identical in
another process whatever its PYTHONHASHSEED, a record replays byte for byte (and a tampered one
does not), and fuzzing finds an injected bug, stops there, shrinks its fault schedule and prints
the replay command. Short scenarios written to tmp_path keep each run to a fraction of a second.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import sim.cli
from gpumesh.cli import main
from sim.run import run_scenario
from sim.scenario import load
from tests.sim.planted_bugs import plant_stacking_bug, remove_planted_bugs

REPO = Path(__file__).resolve().parents[2]

QUICK = """
name = "quick"
duration_s = 40
settle_s = 60

[fleet]
nodes = 4
gpus = "RTX4090:24GiB:2"
regions = ["eu-west", "us-east"]

[[clusters]]
name = "llama"
replicas = 2
at_s = 2  # once every node has registered: at 0 the first to register could take both

[traffic]
rate_per_s = 3

[[faults]]
at_s = 8
kind = "partition"
nodes = "1"
duration_s = 12

[[faults]]
at_s = 15
kind = "thermal"
value = 95
nodes = "1"
duration_s = 10

[[faults]]
at_s = 22
kind = "power_loss"
nodes = "1"
duration_s = 10
"""


@pytest.fixture
def quick(tmp_path: Path) -> Path:
    path = tmp_path / "quick.toml"
    path.write_text(QUICK)
    return path


def _git_commit() -> str:
    done = subprocess.run(
        ["git", "rev-parse", "--short=12", "HEAD"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def _subprocess(args: list[str], hash_seed: str) -> subprocess.CompletedProcess[bytes]:
    env = {**os.environ, "PYTHONHASHSEED": hash_seed}
    return subprocess.run(
        [sys.executable, "-m", "gpumesh", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        timeout=120,
        check=False,
    )


# -- determinism across processes -----------------------------------------------------------


def test_a_seed_gives_byte_identical_output_and_events_under_different_hash_seeds(
    quick: Path, tmp_path: Path
) -> None:
    runs = {}
    for hash_seed in ("1", "3"):
        events = tmp_path / f"events-{hash_seed}.jsonl"
        args = ["sim", "run", str(quick), "--seed", "5", "--json", "--events-out", str(events)]
        done = _subprocess(args, hash_seed)
        assert done.returncode == 0, done.stderr.decode()
        runs[hash_seed] = (done.stdout, events.read_bytes())
    (out_1, events_1), (out_3, events_3) = runs["1"], runs["3"]
    assert out_1 == out_3
    assert events_1 == events_3
    result = json.loads(out_1)
    assert result["seed"] == 5 and result["commit"] == _git_commit()
    assert result["violations"] == [] and result["events"] == len(events_1.splitlines())
    assert result["detection"], "the faults must have happened and been seen"
    # This process (another hash seed again) computes the same run; another seed does not.
    here, _ = run_scenario(load(quick), 5)
    assert here.digest == result["digest"] and here.timeline == result["timeline"]
    other, _ = run_scenario(load(quick), 6)
    assert other.digest != result["digest"]
    assert other.timeline != result["timeline"]  # the faults hit other nodes


# -- sim run ----------------------------------------------------------------------------------


def test_sim_run_prints_its_seed_and_the_git_commit(
    quick: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "run", str(quick), "--seed", "7"]) == 0
    out, err = capsys.readouterr()
    commit = _git_commit()
    assert f"seed 7, commit {commit}" in err
    assert out.splitlines()[0] == f"scenario quick  seed 7  commit {commit}"
    assert "invariant violations: none" in out


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('duration_s = 10\n[[faults]]\nat_s = 1\nkind = "meteor"\n', "faults[0].kind: must be"),
        ("name = \n", "not valid TOML"),
    ],
)
def test_a_bad_scenario_file_is_one_error_line_and_exit_1(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, message: str
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    assert main(["sim", "run", str(bad)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("gpumesh: error: ") and err.count("\n") == 1, err
    assert message in err and str(bad) in err


def test_an_unknown_scenario_name_lists_the_shipped_ones(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["sim", "fuzz", "no-such-scenario", "--seeds", "1"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("gpumesh: error: no scenario 'no-such-scenario'") and "partition-heal" in err
    )


# -- record and replay ------------------------------------------------------------------------


def test_a_record_replays_byte_for_byte_and_a_tampered_one_is_different(
    quick: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = tmp_path / "run.json"
    assert main(["sim", "run", str(quick), "--seed", "3", "--record", str(record)]) == 0
    assert f"replay: gpumesh sim replay {record}" in capsys.readouterr().out
    saved = json.loads(record.read_text())
    assert saved["seed"] == 3 and saved["commit"] == _git_commit()

    assert main(["sim", "replay", str(record)]) == 0
    assert "identical, byte for byte" in capsys.readouterr().out

    saved["result"]["digest"] = "0" * 64
    record.write_text(json.dumps(saved))
    assert main(["sim", "replay", str(record)]) == 1
    assert "DIFFERENT from the record" in capsys.readouterr().out

    record.write_text("{}")
    assert main(["sim", "replay", str(record)]) == 1
    assert "not a run record" in capsys.readouterr().err


# -- fuzz -------------------------------------------------------------------------------------


def test_fuzz_finds_the_injected_bug_stops_shrinks_and_prints_the_replay_command(
    quick: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler bug stacks replicas from the first deploy, so no fault is needed: the
    shrunk schedule must be empty, and the record must replay identically (bug and all)."""
    plant_stacking_bug(monkeypatch)
    seeds_run: list[int] = []
    real = sim.cli.execute

    def spy(name: str, seed: int, faults: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        if faults is None:
            seeds_run.append(seed)
        return real(name, seed, faults)

    monkeypatch.setattr(sim.cli, "execute", spy)
    record = tmp_path / "failing.json"
    args = ["sim", "fuzz", str(quick), "--seeds", "5", "--jobs", "0", "--record", str(record)]
    assert main(args) == 1
    out = capsys.readouterr().out.splitlines()
    assert seeds_run == [1]  # it stops at the first violation
    assert out[0].startswith("seed 1: spread at t=")
    assert out[1] == "shrunk from 3 to 0 fault(s):"
    assert f"replay: gpumesh sim replay {record}" in out
    assert f"full run: gpumesh sim run {quick} --seed 1" in out
    saved = json.loads(record.read_text())
    assert saved["result"]["faults"] == [] and saved["result"]["violations"]

    assert main(["sim", "replay", str(record)]) == 0  # the failing run, identically
    assert "identical, byte for byte" in capsys.readouterr().out
    # Fixed code is a different run: replay tells.
    remove_planted_bugs(monkeypatch)
    assert main(["sim", "replay", str(record)]) == 1
    assert "DIFFERENT from the record" in capsys.readouterr().out


def test_shrinking_keeps_exactly_the_faults_the_violation_needs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Delta debugging over the fault list: a violation that needs faults b and d together
    (and a red herring that fails another invariant) shrinks to [b, d]."""
    faults = [{"at_s": float(i), "kind": kind} for i, kind in enumerate("abcde")]
    runs: list[list[str]] = []

    def fake(name: str, seed: int, trial: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        kinds = [f["kind"] for f in trial or []]
        runs.append(kinds)
        violations = []
        if "b" in kinds and "d" in kinds:
            violations.append({"invariant": "spread"})
        if kinds == ["b"]:
            violations.append({"invariant": "liveness"})
        return {"violations": violations}

    monkeypatch.setattr(sim.cli, "execute", fake)
    shrunk = sim.cli._shrink("quick.toml", 1, faults, "spread")
    assert [f["kind"] for f in shrunk] == ["b", "d"]
    assert ["b"] in runs  # tried, but it fails something else: not the same bug


def test_fuzz_reruns_a_share_of_passing_seeds_and_reports_a_difference(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: dict[int, int] = {}

    def drifting(name: str, seed: int, faults: Any = None) -> dict[str, Any]:
        calls[seed] = calls.get(seed, 0) + 1
        drift = calls[seed] if seed == 21 else 0  # seed 21 differs on its second run
        return {"violations": [], "digest": f"{seed}:{drift}"}

    monkeypatch.setattr(sim.cli, "execute", drifting)
    failing, checked, mismatched = sim.cli._fuzz("quick.toml", list(range(1, 41)), 0)
    assert failing is None and checked == 40
    again = sorted(seed for seed, n in calls.items() if n == 2)
    assert again == [1, 21]  # 5% of 40 passing seeds, spread over the range
    assert mismatched == [21]


def test_fuzz_over_worker_processes_passes_a_clean_scenario(
    quick: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["sim", "fuzz", str(quick), "--seeds", "2", "--jobs", "2"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == "2 seeds passed (0 not run); no violation"
    assert "NONDETERMINISM" not in captured.err


def test_fuzz_progress_counts_seeds_and_violations_and_is_quiet_unless_asked(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], quick: Path
) -> None:
    def fake(name: str, seed: int, faults: Any = None) -> dict[str, Any]:
        return {"violations": [{"invariant": "spread"}] if seed == 3 else [], "digest": ""}

    monkeypatch.setattr(sim.cli, "execute", fake)
    progress = sim.cli.FuzzProgress(5, io.StringIO(), tty=False)
    failing, checked, _ = sim.cli._fuzz("quick.toml", [1, 2, 3, 4, 5], 0, progress)
    assert failing is not None and failing[0] == 3 and checked == 3
    assert (progress.done, progress.violations) == (3, 1)
    progress.end()
    last = progress.stream.getvalue().splitlines()[-1]
    assert re.fullmatch(r"fuzz: 3/5 seeds, [\d.]+ seeds/s, 1 violation\(s\), [\d.]+ s", last), last

    # Not a terminal and no --progress: nothing but the usual lines.
    assert main(["sim", "fuzz", str(quick), "--seeds", "2", "--jobs", "0"]) == 0
    assert "fuzz: " not in capsys.readouterr().err.replace("gpumesh sim fuzz: ", "")
    assert main(["sim", "fuzz", str(quick), "--seeds", "2", "--jobs", "0", "--progress"]) == 0
    assert "fuzz: 2/2 seeds, " in capsys.readouterr().err
