"""The dashboard's routes (gateway/ui) over HTTP, against a scripted controller: who may see
them, the sign-in cookie, the assets and their types, what a page embeds, the events backfill.
The pages in a real browser against a real stack: tests/integration/test_dashboard_browser.py."""

from __future__ import annotations

import json
import re
import tomllib
from collections.abc import AsyncIterator
from http.cookies import SimpleCookie
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from events.contract import subjects
from gateway.auth import KeyRing
from gateway.ui import Sessions, mount
from gateway.ui.assets import Assets
from runtime.env import Msg, NoResponders

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "gm-admin-0123456789"
READER = "gm-ro-0123456789"
KEYS = {"admin_keys": [ADMIN], "admins": {"dashboards": {"keys": [READER], "scope": "read"}}}
HEARTBEAT = "node.heartbeat.v1"


def node(node_id: str, **fields: Any) -> dict[str, Any]:
    return {
        "node_id": node_id,
        "region": "eu-west",
        "health": "healthy",
        "gpus": [{"index": 0, "uuid": "GPU-0", "model": "RTX4090", "vram_mib": 24576}],
        "metrics": [{"index": 0, "temperature_c": 41.0, "memory_total_mib": 24576}],
        **fields,
    }


class ScriptedController:
    """A Bus answering the read verbs from `nodes`, `clusters` and `log` (events.list as the
    controller pages it: `after`, `limit`, heartbeats skipped unless asked, `next`, `head`)."""

    def __init__(self) -> None:
        self.nodes: list[dict[str, Any]] = [node("node-0"), node("node-1")]
        self.clusters: list[dict[str, Any]] = []
        self.log: list[dict[str, Any]] = []
        self.down = False
        self.asked: list[str] = []

    def commit(self, type_: str, stream: str, **payload: Any) -> None:
        position = len(self.log) + 1
        self.log.append(
            {
                "event_id": f"e{position}",
                "stream": stream,
                "version": 1,
                "position": position,
                "type": type_,
                "recorded_at": 1_700_000_000_000_000_000 + position,
                "payload": {"type": type_, **payload},
            }
        )

    async def publish(self, subject: str, data: bytes, **kw: Any) -> None:
        raise AssertionError("the dashboard never publishes")

    async def subscribe(self, subject: str, *, queue: str = "") -> Any:
        raise AssertionError("no stream in these tests")

    async def request(self, subject: str, data: bytes, *, timeout: float, **kw: Any) -> Msg:
        if self.down:
            raise NoResponders(subject)
        verb = subject.removeprefix(subjects.api("node.list").removesuffix("node.list"))
        self.asked.append(verb)
        body = json.loads(data or b"{}")
        if verb == "node.list":
            answer: Any = self.nodes
        elif verb == "cluster.list":
            answer = self.clusters
        elif verb == "events.list":
            answer = self.events(body["after"], body["limit"], body.get("heartbeats", False))
        else:
            raise AssertionError(f"unexpected verb {verb}")
        reply = {"type": "api_reply.v1", "ok": True, "data": answer}
        return Msg(subject="_INBOX.x", data=msgspec.json.encode(reply))

    def events(self, after: int, limit: int, heartbeats: bool) -> dict[str, Any]:
        found = []
        cursor = after
        for envelope in self.log[after : after + 20 * limit]:  # 20 pages, as the controller
            cursor = envelope["position"]
            if heartbeats or envelope["type"] != HEARTBEAT:
                found.append(envelope)
                if len(found) == limit:
                    break
        return {"events": found, "next": cursor, "head": len(self.log)}


@pytest.fixture
def controller() -> ScriptedController:
    return ScriptedController()


async def serve(controller: ScriptedController, keys: KeyRing) -> TestClient[Any, Any]:
    root = web.Application()
    mount(root, controller, keys)  # type: ignore[arg-type]  # a Bus as far as the routes go
    client: TestClient[Any, Any] = TestClient(TestServer(root, host="127.0.0.1"))
    await client.start_server()
    return client


@pytest.fixture
async def keyed(controller: ScriptedController) -> AsyncIterator[TestClient[Any, Any]]:
    client = await serve(controller, KeyRing.from_mapping(KEYS))
    try:
        yield client
    finally:
        await client.close()


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def embedded(page: str) -> dict[str, Any]:
    found = re.search(r'<script type="application/json" id="gm-data">(.*?)</script>', page, re.S)
    assert found, page[:500]
    data: dict[str, Any] = json.loads(found.group(1))
    return data


async def sign_in(client: TestClient[Any, Any], key: str, target: str = "/ui/fleet") -> str:
    resp = await client.post("/ui/login", data={"key": key, "next": target}, allow_redirects=False)
    assert resp.status == 303, await resp.text()
    return resp.headers["Set-Cookie"]


# -- who may see it -----------------------------------------------------------------------------


async def test_without_an_admin_key_pages_go_to_sign_in_and_data_is_refused(
    keyed: TestClient[Any, Any], controller: ScriptedController
) -> None:
    for path in ("/ui/fleet", "/ui/clusters", "/ui/events?node=node-1", "/ui", "/ui/"):
        resp = await keyed.get(path, allow_redirects=False)
        assert resp.status == 303, path
        target = "/ui/fleet" if path in ("/ui", "/ui/") else path
        if path != "/ui":
            assert resp.headers["Location"] == f"/ui/login?next={target}", path
    for path in ("/ui/data/fleet", "/ui/data/events", "/ui/api/nodes", "/ui/api/events/stream"):
        for headers in ({}, bearer("gm-not-a-key"), {"Cookie": "gpumesh_ui=forged"}):
            resp = await keyed.get(path, headers=headers)
            assert resp.status == 401, (path, headers)
            assert resp.headers["WWW-Authenticate"] == "Bearer"
            error = (await resp.json())["error"]
            assert error["type"] == "admin_key_required" and "/ui/login" in error["message"]
    assert controller.asked == []  # refused before anything was asked of the controller
    # An admin key of any scope reads: the dashboard changes nothing.
    for key in (ADMIN, READER):
        resp = await keyed.get("/ui/data/fleet", headers=bearer(key))
        assert resp.status == 200
        assert [n["node_id"] for n in (await resp.json())["nodes"]] == ["node-0", "node-1"]


async def test_sign_in_sets_a_strict_http_only_cookie_that_sign_out_ends(
    keyed: TestClient[Any, Any],
) -> None:
    resp = await keyed.get("/ui/login?next=/ui/events")
    assert resp.status == 200 and resp.content_type == "text/html"
    page = await resp.text()
    assert 'name="next" value="/ui/events"' in page and 'type="password"' in page

    wrong = await keyed.post("/ui/login", data={"key": "gm-guess", "next": "/ui/events"})
    assert wrong.status == 401 and "not an admin key" in await wrong.text()
    assert "Set-Cookie" not in wrong.headers

    resp = await keyed.post(
        "/ui/login", data={"key": READER, "next": "/ui/events"}, allow_redirects=False
    )
    assert resp.status == 303 and resp.headers["Location"] == "/ui/events"
    morsel = SimpleCookie(resp.headers["Set-Cookie"])["gpumesh_ui"]
    assert morsel["httponly"] and morsel["samesite"] == "Strict" and morsel["path"] == "/ui"
    assert int(morsel["max-age"]) == 12 * 3600
    assert READER not in morsel.value and len(morsel.value) >= 40  # a token, not the key

    # The test client keeps the cookie, as a browser does.
    assert (await keyed.get("/ui/fleet", allow_redirects=False)).status == 200
    assert (await keyed.get("/ui/data/clusters")).status == 200
    resp = await keyed.get("/ui/login", allow_redirects=False)  # signed in: straight on
    assert resp.status == 303 and resp.headers["Location"] == "/ui/fleet"

    resp = await keyed.post("/ui/logout", allow_redirects=False)
    assert resp.status == 303 and resp.headers["Location"] == "/ui/login"
    assert (await keyed.get("/ui/data/clusters")).status == 401


async def test_a_key_taken_out_of_the_key_file_ends_its_sessions(
    controller: ScriptedController, tmp_path: Path
) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(f'admin_keys = ["{ADMIN}", "{READER}"]\n')
    keys = KeyRing.load(path)
    client = await serve(controller, keys)
    try:
        await sign_in(client, READER)
        assert (await client.get("/ui/data/fleet")).status == 200
        path.write_text(f'admin_keys = ["{ADMIN}"]\n')
        assert keys.reload()
        assert (await client.get("/ui/data/fleet")).status == 401
    finally:
        await client.close()


async def test_sign_in_refuses_other_sites_and_sends_only_to_dashboard_pages(
    keyed: TestClient[Any, Any],
) -> None:
    resp = await keyed.post(
        "/ui/login", data={"key": ADMIN}, headers={"Origin": "https://evil.example"}
    )
    assert resp.status == 403 and "Set-Cookie" not in resp.headers
    for target in ("https://evil.example/", "//evil.example/ui/", "/v1/models", "/ui/login", ""):
        resp = await keyed.post(
            "/ui/login", data={"key": ADMIN, "next": target}, allow_redirects=False
        )
        assert resp.headers["Location"] == "/ui/fleet", target
    origin = f"http://{keyed.server.host}:{keyed.server.port}"
    resp = await keyed.post(
        "/ui/login",
        data={"key": ADMIN, "next": "/ui/events?type=node.&node=node-1"},
        headers={"Origin": origin},
        allow_redirects=False,
    )
    assert resp.headers["Location"] == "/ui/events?type=node.&node=node-1"


def test_sessions_expire_and_are_bounded() -> None:
    class Clock:
        now = 0.0

        def monotonic(self) -> float:
            return self.now

        def wall_ns(self) -> int:
            return 0

    clock = Clock()
    sessions = Sessions(KeyRing.from_mapping(KEYS), ttl_s=60, max_sessions=2, clock=clock)
    assert sessions.login("gm-wrong") is None and sessions.login("") is None
    first = sessions.login(ADMIN)
    second = sessions.login(READER)
    assert first and second and first != second
    assert sessions.scope(first) is not None and sessions.scope(second) is not None
    assert sessions.scope(second).scope == "read"  # type: ignore[union-attr]
    third = sessions.login(ADMIN)
    assert len(sessions) == 2 and sessions.scope(first) is None  # the oldest made way
    clock.now = 61
    assert sessions.scope(third) is None and len(sessions) == 1


async def test_insecure_api_opens_it_and_no_admin_key_closes_it(
    controller: ScriptedController,
) -> None:
    client = await serve(controller, KeyRing.open(insecure_api=True))
    try:
        resp = await client.get("/ui/fleet", allow_redirects=False)
        assert resp.status == 200
        assert "Sign out" not in await resp.text()  # nothing to sign out of
        assert (await client.get("/ui/data/fleet")).status == 200
        resp = await client.get("/ui/login?next=/ui/clusters", allow_redirects=False)
        assert resp.headers["Location"] == "/ui/clusters"
    finally:
        await client.close()
    client = await serve(controller, KeyRing.open())
    try:
        assert (await client.get("/ui/data/fleet")).status == 401
        page = await (await client.get("/ui/login")).text()
        assert "The dashboard is closed: this gateway has no admin key" in page
    finally:
        await client.close()


async def test_the_dashboard_only_reads(keyed: TestClient[Any, Any]) -> None:
    for method, path in (
        ("POST", "/ui/api/clusters"),
        ("DELETE", "/ui/api/clusters/echo"),
        ("POST", "/ui/api/nodes/node-1/drain"),
        ("PATCH", "/ui/api/clusters/echo"),
    ):
        resp = await keyed.request(method, path, headers=bearer(ADMIN), json={"replicas": 0})
        assert resp.status == 405, (method, path)
        assert resp.headers["Allow"] == "GET, HEAD"
        assert (await resp.json())["error"]["type"] == "method_not_allowed"


# -- assets and pages ---------------------------------------------------------------------------


async def test_assets_are_served_with_their_types_and_cached_by_digest(
    keyed: TestClient[Any, Any],
) -> None:
    assets = Assets()
    assert {"common.js", "fleet.js", "clusters.js", "events.js", "dashboard.css"} <= set(
        assets.names()
    )
    for name in assets.names():
        # Public: the sign-in page needs its style sheet, and nothing in them is a secret.
        resp = await keyed.get(f"/ui/static/{name}")
        assert resp.status == 200, name
        expected = "text/css" if name.endswith(".css") else "text/javascript"
        assert resp.content_type == expected and resp.charset == "utf-8"
        assert resp.headers["X-Content-Type-Options"] == "nosniff"
        assert resp.headers["Cache-Control"] == "no-cache"
        etag = resp.headers["ETag"]
        again = await keyed.get(f"/ui/static/{name}", headers={"If-None-Match": etag})
        assert again.status == 304
        versioned = await keyed.get(assets.url(name))
        assert "immutable" in versioned.headers["Cache-Control"]
    assert (await keyed.get("/ui/static/nothing.js")).status == 404
    assert (await keyed.get("/ui/static/..%2Froutes.py")).status == 404


async def test_each_page_embeds_its_data_safely_under_a_strict_policy(
    keyed: TestClient[Any, Any], controller: ScriptedController
) -> None:
    hostile = "</script><script>alert(1)</script>"
    controller.nodes.append(node("node-2", region=hostile))
    controller.commit("node.registered.v1", "node/node-2", node_id="node-2", region=hostile)
    controller.commit(HEARTBEAT, "heartbeat/node-2", node_id="node-2", seq=1)
    for page in ("fleet", "clusters", "events", "incidents"):
        resp = await keyed.get(f"/ui/{page}", headers=bearer(ADMIN))
        assert resp.status == 200 and resp.content_type == "text/html"
        csp = resp.headers["Content-Security-Policy"]
        assert "script-src 'self'" in csp and "unsafe-inline" not in csp
        assert resp.headers["X-Frame-Options"] == "DENY"
        assert resp.headers["Cache-Control"] == "no-store"
        text = await resp.text()
        assert "<script>alert" not in text
        assert f'src="{Assets().url(page + ".js")}"' in text
        data = embedded(text)
        assert data["config"]["page"] == page
        assert "node.health_changed.v1" in data["config"]["types"]
        assert data["data"]["head"] == 2
    fleet = embedded(await (await keyed.get("/ui/fleet", headers=bearer(ADMIN))).text())
    assert fleet["data"]["nodes"][2]["region"] == hostile
    events = embedded(await (await keyed.get("/ui/events", headers=bearer(ADMIN))).text())
    assert [e["type"] for e in events["data"]["events"]] == ["node.registered.v1"]
    assert events["data"]["start"] == 0 and events["data"]["clusters"] == []


async def test_a_page_says_when_the_controller_does_not_answer(
    keyed: TestClient[Any, Any], controller: ScriptedController
) -> None:
    controller.down = True
    resp = await keyed.get("/ui/fleet", headers=bearer(ADMIN))
    assert resp.status == 200  # the page comes up, says why, and waits for the stream
    assert "controller not reachable" in embedded(await resp.text())["data"]["error"]
    resp = await keyed.get("/ui/data/fleet", headers=bearer(ADMIN))
    assert resp.status == 503 and resp.headers["Retry-After"] == "2"
    resp = await keyed.get("/ui/incidents", headers=bearer(ADMIN))
    assert resp.status == 200
    assert "controller not reachable" in embedded(await resp.text())["data"]["error"]
    assert (await keyed.get("/ui/data/incidents", headers=bearer(ADMIN))).status == 503


async def test_incidents_are_drawn_with_the_nodes_last_heartbeat_read_back_for_them(
    keyed: TestClient[Any, Any], controller: ScriptedController
) -> None:
    def replica(type_: str, replica_id: str, **payload: Any) -> None:
        controller.commit(type_, f"replica/{replica_id}", replica_id=replica_id, **payload)

    replica("replica.placed.v1", "echo-0", cluster="echo", node_id="node-1", epoch=1)
    replica("replica.ready.v1", "echo-0", epoch=1, address="http://10.0.0.1:8000")
    controller.commit(HEARTBEAT, "heartbeat/node-1", node_id="node-1", seq=1)
    last = len(controller.log)
    # The rest of the fleet's heartbeats: the lookback has to go past a page of them.
    for seq in range(2500):
        controller.commit(HEARTBEAT, "heartbeat/node-0", node_id="node-0", seq=seq)
    for state in ("suspect", "offline"):
        controller.commit(
            "node.health_changed.v1",
            "node/node-1",
            node_id="node-1",
            state=state,
            reason="missed_heartbeats",
        )
    replica("replica.failed.v1", "echo-0", epoch=1, reason="node_offline", detail="<b>gone</b>")
    replica("replica.placed.v1", "echo-0", cluster="echo", node_id="node-0", epoch=2)

    resp = await keyed.get("/ui/data/incidents", headers=bearer(ADMIN))
    assert resp.status == 200, await resp.text()
    body = await resp.json()
    assert body["count"] == 1 and body["head"] == len(controller.log)
    drawn = body["html"]
    assert 'data-node="node-1"' in drawn and 'data-state="ongoing"' in drawn
    assert 'data-kind="heartbeat"' in drawn and f"<td class=num>{last}</td>" in drawn
    assert "&lt;b&gt;gone&lt;/b&gt;" in drawn and "<b>gone" not in drawn
    page = await (await keyed.get("/ui/incidents", headers=bearer(ADMIN))).text()
    assert 'data-node="node-1"' in page and embedded(page)["data"]["count"] == 1
    # The heartbeat, found once, is not looked for again.
    asked = len(controller.asked)
    replica("replica.ready.v1", "echo-0", epoch=2, address="http://10.0.0.2:8000")
    body = await (await keyed.get("/ui/data/incidents", headers=bearer(ADMIN))).json()
    assert 'data-state="resolved"' in body["html"]
    again = controller.asked[asked:]
    assert again.count("events.list") <= 4, again


# -- the events backfill ------------------------------------------------------------------------


async def test_events_backfill_skips_heartbeats_and_pages_back_to_the_start(
    keyed: TestClient[Any, Any], controller: ScriptedController
) -> None:
    # 30,000 positions, heartbeats but for one event in 997: the last ones lie far apart.
    for position in range(1, 30_001):
        if position % 997 == 0:
            controller.commit("node.drained.v1", "node/node-0", node_id="node-0")
        else:
            controller.commit(HEARTBEAT, "heartbeat/node-0", node_id="node-0", seq=position)
    wanted = [p for p in range(1, 30_001) if p % 997 == 0]

    async def page(query: str) -> dict[str, Any]:
        resp = await keyed.get(f"/ui/data/events?{query}", headers=bearer(ADMIN))
        assert resp.status == 200, await resp.text()
        body: dict[str, Any] = await resp.json()
        return body

    last = await page("limit=5")
    assert [e["position"] for e in last["events"]] == wanted[-5:]
    assert last["head"] == 30_000 and last["start"] == wanted[-5] - 1
    got: list[int] = []
    to = None
    while to != 0:
        part = await page(f"limit=7&to={last['start'] if to is None else to}")
        assert all(e["type"] != HEARTBEAT for e in part["events"])
        got = [e["position"] for e in part["events"]] + got
        to = part["start"]
    assert got == wanted[:-5]
    for bad in ("limit=0", "limit=5000", "to=-1", "limit=x"):
        resp = await keyed.get(f"/ui/data/events?{bad}", headers=bearer(ADMIN))
        assert resp.status == 400, bad


# -- packaging ----------------------------------------------------------------------------------


def test_every_dashboard_file_is_package_data() -> None:
    """`pip install .` must carry each file the pages need (pyproject.toml package-data)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = config["tool"]["setuptools"]["package-data"]["gateway.ui"]
    ui = ROOT / "gateway" / "ui"
    shipped = {p for g in globs for p in ui.glob(g)}
    files = {p for folder in ("static", "templates") for p in (ui / folder).iterdir()}
    assert files and files == shipped
