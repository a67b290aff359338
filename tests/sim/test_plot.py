"""`gpumesh sim run --plot FILE.png` (sim/plot.py): a PNG of the run's requests per second and
its detection and replacement times per failure class, drawn from the run itself; without
matplotlib, one line saying how to get it."""

from __future__ import annotations

import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

import sim.plot
from gpumesh.cli import main

PNG = b"\x89PNG\r\n\x1a\n"


def test_sim_run_plot_writes_a_png_of_the_runs_own_samples(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("matplotlib")
    drawn: dict[str, Mapping[str, Sequence[float]]] = {}
    real = sim.plot.distributions

    def spy(ax: Any, groups: Mapping[str, Sequence[float]], **kw: Any) -> None:
        drawn[kw["title"].split(":")[0]] = groups
        real(ax, groups, **kw)

    monkeypatch.setattr(sim.plot, "distributions", spy)
    out = tmp_path / "run.png"
    assert main(["sim", "run", "power-outage", "--seed", "7", "--plot", str(out), "--json"]) == 0
    stdout, err = capsys.readouterr()
    assert f"plot in {out}" in err
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 20_000
    # The dots are the run's samples: as many per failure class as the summary counts.
    import json

    result = json.loads(stdout)  # --json's stdout is the result alone (no matplotlib log line)
    for what in ("detection", "replacement"):
        assert {k: len(v) for k, v in drawn[what].items()} == {
            k: t["count"] for k, t in result[what].items()
        }
        assert result[what]["power_loss"]["count"] == 3


def test_sim_run_plot_without_matplotlib_is_one_line_with_the_install_hint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    out = tmp_path / "run.png"
    assert main(["sim", "run", "power-outage", "--seed", "7", "--plot", str(out)]) == 1
    stdout, err = capsys.readouterr()
    assert stdout == "" and err.count("\n") == 1, err  # nothing run, nothing else said
    assert err.startswith("gpumesh: error: ") and "pip install 'gpumesh[plot]'" in err
    assert not out.exists()
