"""docs/img/tables.py: docs/performance.md's heartbeat, cold-start and gateway tables, copied
into docs/img/tables.json, drawn as PNGs; and the figures in the JSON are the table's."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PNG = b"\x89PNG\r\n\x1a\n"


def test_tables_py_draws_the_three_tables(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    spec = importlib.util.spec_from_file_location("doc_tables", ROOT / "docs/img/tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(sys, "argv", ["tables.py", "--out", str(tmp_path)])
    assert module.main() == 0
    for name in ("heartbeats", "coldstart", "gateway"):
        data = (tmp_path / f"perf-{name}.png").read_bytes()
        assert data.startswith(PNG) and len(data) > 15_000
    assert capsys.readouterr().out.count("wrote ") == 3


def test_the_copied_figures_are_in_the_performance_tables() -> None:
    doc = (ROOT / "docs/performance.md").read_text(encoding="utf-8")
    figures = json.loads((ROOT / "docs/img/tables.json").read_text(encoding="utf-8"))
    for run in figures["heartbeats"]["runs"]:
        assert " / ".join(f"{r:,}" for r in run["recorded"]) in doc
    for phases in figures["coldstart"]["runs_ms"]:
        assert f"| {phases[0]} ms | {phases[1]} ms | {phases[2]} ms | {sum(phases)} ms |" in doc
    for t in figures["gateway"]["targets"]:
        row = rf"\| {re.escape(t['name'])}[^|]* \| {t['req_per_s']:,} \|"
        assert re.search(row, doc.replace("**", "")), row
