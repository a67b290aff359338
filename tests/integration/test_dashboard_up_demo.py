"""The dashboard (gateway/ui) in a real headless Chromium against a real `gpumesh up --demo
echo` process, as a user meets it: signed in with the admin key `up` printed the path of, each
page (fleet, clusters, events, incidents) renders with no console error, exception or failed
load; then one agent process of that stack is killed, and with no reload the fleet page turns
its node offline and the incidents page draws the incident.

test_dashboard_browser.py drives the same pages against the test stack (tests/integration/
stack.py) with the gateway in the test's process; this one is the whole `up`, each part its
own process. Skipped where there is no chromium (`apt-get install -y chromium`).
"""

from __future__ import annotations

import asyncio
import os
import signal
import uuid
from pathlib import Path

import pytest

from tests.integration.browser import Chromium, Page, chromium_path
from tests.integration.stack import kill_marked, pid_alive, workloads
from tests.integration.test_up_demo import read_summary
from tests.integration.up_process import reap, start_up

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        chromium_path() is None,
        reason="no chromium to drive (apt-get install -y chromium, or GPUMESH_CHROMIUM=path)",
    ),
]

READY = "document.body.dataset.ready === '1'"
LIVE = "document.getElementById('live').classList.contains('on')"
HEALTH = (
    "Object.fromEntries([...document.querySelectorAll('#nodes tbody tr')]"
    ".map(t => [t.dataset.id, t.cells[1].querySelector('.badge').textContent]))"
)
CHIPS = (
    "Object.fromEntries([...document.querySelectorAll('#nodes tbody tr')]"
    ".map(t => [t.dataset.id, [...t.querySelectorAll('.chip')].map(c => c.textContent)]))"
)
SECTIONS = """[...document.querySelectorAll('section.incident')].map((s) => ({
    node: s.dataset.node, state: s.dataset.state, head: s.querySelector('header').textContent,
    marks: [...s.querySelectorAll('svg .mark')].map((m) => m.dataset.kind)}))"""


async def open_page(page: Page, url: str) -> None:
    await page.goto(url)
    await page.wait_for(READY)
    await page.wait_for(LIVE)
    await page.evaluate("window.stillTheSamePage = true")


async def sign_in(browser: Chromium, dashboard: str, key: str) -> Page:
    """A page of `browser` on the fleet page, through the sign-in form."""
    page = await browser.new_page()
    await page.goto(f"{dashboard}/fleet")
    assert await page.evaluate("location.pathname") == "/ui/login"
    await page.fill("#key", key)
    await page.evaluate("document.querySelector('form.login').submit()")
    await page.wait_for("location.pathname === '/ui/fleet'")
    await page.wait_for(READY)
    await page.wait_for(LIVE)
    assert page.problems == []
    return page


@pytest.mark.timeout(120)
async def test_the_dashboard_of_up_demo_echo_follows_an_agent_killed_with_no_reload(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "stack"
    marker = f"ui-demo-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    # Four nodes for the demo's three replicas: the lost node's replica has one to move to.
    up = start_up(data_dir, marker, nodes=4, extra=["--demo", "echo"])
    try:
        summary = await asyncio.wait_for(asyncio.to_thread(read_summary, up), timeout=60)
        assert "stop" in summary, (tmp_path / "up.log").read_text()[-3000:]
        dashboard = summary["dashboard"].split()[0]
        assert dashboard.startswith("http://127.0.0.1:") and dashboard.endswith("/ui"), summary
        key_file = data_dir / "admin-key"
        assert str(key_file) in summary["the API"], summary  # where `up` says its key is
        key = key_file.read_text().strip()

        # Two browsers, one after the other: Chromium keeps at most 6 HTTP/1.1 connections to
        # a host, and a page left keeps its event stream's connection busy for up to a minute
        # (seen here: 6 established, a new tab's style sheet waiting 60 s), so a tab opened
        # after six streams would stall.
        async with Chromium.launch() as browser:
            page = await sign_in(browser, dashboard, key)
            nodes = ["node-0", "node-1", "node-2", "node-3"]
            assert await page.evaluate(HEALTH) == dict.fromkeys(nodes, "healthy")

            # Each page renders, from `up`'s own controller, with nothing in the console.
            for name, rows, count in (
                ("clusters", "#clusters tbody tr", 3),  # the demo's three replicas
                ("events", "#events tbody tr", 0),  # (more than none)
                ("incidents", "#none:not([hidden])", 1),  # "no incident", said
            ):
                await open_page(page, f"{dashboard}/{name}")
                found = await page.evaluate(f"document.querySelectorAll({rows!r}).length")
                assert found == count if count else found > 0, (name, found)
                assert page.problems == [], (name, page.problems)
            assert await page.evaluate(SECTIONS) == []  # no node lost yet

        async with Chromium.launch() as browser:
            page = await sign_in(browser, dashboard, key)
            await page.evaluate("window.stillTheSamePage = true")
            incidents = await browser.new_page()
            await open_page(incidents, f"{dashboard}/incidents")

            # One agent process of the stack is killed (SIGKILL: no goodbye to the controller).
            await page.wait_for(f"Object.values({CHIPS}).flat().length === 3")
            chips = await page.evaluate(CHIPS)
            victim_workload = workloads(marker)[0]
            agent = victim_workload.ppid
            victim = next(
                node
                for node, on in chips.items()
                if any(c.split()[0] == victim_workload.replica_id for c in on)
            )
            assert pid_alive(agent)
            os.kill(agent, signal.SIGKILL)

            # With no reload: the fleet page turns its node offline, the incidents page draws it.
            await page.wait_for(f"{HEALTH}[{victim!r}] === 'offline'", timeout=20)
            assert await page.evaluate(
                f"document.querySelector('tr[data-id={victim}]').classList.contains('offline')"
            )
            await incidents.wait_for(f"{SECTIONS}.some(s => s.node === {victim!r})", timeout=20)
            # ... and follows it until the replica is ready on another node.
            await incidents.wait_for(
                f"{SECTIONS}.some(s => s.node === {victim!r} && s.state === 'resolved')",
                timeout=20,
            )
            drawn = next(s for s in await incidents.evaluate(SECTIONS) if s["node"] == victim)
            for kind in ("heartbeat", "suspect", "offline", "failed", "placed", "ready"):
                assert kind in drawn["marks"], (kind, drawn)
            assert "1 replica moved" in drawn["head"], drawn["head"]
            for each in (page, incidents):
                assert await each.evaluate("window.stillTheSamePage") is True
                assert await each.evaluate("performance.getEntriesByType('navigation').length") == 1
                assert each.problems == []
    finally:
        reap(up)
        await asyncio.to_thread(kill_marked, marker)
