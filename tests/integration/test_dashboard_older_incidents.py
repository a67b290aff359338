"""The incidents page's "older incidents" in a real headless Chromium, against a real stack
(tests/integration/stack.py) with the gateway in the test's process.

A node is lost and its replica moves: the live first page draws it. The log runs on (the
windows of the incidents page are made 10 positions here, rather than 40,000, so heartbeats
carry it past them in seconds), and a second node is lost: the first page, with no reload,
now shows only that one, and links to the older page, which shows the first loss whole (last
heartbeat to ready again) and is not live. No console error, exception or failed load.
Skipped where there is no chromium (`apt-get install -y chromium`).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.ui import incidents as incident_model
from tests.integration.browser import Chromium, chromium_path
from tests.integration.gateway_kit import running_gateway
from tests.integration.stack import Stack, echo_spec
from tests.integration.test_dashboard_browser import (
    READY,
    SECTIONS,
    open_page,
    ready_replicas,
)
from wire.nats_bus import NatsBus

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        chromium_path() is None,
        reason="no chromium to drive (apt-get install -y chromium, or GPUMESH_CHROMIUM=path)",
    ),
]

WINDOW = 10
NODES = "[...document.querySelectorAll('section.incident')].map((s) => s.dataset.node)"
OLDER = "document.getElementById('older')"


async def test_older_incidents_shows_a_loss_that_left_the_first_page(
    tmp_path: Path, nats_server_binary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(incident_model, "WINDOW", WINDOW)
    async with Stack(
        tmp_path / "stack", agents=3, heartbeat_interval=0.5, nats_binary=nats_server_binary
    ) as stack:
        await stack.create_cluster(echo_spec(1))
        (replica,) = await ready_replicas(stack, "echo", 1)
        first = replica["node_id"]
        bus = await NatsBus.connect(stack.url, name="gw-dashboard", reconnect_wait=0.1)
        try:
            async with running_gateway(bus) as gateway, Chromium.launch() as browser:
                page = await browser.new_page()
                await open_page(page, f"{gateway.url}/ui/incidents")
                await page.evaluate("window.stillTheSamePage = true")

                await stack.kill_agent(first)
                resolved = f"{SECTIONS}.some(s => s.node === {first!r} && s.state === 'resolved')"
                await page.wait_for(resolved, timeout=20)
                began = int(
                    await page.evaluate(
                        f"document.querySelector('section.incident[data-node={first}]')"
                        ".dataset.id.split('@')[1]"
                    )
                )

                # Two windows past its beginning, it is no longer among the first page's.
                async def past() -> bool:
                    head: int = (await stack.api("events.list", {"after": 0, "limit": 1}))["head"]
                    return head > began + 2 * WINDOW

                await stack.wait_until(past, timeout=30, why="the log two windows on")
                (replica,) = await ready_replicas(stack, "echo", 1)
                second = replica["node_id"]
                assert second != first
                await stack.kill_agent(second)
                await page.wait_for(f"{NODES}.join() === {second!r}", timeout=20)
                await page.wait_for(f"{SECTIONS}[0].state === 'resolved'", timeout=20)
                assert await page.evaluate("window.stillTheSamePage") is True
                assert await page.evaluate(f"{OLDER} !== null")
                assert await page.evaluate("document.getElementById('newest')") is None
                assert page.problems == []

                # Its link: the older page, with the first loss drawn whole, and not live.
                await page.evaluate(f"{OLDER}.click()")
                await page.wait_for("location.search.startsWith('?before=')")
                await page.wait_for(READY)
                (drawn,) = await page.evaluate(SECTIONS)
                assert drawn["node"] == first and drawn["state"] == "resolved", drawn
                for kind in ("heartbeat", "suspect", "offline", "failed", "placed", "ready"):
                    assert kind in drawn["marks"], (kind, drawn)
                assert "1 replica moved" in drawn["head"]
                assert await page.evaluate("document.getElementById('live').textContent") == (
                    "not live"
                )
                stretch = await page.evaluate("document.getElementById('stretch').textContent")
                assert "before position" in stretch and "not live" in stretch
                assert await page.evaluate("document.getElementById('none').hidden")
                await page.screenshot(tmp_path / "dashboard-incidents-older.png")
                # The way back to the first page.
                await page.evaluate("document.getElementById('newest').click()")
                await page.wait_for("location.search === ''")
                await page.wait_for(READY)
                assert await page.evaluate(NODES) == [second]
                assert page.problems == []
        finally:
            await bus.close()
