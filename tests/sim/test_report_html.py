"""`gpumesh sim run --html` (sim/report_html.py): the same run as without it, and one
self-contained file with the run's incidents (the dashboard's incident code), its charts and
its timeline, and nothing fetched from anywhere."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.ui.incidents import incidents
from gpumesh.cli import main
from sim.report_html import run_recorded
from sim.run import find_scenario, run_scenario
from sim.scenario import load


def test_recording_the_requests_leaves_the_run_as_it_was() -> None:
    scenario = load(find_scenario("power-outage"))
    plain, _ = run_scenario(scenario, 7)
    recorded, world, traffic = run_recorded(scenario, 7)
    assert recorded == plain  # digest, availability, timings, timeline: all of it
    # The per-second counts add up to the World's own totals.
    for cluster, log in world.requests.items():
        rows = traffic.seconds[cluster].values()
        assert sum(r[0] for r in rows) == log.sent
        assert sum(r[1] for r in rows) == log.ok
        assert sum(r[2] for r in rows) == sum(log.failed.values())
    assert len(incidents(world.store.read_all_now())) == 2


def test_sim_run_html_writes_one_self_contained_file_with_the_incidents(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "report.html"
    assert main(["sim", "run", "power-outage", "--seed", "7", "--html", str(out)]) == 0
    assert f"report in {out}" in capsys.readouterr().err
    page = out.read_text(encoding="utf-8")
    # Nothing from anywhere else: no script, no linked file, no style sheet from a URL.
    assert "<script" not in page and "<link" not in page and "<img" not in page
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(\w+:|//)""", page, re.I)
    assert "url(" not in page and "@import" not in page
    assert re.findall(r'href="([^"]*)"', page) == [
        f"#incident-{i}"
        for i in re.findall(r'<section class="incident" id="incident-([^"]+)"', page)
    ]
    # The two nodes that lost power with replicas on them, drawn as the dashboard draws them.
    sections = re.findall(r'<section class="incident".*?</section>', page, re.S)
    assert len(sections) == 2
    for section in sections:
        kinds = set(re.findall(r'data-kind="(\w+)"', section))
        assert {"heartbeat", "suspect", "offline", "failed", "placed", "ready", "healthy"} <= kinds
        assert 'data-state="resolved"' in section and "replaced in" in section
        assert "t = 61." in section  # virtual time, the fault at 60 s and detection after
    # Charts per cluster and the fleet's health lanes, the faults shaded; the timeline.
    for cluster in ("llama", "mistral"):
        assert f'aria-label="{cluster}: requests / s"' in page
        assert f'aria-label="{cluster}: failed / s"' in page
    assert page.count('class="fault"') == 4  # one fault, on each of the four charts
    assert 'class="h-offline"' in page
    assert "fault  power_loss" in page and "invariant violations: none" in page


CALM = """
name = "calm"
duration_s = 20
settle_s = 5

[fleet]
nodes = 2

[[clusters]]
name = "chat"
replicas = 1

[traffic]
rate_per_s = 2
"""


def test_a_run_with_no_node_lost_says_so(tmp_path: Path) -> None:
    scenario = tmp_path / "calm.toml"
    scenario.write_text(CALM)
    out = tmp_path / "report.html"
    assert main(["sim", "run", str(scenario), "--seed", "1", "--html", str(out)]) == 0
    page = out.read_text(encoding="utf-8")
    assert "No node loss or health change moved a replica." in page
    assert 'aria-label="chat: requests / s"' in page
