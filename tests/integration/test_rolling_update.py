"""A rolling update costs no request, end to end with real processes.

Three echo replicas serve clients through a gateway, half of them streaming; `cluster.apply`
records revision 2 (a new env var), and the controller replaces the replicas one at a time
(max_surge 1, max_unavailable 0): each new replica is routed to before an old one is stopped,
and a stopped one drains what it has in flight. No request fails and no stream is cut.
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp.test_utils import TestClient

from tests.integration.gateway_kit import running_gateway, until
from tests.integration.stack import Stack, echo_spec
from tests.integration.test_cluster_cli import Cli
from tests.integration.test_control_rest import body, controller, error, rest
from tests.integration.test_failover_processes import serving
from tests.integration.test_gateway_stack import start_clients

pytestmark = pytest.mark.integration
__all__ = ["controller", "rest"]  # fixtures, shared with test_control_rest.py


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_rolling_update_under_clients_fails_no_request(
    tmp_path: Path, nats_server_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    stack = Stack(tmp_path / "stack", agents=3, nats_binary=nats_server_binary)
    async with stack:
        spec = echo_spec(3)
        spec["command"] += " --ttft-ms 20 --tokens-per-s 400"  # requests in flight, always
        spec["env"] = {"GREETING": "v1"}
        await stack.create_cluster(spec)
        await serving(stack, 3)
        async with running_gateway(stack.bus) as gw:
            await until(lambda: len(gw.router.routes("echo")) >= 3, within=10)
            stop = asyncio.Event()
            log: list[Any] = []
            async with aiohttp.ClientSession() as session, asyncio.TaskGroup() as tasks:
                start_clients(tasks, session, gw.url, stop, log)
                await asyncio.sleep(1.0)
                began = time.monotonic()
                applied = await stack.api(
                    "cluster.apply", {**spec, "env": {"GREETING": "v2"}}, timeout=30.0
                )
                assert applied["revision"] == 2 and applied["changed"], applied
                routed = []  # how many replicas the gateway routes to, sampled meanwhile
                while (await stack.cluster("echo"))["rolled_out"] != 2:
                    routed.append(len(gw.router.routes("echo")))
                    assert time.monotonic() - began < 30.0, "not rolled out within 30 s"
                    await asyncio.sleep(0.05)
                took = time.monotonic() - began
                await asyncio.sleep(1.0)  # clients on the new replicas only, for a while
                stop.set()
        failed = [e for e in log if e[2] != 200]
        cut = [e for e in log if e[2] == 200 and e[1] and "data: [DONE]" not in e[3]]
        summary = (
            f"rolled out in {took:.1f} s; {len(log)} requests, {len(failed)} failed, "
            f"{len(cut)} streams cut; routed min {min(routed)} max {max(routed)}"
        )
        with capsys.disabled():
            print(summary)
        assert log and failed == [] and cut == [], (failed[:3], cut[:3])
        assert min(routed) >= 3, routed  # capacity held through the rollout
        cluster = await stack.cluster("echo")
        ready = [r for r in cluster["replicas"] if r["status"] == "ready"]
        assert len(ready) == 3 and {r["revision"] for r in ready} == {2}, cluster
        stops = [e.payload.reason for e in stack.events("replica.stopping.v1")]  # type: ignore[attr-defined]
        assert stops == ["replaced by revision 2"] * 3, stops
        assert stack.events("cluster.rolled_out.v1")
        # The workloads of revision 1 are gone: only the three new ones run.
        await serving(stack, 3)

        # The CLI's verbs on the same stack: history, rollback and their one-line errors.
        cli = Cli(stack, capsys)
        code, out, _ = await cli("cluster", "history", "echo")
        assert code == 0 and out.splitlines()[0].split()[:3] == ["REVISION", "RECORDED", "REASON"]
        assert 'env.GREETING: "v1" -> "v2" (current) (rolled out)' in out, out
        history = await cli.json("cluster", "history", "echo")
        assert [r["revision"] for r in history["revisions"]] == [1, 2]
        for argv, message in [
            (["--to", "2"], "revision 2 is the current revision of cluster 'echo'"),
            (["--to", "9"], "unknown revision 9 of cluster 'echo' (revisions: 1..2)"),
            (["--to", "-1"], "--to: must be a revision number (1 or more), got -1"),
        ]:
            code, out, err = await cli("cluster", "rollback", "echo", *argv)
            assert code != 0 and message in err and len(err.strip().splitlines()) == 1, err
        bad = tmp_path / "bad.toml"
        bad.write_text('name = "echo"\ncommand = "x"\n[rollout]\nmax_surge = 0\n')
        code, _, err = await cli("cluster", "apply", "-f", str(bad))
        assert code != 0 and len(err.strip().splitlines()) == 1, err
        assert f"{bad}: rollout: max_surge and max_unavailable cannot both be 0" in err, err
        rolled = await cli.json("cluster", "rollback", "echo")
        assert rolled["revision"] == 3 and rolled["spec"]["env"] == {"GREETING": "v1"}


# -- the same verbs over REST (gateway/control_routes.py), against a real controller --------


@pytest.mark.timeout(60)
async def test_apply_history_and_rollback_over_rest(rest: TestClient[Any, Any]) -> None:
    base = {"replicas": 0, "command": "serve --port {port}"}  # no nodes: nothing to place
    resp = await rest.put("/api/v1/clusters/llama", json=base)
    assert resp.status == 201, await resp.text()
    created = await body(resp)
    assert created["revision"] == 1 and created["changed"] and created["name"] == "llama"

    same = await rest.put("/api/v1/clusters/llama", json={**base, "name": "llama"})
    assert same.status == 200 and (await body(same))["changed"] is False
    changed = await body(await rest.put("/api/v1/clusters/llama", json={**base, "env": {"A": "2"}}))
    assert changed["revision"] == 2 and changed["message"] == "recorded revision 2"

    for payload, field, message in [
        ({**base, "name": "other"}, "$.name", "name: the body names 'other', the path 'llama'"),
        ({**base, "rollout": {"max_surge": 0, "max_unavailable": 0}}, "$.rollout", "rollout: "),
        ({**base, "rollout": {"max_surge": -1}}, "$.rollout.max_surge", "rollout.max_surge: "),
        ({**base, "rollout": {"max_unavailable": "x"}}, "$.rollout.max_unavailable", ""),
    ]:
        bad = await error(await rest.put("/api/v1/clusters/llama", json=payload), 400)
        assert bad["field"] == field and bad["message"].startswith(message), bad

    history = await body(await rest.get("/api/v1/clusters/llama/history"))
    assert [(r["revision"], r["reason"], r["change"]) for r in history["revisions"]] == [
        (1, "created", "created"),
        (2, "applied", 'env.A: (none) -> "2"'),
    ]
    await error(await rest.get("/api/v1/clusters/mistral/history"), 404)

    for payload, message in [
        ({"to": 2}, "revision 2 is the current revision of cluster 'llama'"),
        ({"to": 5}, "unknown revision 5 of cluster 'llama' (revisions: 1..2)"),
        ({"to": -1}, "to: Expected `int` >= 0"),
        ({"to": "1"}, "to: Expected `int`, got `str`"),
        ({"too": 1}, "too: Object contains unknown field `too`"),
    ]:
        bad = await error(await rest.post("/api/v1/clusters/llama/rollback", json=payload), 400)
        assert bad["message"].startswith(message), bad
        assert bad["field"] in ("$.to", "$.too"), bad
    rolled = await body(await rest.post("/api/v1/clusters/llama/rollback"))
    assert rolled["revision"] == 3 and rolled["spec"] == {"name": "llama", **base}
    assert rolled["message"] == "revision 3: the spec of revision 1"


@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_revision_whose_workload_crashes_is_rolled_back_on_its_own(
    tmp_path: Path, nats_server_binary: Path
) -> None:
    """With real agents and processes: revision 2's command exits at once; its replicas crash
    in place until the controller records an automatic rollback to revision 1's spec (as
    revision 3), with why; the cluster serves revision 1's workload again, and the replicas of
    revision 1 it kept never stopped serving."""
    stack = Stack(tmp_path / "stack", agents=3, nats_binary=nats_server_binary)
    async with stack:
        spec = echo_spec(2)
        await stack.create_cluster(spec)
        first = await serving(stack, 2)
        kept = {(r["replica_id"], r["epoch"]) for r in first["replicas"]}
        broken = {**spec, "command": f"{sys.executable} -c 'raise SystemExit(3)'"}
        applied = await stack.api("cluster.apply", broken, timeout=30.0)
        assert applied["revision"] == 2 and applied["changed"], applied
        rollback = await stack.wait_for_event("cluster.spec_changed.v1", timeout=60, rollback_to=1)
        assert rollback.payload.revision == 3
        assert rollback.payload.reason.startswith("automatic rollback to revision 1"), rollback
        assert "exit code 3" in rollback.payload.reason, rollback.payload.reason
        assert rollback.payload.spec.command == spec["command"]
        cluster = await serving(stack, 2)
        assert cluster["revision"] == 3
        # Revision 1's replicas were never taken out for the broken one (max_unavailable 0).
        assert {(r["replica_id"], r["epoch"]) for r in cluster["replicas"]} >= kept
