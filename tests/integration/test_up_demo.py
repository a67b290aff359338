"""`gpumesh up --demo echo` as a user meets it: it comes up, says where everything is, the curl
line it prints works through the gateway, and Ctrl-C stops every process it started, exit code
0. The real models' demos (`--demo`, `--demo smollm2`, `--demo embeddings`):
tests/integration/test_real_models.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import signal
import stat
import subprocess
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

from tests.integration.stack import kill_marked, marked_pids, pid_alive
from tests.integration.up_process import api, connect_admin, reap, start_up

pytestmark = pytest.mark.integration


def read_summary(up: subprocess.Popen[bytes]) -> dict[str, str]:
    """The summary `gpumesh up` prints once it is up, as label -> rest of the line; the whole
    of it under "text"."""
    assert up.stdout is not None
    summary: dict[str, str] = {}
    text: list[str] = []
    for raw in up.stdout:
        text.append(raw.decode())
        label, sep, rest = raw.decode().strip().partition(":")
        if sep:
            summary[label] = rest.strip()
        if label == "stop":
            break
    summary["text"] = "".join(text)
    return summary


def scrape(url: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """GET a /metrics URL: metric family -> its samples' labels -> value."""
    from prometheus_client.parser import text_string_to_metric_families

    assert url.startswith("http://127.0.0.1:"), url  # loopback only
    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        family.name: {tuple(sorted(s.labels.items())): s.value for s in family.samples}
        for family in text_string_to_metric_families(text)
    }


def curl(command: str) -> dict[str, Any]:
    """Do what the printed `curl -s URL -H HEADER -d BODY` does, with urllib."""
    argv = shlex.split(command)
    assert argv[:2] == ["curl", "-s"], argv
    url, headers, body = argv[2], {}, b""
    flags = iter(argv[3:])
    for flag in flags:
        value = next(flags)
        if flag == "-H":
            name, _, text = value.partition(":")
            headers[name.strip()] = text.strip()
        else:
            assert flag == "-d", argv
            body = value.encode()
    assert url.startswith("http://127.0.0.1:"), url  # loopback only
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.status == 200
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def http_status(url: str, key: str) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        return exc.code


async def test_up_demo_comes_up_serves_the_printed_curl_and_stops_on_sigint(
    tmp_path: Path,
) -> None:
    data_dir = tmp_path / "stack"
    marker = f"demo-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    up = start_up(data_dir, marker, nodes=3, extra=["--demo", "echo"])
    try:
        summary = await asyncio.wait_for(asyncio.to_thread(read_summary, up), timeout=60)
        log = tmp_path / "up.log"
        assert "stop" in summary, log.read_text()[-3000:]
        gateway = summary["gateway"].split()[0]
        assert gateway.startswith("http://127.0.0.1:") and gateway.endswith("/v1"), summary
        nats = summary["NATS"].split()[0]
        assert nats.startswith(("tls://127.0.0.1:", "nats://127.0.0.1:")), summary
        ask = summary["ask it"]
        assert ask.startswith(f"curl -s {gateway}/chat/completions "), ask

        # It says it is up only once the demo cluster is whole.
        bus = await connect_admin(data_dir, nats, "test-up-demo")
        try:
            cluster = await api(bus, "cluster.get", {"name": "echo"})
        finally:
            await bus.close()
        assert (cluster["desired"], cluster["ready"]) == (3, 3), cluster
        assert len({r["node_id"] for r in cluster["replicas"]}) == 3  # spread over the nodes

        # The control API takes the admin key `up` made (0600, in the data directory).
        key_file = data_dir / "admin-key"
        assert summary["control API"].split()[0] == gateway.removesuffix("/v1") + "/api/v1"
        assert str(key_file) in summary["the API"], summary
        assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
        nodes = f"{gateway.removesuffix('/v1')}/api/v1/nodes"
        assert await asyncio.to_thread(http_status, nodes, "") == 401
        assert await asyncio.to_thread(http_status, nodes, key_file.read_text().strip()) == 200
        # So does the dashboard it prints (gateway/ui): its data with the key, none without.
        dashboard = summary["dashboard"].split()[0]
        assert dashboard == gateway.removesuffix("/v1") + "/ui", summary
        fleet = f"{dashboard}/data/fleet"
        assert await asyncio.to_thread(http_status, fleet, "") == 401
        assert await asyncio.to_thread(http_status, fleet, key_file.read_text().strip()) == 200

        # The controller (in `up`'s process) and each agent serve Prometheus metrics on a port
        # of their own, printed with a scrape configuration for them all.
        where = dict(re.findall(r"(controller|node-\d+)\s+(http://\S+/metrics)", summary["text"]))
        assert sorted(where) == ["controller", "node-0", "node-1", "node-2"], summary["text"]
        assert "job_name: gpumesh-controller" in summary["text"], summary["text"]
        controller = await asyncio.to_thread(scrape, where["controller"])
        assert sum(controller["gpumesh_controller_nodes"].values()) == 3, controller
        assert controller["gpumesh_controller_leader"] == {(): 1.0}
        agent = await asyncio.to_thread(scrape, where["node-1"])
        assert agent["gpumesh_agent_registered"] == {(("node", "node-1"),): 1.0}, agent

        answer = await asyncio.to_thread(curl, ask)
        assert answer["object"] == "chat.completion" and answer["model"] == "echo", answer
        assert "hello gpumesh" in answer["choices"][0]["message"]["content"], answer

        up.send_signal(signal.SIGINT)
        code = await asyncio.to_thread(up.wait, 30)
        assert code == 0, log.read_text()[-3000:]
        # The agents stopped their workloads on the way out: nothing it started is left.
        assert [pid for pid in marked_pids(marker) if pid_alive(pid)] == []
    finally:
        reap(up)
        await asyncio.to_thread(kill_marked, marker)
