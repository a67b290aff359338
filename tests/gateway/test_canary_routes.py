"""The canary's REST routes (`POST /api/v1/clusters/{name}/canary|promote|abort`) against a
fake control API on the bus: what each sends, what its bad input earns, how the controller's
refusals come back, and who may call them."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from events.contract import subjects
from events.contract.messages import ApiReply, CanaryEndRequest, CanaryRequest
from gateway.auth import KeyRing
from gateway.control_routes import control_app
from runtime.env import Bus, Msg

SPEC = {"command": "vllm serve {model} --port {port} --max-model-len 8192", "replicas": 4}


def view(name: str, canary: dict[str, Any] | None) -> dict[str, Any]:
    return {"name": name, "desired": 4, "ready": 4, "revision": 2, "canary": canary}


class FakeControlApi:
    """Answers the canary verbs as the controller does (actors/control_api.py): the request
    decoded with the contract's own struct, a weight outside 1..99 refused in one line."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.canary: dict[str, Any] | None = None

    async def request(self, subject: str, data: bytes, *, timeout: float, **kw: Any) -> Msg:
        verb = subject.removeprefix(f"{subjects.PREFIX}.api.")
        try:
            reply = ApiReply(ok=True, data=self.answer(verb, data))
        except ValueError as exc:
            reply = ApiReply(ok=False, error=str(exc))
        return Msg(subject=subject, data=msgspec.json.encode(reply))

    def answer(self, verb: str, data: bytes) -> Any:
        if verb == "cluster.canary":
            req = msgspec.json.decode(data, type=CanaryRequest)
            self.calls.append((verb, req))
            if req.name != "llama":
                raise ValueError(f"unknown cluster {req.name!r} (known: llama)")
            if not 1 <= req.weight <= 99:
                raise ValueError(
                    f"weight: must be 1..99 (percent of the requests), got {req.weight}"
                )
            if "gpu" in req.spec and not isinstance(req.spec["gpu"].get("count", 1), int):
                raise ValueError("gpu.count: Expected `int`, got `str`")
            if self.canary is not None:
                raise ValueError(
                    f"cluster 'llama' already has a canary ({self.canary['cluster']}): "
                    "promote or abort it first"
                )
            self.canary = {"cluster": "llama-canary", "weight": req.weight}
            return view(req.name, self.canary)
        assert verb in ("cluster.promote", "cluster.abort"), verb
        end = msgspec.json.decode(data, type=CanaryEndRequest)
        self.calls.append((verb, end))
        if self.canary is None:
            raise ValueError(f"cluster {end.name!r} has no canary to {verb.split('.')[1]}")
        self.canary = None
        return view(end.name, None) | {"changed": verb == "cluster.promote"}

    async def publish(self, subject: str, data: bytes, **kw: Any) -> None:
        raise AssertionError("not used")

    async def subscribe(self, subject: str, *, queue: str = "") -> Any:
        raise AssertionError("not used")


@pytest.fixture
async def api() -> AsyncIterator[tuple[TestClient[Any, Any], FakeControlApi]]:
    bus = FakeControlApi()
    root = web.Application()
    root.add_subapp("/api/v1", control_app(cast(Bus, bus)))
    async with TestClient(TestServer(root, host="127.0.0.1")) as client:
        yield client, bus


async def error_of(resp: Any) -> dict[str, str]:
    body = await resp.json()
    return cast(dict[str, str], body["error"])


async def test_canary_then_promote(api: tuple[TestClient[Any, Any], FakeControlApi]) -> None:
    client, bus = api
    resp = await client.post("/api/v1/clusters/llama/canary", json={"spec": SPEC, "weight": 10})
    assert resp.status == 200, await resp.text()
    assert (await resp.json())["canary"] == {"cluster": "llama-canary", "weight": 10}
    assert bus.calls == [("cluster.canary", CanaryRequest(name="llama", spec=SPEC, weight=10))]

    resp = await client.post("/api/v1/clusters/llama/promote", json={"reason": "p99 is fine"})
    assert resp.status == 200
    assert (await resp.json())["canary"] is None
    assert bus.calls[-1] == (
        "cluster.promote",
        CanaryEndRequest(name="llama", reason="p99 is fine"),
    )


async def test_abort_takes_an_empty_body(api: tuple[TestClient[Any, Any], FakeControlApi]) -> None:
    client, bus = api
    resp = await client.post("/api/v1/clusters/llama/canary", json={"spec": SPEC})
    assert resp.status == 200
    assert bus.calls[-1][1].weight == 10  # the contract's default
    resp = await client.post("/api/v1/clusters/llama/abort")
    assert resp.status == 200
    assert bus.calls[-1] == ("cluster.abort", CanaryEndRequest(name="llama"))


@pytest.mark.parametrize(
    ("path", "body", "field", "message"),
    [
        ("canary", {"spec": SPEC, "weight": "ten"}, "$.weight", "weight: Expected `int`"),
        ("canary", {"spec": SPEC, "weight": 1.5}, "$.weight", "weight: Expected `int`"),
        ("canary", {"weight": 10}, "$.spec", "missing required field `spec`"),
        ("canary", {"spec": "llama:v2", "weight": 10}, "$.spec", "spec: Expected `object`"),
        ("canary", {"spec": SPEC, "wieght": 10}, "$.wieght", "unknown field `wieght`"),
        ("promote", {"reason": 7}, "$.reason", "reason: Expected `str`"),
        ("abort", {"why": "x"}, "$.why", "unknown field `why`"),
    ],
)
async def test_bad_input_is_a_400_naming_the_field(
    api: tuple[TestClient[Any, Any], FakeControlApi],
    path: str,
    body: Any,
    field: str,
    message: str,
) -> None:
    client, bus = api
    resp = await client.post(f"/api/v1/clusters/llama/{path}", json=body)
    assert resp.status == 400
    error = await error_of(resp)
    assert (error["type"], error["field"]) == ("invalid_request", field)
    assert message in error["message"] and "\n" not in error["message"]
    assert bus.calls == []  # refused before the controller is asked


async def test_not_json_is_a_400(api: tuple[TestClient[Any, Any], FakeControlApi]) -> None:
    client, _ = api
    resp = await client.post("/api/v1/clusters/llama/canary", data=b"{spec")
    assert resp.status == 400
    error = await error_of(resp)
    assert error["field"] == "$" and error["message"].startswith("body: not valid JSON")
    resp = await client.post("/api/v1/clusters/llama/canary", json=[SPEC])
    assert resp.status == 400
    assert (await error_of(resp))["message"] == "body: Expected `object`, got `array`"


@pytest.mark.parametrize("weight", [0, 100, -5])
async def test_the_controller_refuses_a_weight_outside_1_to_99(
    api: tuple[TestClient[Any, Any], FakeControlApi], weight: int
) -> None:
    client, bus = api
    resp = await client.post("/api/v1/clusters/llama/canary", json={"spec": SPEC, "weight": weight})
    assert resp.status == 400
    assert await error_of(resp) == {
        "message": f"weight: must be 1..99 (percent of the requests), got {weight}",
        "type": "invalid_request",
        "field": "$.weight",
    }
    assert len(bus.calls) == 1  # the controller's to judge


async def test_a_spec_error_names_the_field_under_spec(
    api: tuple[TestClient[Any, Any], FakeControlApi],
) -> None:
    client, _ = api
    body = {"spec": {**SPEC, "gpu": {"count": "two"}}, "weight": 10}
    resp = await client.post("/api/v1/clusters/llama/canary", json=body)
    assert resp.status == 400
    error = await error_of(resp)
    assert (error["field"], error["message"]) == (
        "$.spec.gpu.count",
        "gpu.count: Expected `int`, got `str`",
    )


async def test_refusals_map_to_statuses(api: tuple[TestClient[Any, Any], FakeControlApi]) -> None:
    client, _ = api
    resp = await client.post("/api/v1/clusters/mistral/canary", json={"spec": SPEC})
    assert resp.status == 404
    assert (await error_of(resp))["type"] == "not_found"

    resp = await client.post("/api/v1/clusters/llama/promote")
    assert resp.status == 409
    assert await error_of(resp) == {
        "message": "cluster 'llama' has no canary to promote",
        "type": "conflict",
    }

    assert (await client.post("/api/v1/clusters/llama/canary", json={"spec": SPEC})).status == 200
    resp = await client.post("/api/v1/clusters/llama/canary", json={"spec": SPEC})
    assert resp.status == 409
    assert (await error_of(resp))["message"].startswith("cluster 'llama' already has a canary")


async def test_only_post(api: tuple[TestClient[Any, Any], FakeControlApi]) -> None:
    client, _ = api
    for path in ("canary", "promote", "abort"):
        resp = await client.get(f"/api/v1/clusters/llama/{path}")
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"


# -- who may call them -----------------------------------------------------------------------

KEYS = """
admin_keys = ["gm-root"]

[admins.ro]
keys = ["gm-ro"]
scope = "read"

[admins.llama-team]
keys = ["gm-llama"]
scope = "operate"
clusters = ["llama"]

[admins.mistral-team]
keys = ["gm-mistral"]
scope = "operate"
clusters = ["mistral"]
"""


@pytest.mark.parametrize(
    ("key", "status"),
    [("", 401), ("gm-ro", 403), ("gm-mistral", 403), ("gm-llama", 200), ("gm-root", 200)],
)
async def test_the_cluster_s_operators_may_canary_it(tmp_path: Path, key: str, status: int) -> None:
    path = tmp_path / "keys.toml"
    path.write_text(KEYS)
    os.chmod(path, 0o600)
    bus = FakeControlApi()
    root = web.Application()
    root.add_subapp("/api/v1", control_app(cast(Bus, bus), keys=KeyRing.load(path)))
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with TestClient(TestServer(root, host="127.0.0.1")) as client:
        for verb, body in (("canary", {"spec": SPEC}), ("promote", {}), ("abort", None)):
            if verb == "abort" and status == 200:
                assert (
                    await client.post(
                        "/api/v1/clusters/llama/canary", json={"spec": SPEC}, headers=headers
                    )
                ).status == 200
            resp = await client.post(f"/api/v1/clusters/llama/{verb}", json=body, headers=headers)
            assert resp.status == status, (verb, await resp.text())
    assert (len(bus.calls) > 0) == (status == 200)
