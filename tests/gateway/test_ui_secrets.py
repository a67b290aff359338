"""The dashboard (gateway/ui) over the real controller's API: a cluster with a secret shows its
reference, never its value, on every page and data route."""

from __future__ import annotations

from typing import Any

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from events.secret_store import reference
from gateway.auth import KeyRing
from gateway.ui import mount
from tests.control.harness import fleet

ADMIN = "gm-admin-0123456789"
TOKEN = "hf_dashboardSECRET0123456789"
PAGES = ("fleet", "clusters", "events", "incidents")


async def test_the_dashboard_shows_the_reference_only() -> None:
    async with fleet(1) as f:
        spec = {"name": "llama", "command": "serve", "secret_env": {"HF_TOKEN": TOKEN}}
        assert (await f.api("cluster.create", spec)).ok
        root = web.Application()
        mount(root, f.bus, KeyRing.from_mapping({"admin_keys": [ADMIN]}))
        client: TestClient[Any, Any] = TestClient(TestServer(root, host="127.0.0.1"))
        await client.start_server()
        try:
            auth = {"Authorization": f"Bearer {ADMIN}"}
            seen = ""
            for path in [f"/ui/{p}" for p in PAGES] + [f"/ui/data/{p}" for p in PAGES]:
                resp = await client.get(path, headers=auth)
                assert resp.status == 200, path
                text = await resp.text()
                assert TOKEN not in text, path
                seen += text
            assert reference(TOKEN) in seen  # the clusters' and the events' views name it
        finally:
            await client.close()
