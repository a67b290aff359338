"""Scoped admin keys on /api/v1: the key file's [admins.<name>] tables, the scope table, the
middleware's 401/403 (against a controller that says yes to everything), and key reloads."""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import given, strategies as st
from structlog.testing import capture_logs

from events.contract.messages import ApiReply
from gateway.auth import FULL_ADMIN, AdminScope, KeyFileError, KeyRing
from gateway.control_routes import ROUTE_NEEDS, control_app, route_need
from gpumesh.up import ensure_admin_key
from runtime.env import Bus, Msg

KEYS = """
admin_keys = ["gm-root"]

[admins.ro]
keys = ["gm-ro"]
scope = "read"

[admins.llama-team]
keys = ["gm-llama", "gm-llama-2"]
scope = "operate"
clusters = ["llama"]

[admins.ops]
keys = ["gm-ops"]
scope = "all"

[tenants.acme]
keys = ["gm-acme"]
rate_per_s = 0
"""

# What the scope table says, written out again by hand: (method, path) -> the scopes
# allowed, "operate" meaning an operate key for that path's cluster.
EXPECTED: dict[tuple[str, str], set[str]] = {
    ("GET", "/clusters"): {"read", "operate", "all"},
    ("GET", "/clusters/{name}"): {"read", "operate", "all"},
    ("GET", "/clusters/{name}/history"): {"read", "operate", "all"},
    ("GET", "/nodes"): {"read", "operate", "all"},
    ("GET", "/events"): {"read", "operate", "all"},
    ("GET", "/events/stream"): {"read", "operate", "all"},
    ("PUT", "/clusters/{name}"): {"operate", "all"},
    ("PATCH", "/clusters/{name}"): {"operate", "all"},
    ("POST", "/clusters/{name}/rollback"): {"operate", "all"},
    ("POST", "/clusters/{name}/canary"): {"operate", "all"},
    ("POST", "/clusters/{name}/promote"): {"operate", "all"},
    ("POST", "/clusters/{name}/abort"): {"operate", "all"},
    ("DELETE", "/clusters/{name}"): {"operate", "all"},
    ("POST", "/clusters"): {"all"},
    ("POST", "/nodes/{node_id}/drain"): {"all"},
    ("POST", "/nodes/{node_id}/undrain"): {"all"},
    ("DELETE", "/nodes/{node_id}"): {"all"},
    ("POST", "/nodes/{node_id}/cordon"): {"all"},
    ("POST", "/nodes/{node_id}/uncordon"): {"all"},
}


def bearer(key: str) -> str:
    return f"Bearer {key}"


def write(tmp_path: Path, text: str, name: str = "keys.toml") -> Path:
    """Write the file whole, as an operator should (a watcher never sees it half written)."""
    path = tmp_path / name
    fresh = path.with_suffix(".new")
    fresh.write_text(text)
    os.replace(fresh, path)
    return path


# -- the scope table --------------------------------------------------------------------------


names = st.text(alphabet="abcxyz-", min_size=1, max_size=4)
scopes = st.one_of(
    st.just(AdminScope("r", "read")),
    st.just(FULL_ADMIN),
    st.frozensets(names, min_size=1, max_size=3).map(lambda c: AdminScope("o", "operate", c)),
)


@given(scope=scopes, route=st.sampled_from(sorted(EXPECTED)), cluster=names, head=st.booleans())
def test_a_scope_allows_a_route_iff_the_table_says_so(
    scope: AdminScope, route: tuple[str, str], cluster: str, head: bool
) -> None:
    method, path = route
    if head and method != "GET":
        return
    need = route_need("HEAD" if head else method, path)
    allowed = scope.scope in EXPECTED[route]
    if scope.scope == "operate" and "read" not in EXPECTED[route]:
        # operate reaches the cluster-changing routes, for its own clusters only.
        allowed = "{name}" in path and cluster in scope.clusters
    assert need is not None
    assert scope.allows(need, cluster) == allowed


def test_every_route_of_the_app_is_in_the_table() -> None:
    app = control_app(cast(Bus, YesBus()))
    routes = {
        (r.method, r.resource.canonical) for r in app.router.routes() if r.resource is not None
    }
    assert {(m, p) for m, p in routes if m != "HEAD"} == set(ROUTE_NEEDS) == set(EXPECTED)
    assert route_need("GET", "/nope") is None


# -- the key file -----------------------------------------------------------------------------


def test_scoped_admin_keys_load(tmp_path: Path) -> None:
    ring = KeyRing.load(write(tmp_path, KEYS))
    assert ring.admin(bearer("gm-root")) == FULL_ADMIN
    assert ring.admin(bearer("gm-ro")) == AdminScope("ro", "read")
    team = AdminScope("llama-team", "operate", frozenset({"llama"}))
    assert ring.admin(bearer("gm-llama")) == ring.admin(bearer("gm-llama-2")) == team
    assert ring.admin(bearer("gm-ops")) == AdminScope("ops", "all")
    assert ring.admin(bearer("gm-acme")) is None  # a tenant key is no admin key
    assert ring.access(None, "read", "") == "no_key"
    assert ring.access(bearer("gm-ro"), "cluster", "llama") == "forbidden"
    assert ring.access(bearer("gm-llama"), "cluster", "llama") == "ok"
    assert ring.access(bearer("gm-llama"), "cluster", "mistral") == "forbidden"
    assert ring.access(bearer("gm-llama"), None, "") == "ok"  # no route: a 404 to come


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('[admins.a]\nkeys = ["k"]', "admins.a.scope: required, one of read, operate, all"),
        ('[admins.a]\nkeys = ["k"]\nscope = "write"', "admins.a.scope: required, one of"),
        ('[admins.a]\nscope = "read"', "admins.a.keys: required (one or more keys)"),
        ('[admins.a]\nkeys = []\nscope = "read"', "admins.a.keys: must hold at least one key"),
        (
            '[admins.a]\nkeys = ["k"]\nscope = "read"\nclusters = ["x"]',
            'admins.a.clusters: only with scope = "operate"',
        ),
        (
            '[admins.a]\nkeys = ["k"]\nscope = "operate"',
            'admins.a.clusters: scope = "operate" needs a non-empty list of cluster names',
        ),
        (
            '[admins.a]\nkeys = ["k"]\nscope = "operate"\nclusters = []',
            'admins.a.clusters: scope = "operate" needs',
        ),
        ('[admins.a]\nkeys = ["k"]\nscope = "all"\nrate = 1', "admins.a.rate: unknown field"),
        (
            'admin_keys = ["k"]\n[admins.a]\nkeys = ["k"]\nscope = "read"',
            "admins.a.keys[0]: duplicate key (also admin_keys[0])",
        ),
        ('admins = ["k"]', "admins: must be a table of [admins.<name>]"),
    ],
)
def test_bad_admin_tables_give_one_line(tmp_path: Path, text: str, message: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(KeyFileError) as caught:
        KeyRing.load(path)
    assert str(caught.value).startswith(f"{path}: {message}")
    assert "\n" not in str(caught.value)


def test_the_up_admin_key_file(tmp_path: Path) -> None:
    path = tmp_path / "data" / "admin-key"
    assert ensure_admin_key(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = path.read_text().strip()
    assert key.startswith("gm-admin-") and len(key) > 40
    assert not ensure_admin_key(path)  # kept: the same key next time
    assert path.read_text().strip() == key
    ring = KeyRing.load_admin_key(path)
    assert not ring.enabled  # tenant auth stays off on a local stack
    assert ring.admin(bearer(key)) == FULL_ADMIN
    assert ring.admin(None) is None
    assert not ring.api_open
    for bad in ("", "\n", "a b\n", "k1\nk2\n"):
        path.write_text(bad)
        with pytest.raises(KeyFileError, match="admin-key: "):
            KeyRing.load_admin_key(path)


# -- reloading --------------------------------------------------------------------------------


def test_reload_takes_new_keys_and_a_broken_file_keeps_the_old(tmp_path: Path) -> None:
    path = write(tmp_path, 'admin_keys = ["gm-old"]')
    ring = KeyRing.load(path)
    write(tmp_path, 'admin_keys = ["gm-new"]')
    with capture_logs() as logs:
        assert ring.reload()
    assert [e["event"] for e in logs] == ["keys_reloaded"]
    assert ring.is_admin(bearer("gm-new")) and not ring.is_admin(bearer("gm-old"))

    for broken in ("admin_keys = [", "tenants = 3", ""):
        write(tmp_path, broken)
        with capture_logs() as logs:
            assert not ring.reload()
        assert len(logs) == 1 and logs[0]["event"] == "keys_reload_failed", logs
        assert logs[0]["error"].startswith(f"{path}: ")
        assert ring.is_admin(bearer("gm-new"))
    path.unlink()
    assert not ring.reload()
    assert ring.is_admin(bearer("gm-new"))


def test_reload_keeps_the_bucket_of_a_tenant_whose_limits_did_not_change(tmp_path: Path) -> None:
    class Clock:
        def monotonic(self) -> float:
            return 0.0

        def wall_ns(self) -> int:
            return 0

    one = '[tenants.a]\nkeys = ["gm-a"]\nrate_per_s = 1\nburst = 1\n'
    path = write(tmp_path, one)
    ring = KeyRing.load(path, clock=Clock())
    tenant = ring.authenticate(bearer("gm-a"))
    assert tenant is not None
    assert ring.admit(tenant) == 0.0
    assert ring.admit(tenant) > 0
    write(tmp_path, one + 'admin_keys = ["gm-x"]\n'.replace("admin", "#"))
    assert ring.reload()
    assert ring.admit(tenant) > 0  # a reload is no way around a limit
    write(tmp_path, one.replace("burst = 1", "burst = 2"))
    assert ring.reload()
    assert ring.admit(tenant) == 0.0  # new limits: a new bucket


class RecordingLog:
    """A logger for `watch`: each line kept, and an event set when one comes."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self.came = asyncio.Event()

    def _line(self, event: str, **fields: Any) -> None:
        self.lines.append(event)
        self.came.set()

    info = warning = _line

    async def next(self) -> str:
        async with asyncio.timeout(5):
            await self.came.wait()
        self.came.clear()
        return self.lines[-1]


async def test_watch_reloads_when_the_file_changes(tmp_path: Path) -> None:
    path = write(tmp_path, 'admin_keys = ["gm-old"]')
    ring = KeyRing.load(path)
    log = RecordingLog()
    watcher = asyncio.create_task(ring.watch(log, interval=0.01))
    try:
        write(tmp_path, 'admin_keys = ["gm-new", "gm-other"]')  # before the first look, too
        assert await log.next() == "keys_reloaded"
        assert ring.is_admin(bearer("gm-new"))
        write(tmp_path, "admin_keys = [")
        assert await log.next() == "keys_reload_failed"
        write(tmp_path, 'admin_keys = ["gm-third"]')
        assert await log.next() == "keys_reloaded"
        # One line per change: the broken file was reported once, not at every look.
        assert log.lines == ["keys_reloaded", "keys_reload_failed", "keys_reloaded"]
        assert ring.is_admin(bearer("gm-third"))
    finally:
        watcher.cancel()


# -- the middleware -----------------------------------------------------------------------------


class YesBus:
    """A controller that says yes, with an empty page, to every verb."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def request(self, subject: str, data: bytes, *, timeout: float, **kw: Any) -> Msg:
        self.calls.append(subject)
        page = {"events": [], "next": 0, "head": 0}
        return Msg(subject=subject, data=msgspec.json.encode(ApiReply(ok=True, data=page)))

    async def publish(self, subject: str, data: bytes, **kw: Any) -> None:
        raise AssertionError("not used")

    async def subscribe(self, subject: str, *, queue: str = "") -> Any:
        raise AssertionError("not used")


CALLS: list[tuple[str, str, Any]] = [
    ("GET", "/clusters", None),
    ("GET", "/clusters/llama", None),
    ("GET", "/clusters/llama/history", None),
    ("GET", "/nodes", None),
    ("GET", "/events", None),
    ("PUT", "/clusters/llama", {"replicas": 1}),
    ("PATCH", "/clusters/llama", {"replicas": 1}),
    ("POST", "/clusters/llama/rollback", {}),
    ("DELETE", "/clusters/llama", None),
    ("PATCH", "/clusters/mistral", {"replicas": 1}),
    ("DELETE", "/clusters/mistral", None),
    ("POST", "/clusters", {"name": "llama"}),
    ("POST", "/nodes/gpu-1/drain", None),
    ("POST", "/nodes/gpu-1/undrain", None),
    ("DELETE", "/nodes/gpu-1", None),
]


@pytest.fixture
async def keyed(tmp_path: Path) -> AsyncIterator[tuple[TestClient[Any, Any], YesBus]]:
    bus = YesBus()
    root = web.Application()
    root.add_subapp(
        "/api/v1", control_app(cast(Bus, bus), keys=KeyRing.load(write(tmp_path, KEYS)))
    )
    async with TestClient(TestServer(root, host="127.0.0.1")) as client:
        yield client, bus


def expected_status(key: str, method: str, path: str) -> int:
    if key in ("", "gm-acme", "gm-nobody"):
        return 401
    if key in ("gm-root", "gm-ops") or method == "GET":
        return 200
    if key == "gm-llama" and path.startswith("/clusters/llama"):
        return 200
    return 403


@pytest.mark.parametrize("key", ["", "gm-acme", "gm-nobody", "gm-ro", "gm-llama", "gm-ops"])
async def test_each_key_reaches_what_its_scope_allows(
    keyed: tuple[TestClient[Any, Any], YesBus], key: str
) -> None:
    client, bus = keyed
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    for method, path, body in CALLS:
        before = len(bus.calls)
        resp = await client.request(method, f"/api/v1{path}", json=body, headers=headers)
        want = expected_status(key, method, path)
        got = resp.status if resp.status in (401, 403) else 200
        assert got == want, (key, method, path, await resp.text())
        if want != 200:
            error = (await resp.json())["error"]
            assert set(error) == {"message", "type"}
            assert error["type"] == ("admin_key_required" if want == 401 else "forbidden")
            assert "\n" not in error["message"]
            assert len(bus.calls) == before  # refused before the controller is asked
        if want == 401:
            assert resp.headers["WWW-Authenticate"] == "Bearer"


async def test_unknown_routes_need_a_key_first(keyed: tuple[TestClient[Any, Any], YesBus]) -> None:
    client, _ = keyed
    assert (await client.get("/api/v1/nope")).status == 401
    assert (
        await client.get("/api/v1/nope", headers={"Authorization": "Bearer gm-ro"})
    ).status == 404
    resp = await client.put("/api/v1/clusters", headers={"Authorization": "Bearer gm-ro"})
    assert resp.status == 405


async def test_no_admin_keys_closes_the_api_saying_why(tmp_path: Path) -> None:
    for keys, says in [
        (KeyRing.open(), "no admin key; give it a key file with admin keys (--keys FILE)"),
        (KeyRing.load(write(tmp_path, '[tenants.a]\nkeys = ["gm-a"]\nrate_per_s = 0')), "has none"),
    ]:
        root = web.Application()
        root.add_subapp("/api/v1", control_app(cast(Bus, YesBus()), keys=keys))
        async with TestClient(TestServer(root, host="127.0.0.1")) as client:
            for header in ({}, {"Authorization": "Bearer gm-a"}):
                resp = await client.get("/api/v1/nodes", headers=header)
                assert resp.status == 401
                assert says in (await resp.json())["error"]["message"]


def test_up_key_file_is_private_even_with_a_loose_umask(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        assert ensure_admin_key(tmp_path / "k")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "k").stat().st_mode) == 0o600
