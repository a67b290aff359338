"""`bench/failover.py --from-json RESULT.json --plot FILE.png`: a saved result drawn, by its
mode (the node kill, --classes, --clients), from small synthetic results of the `--json` shape;
without matplotlib, one line saying how to get it."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import failover

PNG = b"\x89PNG\r\n\x1a\n"


def _node_kill() -> dict[str, Any]:
    runs = [
        {
            "run": i + 1,
            "victim": f"node-{i}",
            "replica": "echo-0",
            "replacement_node": "node-3",
            "detection_s": d,
            "decision_s": 0.008,
            "launch_s": 0.02,
            "workload_start_s": 0.61,
            "replacement_s": d + 0.64,
            "initial_workload_starts_s": [0.8],
        }
        for i, d in enumerate((2.30, 2.55, 2.94))
    ]
    return {
        "mode": "failover",
        "agents": 4,
        "replicas": 3,
        "heartbeat_interval_s": 1.0,
        "offline_after": 3,
        "runs": runs,
        "targets": {"detection_s": 3.0},
    }


def _classes() -> dict[str, Any]:
    runs = []
    for kind, lead, scale, failed in (
        ("controller-kill", 2.29, 2.30, 0),
        ("controller-kill", 2.33, 2.35, 0),
        ("controller-stop", 2.99, 5.27, 3310),
        ("controller-stop", 3.15, None, 2679),  # `cluster scale` never accepted: not drawn
    ):
        runs.append(
            {
                "class": kind,
                "leads_again_s": lead,
                "scale_accepted_s": scale,
                "requests": {"failed_before_first_byte": failed, "failed_after_first_byte": 0},
            }
        )
    return {
        "mode": "ha",
        "clients": 64,
        "fault_at_s": 3.0,
        "lease": "TTL 3 s",
        "controller_log": "jetstream",
        "target_s": 5.0,
        "runs": runs,
        "summary": {"controller-kill": {}, "controller-stop": {}},
        "quick": True,
    }


def _proxied() -> dict[str, Any]:
    return {
        "mode": "proxied",
        "clients": 64,
        "replicas": 3,
        "kill_at_s": 5.0,
        "seconds": 20.0,
        "runs": [
            {"proxy": "gateway", "detection_s": 2.4, "replacement_s": 3.1,
             "failed_before_first_byte": 0},
            {"proxy": "nginx", "detection_s": 2.6, "replacement_s": None,
             "failed_before_first_byte": 37},
        ],
    }  # fmt: skip


def _run(monkeypatch: pytest.MonkeyPatch, *argv: str) -> int:
    monkeypatch.setattr(sys, "argv", ["bench/failover.py", *argv])
    return failover.main()


@pytest.mark.parametrize("result", [_node_kill(), _classes(), _proxied()], ids=lambda r: r["mode"])
def test_from_json_draws_a_saved_result_as_a_png(
    result: dict[str, Any],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    pytest.importorskip("matplotlib")
    saved, out = tmp_path / "result.json", tmp_path / "failover.png"
    saved.write_text(json.dumps(result))
    assert _run(monkeypatch, "--from-json", str(saved), "--plot", str(out)) == 0
    assert f"plot in {out}" in capsys.readouterr().err
    data = out.read_bytes()
    assert data.startswith(PNG) and len(data) > 15_000


def test_from_json_of_a_mode_without_a_plot_or_not_a_result_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "failover.png"
    soak, broken = tmp_path / "soak.json", tmp_path / "broken.json"
    soak.write_text(json.dumps({"mode": "soak", "offline_verdicts": 0}))
    broken.write_text("{not json")
    for saved, said in ((soak, "no plot for a 'soak' result"), (broken, "JSONDecodeError")):
        assert _run(monkeypatch, "--from-json", str(saved), "--plot", str(out)) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and said in err, err
    assert not out.exists()


def test_plot_without_matplotlib_is_one_line_with_the_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` fails
    monkeypatch.setitem(sys.modules, "matplotlib.pyplot", None)
    saved, out = tmp_path / "result.json", tmp_path / "failover.png"
    saved.write_text(json.dumps(_node_kill()))
    assert _run(monkeypatch, "--from-json", str(saved), "--plot", str(out)) == 2
    stdout, err = capsys.readouterr()
    assert stdout == "" and err.count("\n") == 1, err
    assert "pip install 'gpumesh[plot]'" in err
    assert not out.exists()
