"""The dashboard (gateway/ui) in a real headless Chromium, against a real stack: nats-server, a
controller process, agents with fake GPUs running the echo workload, and the gateway.

Each page renders its rows with no console error, exception or failed load; the fleet page
follows the event stream, so a node whose agent is killed turns offline on the page, and its
replica shows up on another node, with no reload; the incidents page, open beside it, draws the
node's loss as it happens.

Skipped where there is no chromium (`apt-get install -y chromium`; .ci/run installs it). The
screenshots in docs/img are these pages; to take them again:

    GPUMESH_UI_SCREENSHOTS=docs/img .venv/bin/pytest -q tests/integration/test_dashboard_browser.py
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from gateway.auth import KeyRing
from gateway.ui import history
from tests.integration.browser import Chromium, Page, chromium_path
from tests.integration.gateway_kit import running_gateway
from tests.integration.stack import Stack, echo_spec
from wire.nats_bus import NatsBus

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        chromium_path() is None,
        reason="no chromium to drive (apt-get install -y chromium, or GPUMESH_CHROMIUM=path)",
    ),
]

ADMIN = "gm-admin-browser-test-0123456789"
TENANT = "gm-tenant-browser-test-0123456789"
READY = "document.body.dataset.ready === '1'"
LIVE = "document.getElementById('live').classList.contains('on')"
SECTIONS = """[...document.querySelectorAll('section.incident')].map((s) => ({
    node: s.dataset.node, state: s.dataset.state, head: s.querySelector('header').textContent,
    marks: [...s.querySelectorAll('svg .mark')].map((m) => m.dataset.kind)}))"""


def shots(tmp_path: Path) -> Path:
    wanted = os.environ.get("GPUMESH_UI_SCREENSHOTS")
    return Path(wanted) if wanted else tmp_path


async def ready_replicas(stack: Stack, name: str, count: int) -> list[dict[str, Any]]:
    async def ready() -> bool:
        cluster = await stack.cluster(name)
        return bool(sum(r["status"] == "ready" for r in cluster["replicas"]) == count)

    await stack.wait_until(ready, timeout=30, why=f"{count} ready replicas of {name}")
    replicas: list[dict[str, Any]] = (await stack.cluster(name))["replicas"]
    return replicas


async def traffic(url: str, stop: asyncio.Event, *, failures: bool = False) -> int:
    """Chat requests to the echo cluster at a rate that swings (5 to 50 a second), until
    `stop` (each answered 200 unless `failures` may happen); how many were sent."""
    sent = 0
    body = {"model": "echo", "messages": [{"role": "user", "content": "hi"}]}
    headers = {"Authorization": f"Bearer {TENANT}"}
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            async with session.post(
                f"{url}/v1/chat/completions", json=body, headers=headers
            ) as resp:
                assert failures or resp.status == 200, await resp.text()
                await resp.read()
            sent += 1
            await asyncio.sleep(0.02 + 0.18 * (sent % 40) / 40)
    return sent


async def open_page(page: Page, url: str) -> None:
    await page.goto(url)
    await page.wait_for(READY)
    await page.wait_for(LIVE)


async def test_each_page_renders_its_rows_with_no_console_errors(
    tmp_path: Path, nats_server_binary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The clusters page's charts: a sample every 0.3 s over the last 6 s, rather than every
    # 10 s over 15 minutes, for the test.
    monkeypatch.setattr(history, "INTERVAL_S", 0.3)
    monkeypatch.setattr(history, "KEEP_S", 6.0)
    keys = KeyRing.from_mapping(
        {"admin_keys": [ADMIN], "tenants": {"t": {"keys": [TENANT], "rate_per_s": 0}}}
    )
    async with Stack(tmp_path / "stack", agents=3, nats_binary=nats_server_binary) as stack:
        await stack.create_cluster(echo_spec(3))
        replicas = await ready_replicas(stack, "echo", 3)
        bus = await NatsBus.connect(stack.url, name="gw-dashboard", reconnect_wait=0.1)
        try:
            async with running_gateway(bus, keys=keys) as gateway, Chromium.launch() as browser:
                # Traffic through the gateway from now until the clusters page has charted it.
                stop = asyncio.Event()
                sending = asyncio.create_task(traffic(gateway.url, stop))
                page = await browser.new_page()
                # Signed out: the fleet page sends the browser to the sign-in form, and back.
                await page.goto(f"{gateway.url}/ui/fleet")
                assert await page.evaluate("location.pathname") == "/ui/login"
                await page.fill("#key", ADMIN)
                await page.evaluate("document.querySelector('form.login').submit()")
                await page.wait_for("location.pathname === '/ui/fleet'")
                await page.wait_for(READY)
                await page.wait_for(LIVE)
                assert await page.evaluate("document.cookie") == ""  # HttpOnly: not for scripts

                rows = await page.evaluate(
                    """[...document.querySelectorAll('#nodes tbody tr')].map((tr) => ({
                        id: tr.dataset.id,
                        health: tr.cells[1].querySelector('.badge').textContent,
                        gpus: tr.cells[3].textContent.split('\\n').length,
                        vram: tr.cells[4].textContent,
                        replicas: [...tr.cells[7].querySelectorAll('.chip')].map(
                            (c) => c.textContent),
                    }))"""
                )
                assert [r["id"] for r in rows] == ["node-0", "node-1", "node-2"]
                assert all(r["health"] == "healthy" and r["gpus"] == 2 for r in rows), rows
                assert all("/ 24.0 GiB" in r["vram"] for r in rows), rows
                placed = {r["replica_id"]: r["node_id"] for r in replicas}
                shown = {chip: r["id"] for r in rows for chip in r["replicas"]}
                assert shown == placed
                # Sorting and filtering, in the page alone.
                await page.evaluate("document.querySelector('th[data-key=node]').click()")
                order = "[...document.querySelectorAll('#nodes tbody tr')].map(t => t.dataset.id)"
                assert await page.evaluate(order) == ["node-2", "node-1", "node-0"]
                await page.fill("#filter", "node-1")
                visible = (
                    "[...document.querySelectorAll('#nodes tbody tr')]"
                    ".filter(t => !t.hidden).map(t => t.dataset.id)"
                )
                assert await page.wait_for(f"{visible}.length === 1 && {visible}")
                await page.fill("#filter", "")
                await page.wait_for(f"{visible}.length === 3")
                await page.evaluate("document.querySelector('th[data-key=node]').click()")
                await page.screenshot(shots(tmp_path) / "dashboard-fleet.png")
                assert page.problems == []

                await open_page(page, f"{gateway.url}/ui/clusters")
                charts = "document.querySelector('div.charts[data-cluster=echo]')"
                await page.wait_for(f"Number({charts}.dataset.peak) > 0")
                titles = await page.evaluate(
                    f"[...{charts}.querySelectorAll('svg.chart')].map(c => c.ariaLabel"
                    " || c.getAttribute('aria-label'))"
                )
                assert titles == ["requests / s", "latency", "errors / s"]
                series = await page.evaluate(
                    f"[...{charts}.querySelectorAll('path.series')].map(p => p.dataset.series)"
                )
                assert {"requests", "p50", "p99"} <= set(series), series
                # New samples come over the stream: the charts grow with no reload, up to the
                # window's 20.
                drawn = await page.evaluate(f"Number({charts}.dataset.samples)")
                await page.wait_for(f"Number({charts}.dataset.samples) > {drawn}")
                await page.wait_for(f"Number({charts}.dataset.samples) === 20", timeout=15)
                clusters = await page.evaluate(
                    """[...document.querySelectorAll('section.cluster')].map((s) => ({
                        name: s.dataset.name,
                        replicas: [...s.querySelectorAll('tbody tr')].map((tr) => [
                            tr.cells[0].textContent, tr.cells[1].textContent,
                            tr.cells[3].textContent, tr.cells[4].textContent]),
                        head: s.querySelector('header').textContent,
                    }))"""
                )
                assert [c["name"] for c in clusters] == ["echo"]
                assert sorted(clusters[0]["replicas"]) == sorted(
                    [r["replica_id"], "1", "ready", r["node_id"]] for r in replicas
                )
                assert "3 / 3 ready" in clusters[0]["head"] and "revision 1" in clusters[0]["head"]
                await page.screenshot(shots(tmp_path) / "dashboard-clusters.png")
                assert page.problems == []
                stop.set()
                assert await sending > 0

                await open_page(page, f"{gateway.url}/ui/events")
                types = await page.evaluate(
                    "[...document.querySelectorAll('#events tbody tr')].map(t => t.cells[2]"
                    ".textContent)"
                )
                assert "cluster.created.v1" in types and "node.registered.v1" in types
                assert "node.heartbeat.v1" not in types
                # A click shows the whole event; the filters narrow the list.
                await page.evaluate("document.querySelector('#events tbody tr').click()")
                await page.wait_for("!document.getElementById('detail').hidden")
                first = await page.evaluate(
                    "[document.querySelector('#events tbody tr').dataset.position,"
                    " document.getElementById('d-position').textContent,"
                    " JSON.parse(document.getElementById('d-payload').textContent).type]"
                )
                assert first[0] == first[1] and first[2] == types[0]
                await page.fill("#f-node", "node-2")
                await page.wait_for("location.search === '?node=node-2'")
                streams = await page.evaluate(
                    "[...document.querySelectorAll('#events tbody tr')].map(t => t.cells[3]"
                    ".textContent)"
                )
                on_node_2 = {
                    f"replica/{r['replica_id']}" for r in replicas if r["node_id"] == "node-2"
                }
                assert "node/node-2" in streams and set(streams) <= {"node/node-2"} | on_node_2
                await page.fill("#f-node", "")
                await page.wait_for("location.search === ''")
                await page.screenshot(shots(tmp_path) / "dashboard-events.png")
                assert page.problems == []

                # No node lost yet: no incident, and the page says so.
                await open_page(page, f"{gateway.url}/ui/incidents")
                assert await page.evaluate(SECTIONS) == []
                assert await page.evaluate("!document.getElementById('none').hidden")
                assert page.problems == []
        finally:
            await bus.close()


async def test_the_fleet_and_incidents_pages_follow_a_node_going_offline_with_no_reload(
    tmp_path: Path, nats_server_binary: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The requests under an incident come from the metrics history: samples every 0.3 s.
    monkeypatch.setattr(history, "INTERVAL_S", 0.3)
    async with Stack(tmp_path / "stack", agents=2, nats_binary=nats_server_binary) as stack:
        bus = await NatsBus.connect(stack.url, name="gw-dashboard", reconnect_wait=0.1)
        try:
            async with running_gateway(bus) as gateway, Chromium.launch() as browser:
                page = await browser.new_page()
                await open_page(page, f"{gateway.url}/ui/fleet")
                await page.evaluate("window.stillTheSamePage = true")
                incidents = await browser.new_page()
                await open_page(incidents, f"{gateway.url}/ui/incidents")
                await incidents.evaluate("window.stillTheSamePage = true")
                assert await incidents.evaluate(SECTIONS) == []
                health = (
                    "Object.fromEntries([...document.querySelectorAll('#nodes tbody tr')]"
                    ".map(t => [t.dataset.id, t.cells[1].querySelector('.badge').textContent]))"
                )
                assert await page.evaluate(health) == {"node-0": "healthy", "node-1": "healthy"}

                # A cluster created behind the page: its replica appears on its node.
                await stack.create_cluster(echo_spec(1))
                (replica,) = await ready_replicas(stack, "echo", 1)
                victim = replica["node_id"]
                other = "node-1" if victim == "node-0" else "node-0"
                chips = (
                    "Object.fromEntries([...document.querySelectorAll('#nodes tbody tr')]"
                    ".map(t => [t.dataset.id, [...t.querySelectorAll('.chip')]"
                    ".map(c => c.textContent + ' ' + c.className)]))"
                )
                await page.wait_for(f"{chips}[{victim!r}].some(c => c.includes('s-ready'))")
                beat = f"document.querySelector('tr[data-id={other}]').cells[8].textContent"
                last_beat = await page.evaluate(beat)

                # Its node dies, with clients sending: the page turns it offline, and the
                # replica moves on.
                stop = asyncio.Event()
                sending = asyncio.create_task(traffic(gateway.url, stop, failures=True))
                await asyncio.sleep(0.5)
                await stack.kill_agent(victim)
                await page.wait_for(f"{health}[{victim!r}] === 'offline'", timeout=15)
                await page.wait_for(
                    f"{chips}[{other!r}].some(c => c.startsWith('echo-0 ') && "
                    "c.includes('s-ready'))",
                    timeout=15,
                )
                assert await page.evaluate(f"{health}[{other!r}]") == "healthy"
                assert await page.evaluate(
                    f"document.querySelector('tr[data-id={victim}]').classList.contains('offline')"
                )
                # Heartbeats kept the surviving node's readings current; still the same page.
                assert await page.evaluate(beat) != last_beat
                assert await page.evaluate("window.stillTheSamePage") is True
                assert await page.evaluate("performance.getEntriesByType('navigation').length") == 1
                assert page.problems == []

                # The incidents page, open all along, drew the node's loss as it happened: its
                # last heartbeat, suspect, offline, the replica failed, placed again and ready.
                await incidents.wait_for(
                    f"{SECTIONS}.some(s => s.node === {victim!r} && s.state === 'resolved')",
                    timeout=15,
                )
                (drawn,) = await incidents.evaluate(SECTIONS)
                assert drawn["node"] == victim
                for kind in ("heartbeat", "suspect", "offline", "failed", "placed", "ready"):
                    assert kind in drawn["marks"], (kind, drawn)
                assert drawn["marks"].index("failed") < drawn["marks"].index("ready")
                assert "1 replica moved" in drawn["head"] and "replaced in" in drawn["head"]
                rows = await incidents.evaluate(
                    "[...document.querySelectorAll('section.incident tbody tr')]"
                    ".map(t => t.cells[4].textContent)"
                )
                assert f"echo-0 epoch 2 on {other}" in rows, rows
                assert await incidents.evaluate("window.stillTheSamePage") is True
                assert (
                    await incidents.evaluate("performance.getEntriesByType('navigation').length")
                    == 1
                )
                stop.set()
                assert await sending > 0
                # Under it, this gateway's requests to echo while it lasted.
                assert await incidents.evaluate(
                    "document.querySelector('section.incident svg').textContent"
                    ".includes('requests')"
                )
                assert "request(s) failed" in drawn["head"], drawn["head"]
                await incidents.screenshot(shots(tmp_path) / "dashboard-incidents.png")
                assert incidents.problems == []
        finally:
            await bus.close()


async def test_pages_left_behind_give_their_event_streams_back(
    tmp_path: Path, nats_server_binary: Path
) -> None:
    # Chromium opens at most 6 connections to one host. Each page follows one or two event
    # streams; a page left that kept its streams (up to a minute was seen) held those
    # connections, and after a few clicks a request of the page in view waited for one.
    async with Stack(tmp_path / "stack", agents=1, nats_binary=nats_server_binary) as stack:
        bus = await NatsBus.connect(stack.url, name="gw-dashboard", reconnect_wait=0.1)
        try:
            async with running_gateway(bus) as gateway, Chromium.launch() as browser:
                page = await browser.new_page()
                for name in ("fleet", "clusters", "events", "incidents") * 2:
                    await open_page(page, f"{gateway.url}/ui/{name}")
                took_ms = await page.evaluate(
                    "(async () => { const t = performance.now();"
                    " await fetch('/ui/api/events?limit=1', {credentials: 'same-origin'});"
                    " return performance.now() - t; })()"
                )
                assert took_ms < 3000, f"a request waited {took_ms:.0f} ms for a connection"
                assert page.problems == []
        finally:
            await bus.close()
