"""`gpumesh events rebuild --progress`: where the fold stands, on stderr, while it runs; the
summary on stdout is the same as without it."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from gpumesh.cli import main
from projections.cli import Progress

EVENTS = 3000


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_progress_goes_to_stderr_and_leaves_the_json_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = str(tmp_path)
    code, _, _ = run(capsys, "events", "generate", "--data-dir", data, "--events", str(EVENTS),
                     "--nodes", "10", "--json")  # fmt: skip
    assert code == 0

    code, plain, quiet = run(capsys, "--data-dir", data, "events", "rebuild", "--json")
    assert code == 0 and "rebuild:" not in quiet  # stderr is not a terminal here: no progress
    code, out, err = run(capsys, "--data-dir", data, "events", "rebuild", "--json", "--progress")
    assert code == 0
    lines = [line for line in err.splitlines() if line.startswith("rebuild: ")]
    assert lines, err
    assert lines[-1].startswith(f"rebuild: {EVENTS:,}/{EVENTS:,} events (100%)"), lines
    assert "events/s" in lines[-1] and "done in" in lines[-1]
    assert "\r" not in err  # not a terminal: whole lines, no redrawing

    # stdout holds the one JSON summary, as without --progress (the timings aside).
    summary, before = json.loads(out), json.loads(plain)
    timed = {"seconds", "events_per_second", "peak_rss_mib"}
    assert summary.keys() == before.keys()
    assert {k: v for k, v in summary.items() if k not in timed} == {
        k: v for k, v in before.items() if k not in timed
    }

    # Without --json the text summary follows, as today.
    code, out, err = run(capsys, "--data-dir", data, "events", "rebuild", "--progress")
    assert code == 0 and out.startswith("rebuilt the log to position")
    assert "rebuild: " in err


def test_on_a_terminal_one_line_is_redrawn_in_place() -> None:
    stream = io.StringIO()
    progress = Progress(1000, stream, tty=True)
    progress.show(250)
    progress.end(1000)
    text = stream.getvalue()
    assert text.startswith("\rrebuild: 250/1,000 events (25%), ") and "ETA" in text
    assert "\rrebuild: 1,000/1,000 events (100%)" in text and text.endswith("\n")
    assert text.count("\n") == 1
