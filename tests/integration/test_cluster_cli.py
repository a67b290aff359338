"""`gpumesh cluster create|list|show|scale|delete`, text and --json, against a real controller.

The stack is real (nats-server, a `gpumesh controller` process, one agent process with fake
GPUs); the CLI runs in this process through `gpumesh.cli.main`, exactly as the command line
parses it, on a worker thread because each verb runs its own event loop.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest

from gpumesh.cli import main
from tests.integration.stack import Stack

pytestmark = pytest.mark.integration

SPEC = f"""
name = "echo"
replicas = 1
model = "echo"
command = "{shlex.quote(sys.executable)} -m gpumesh workload echo --port {{port}} --model {{model}}"
regions = ["eu-west"]

[gpu]
count = 1
"""


class Cli:
    def __init__(self, stack: Stack, capsys: pytest.CaptureFixture[str]) -> None:
        self.stack = stack
        self.capsys = capsys

    async def __call__(self, *argv: str) -> tuple[int, str, str]:
        # Warnings only: this process's own connections log at debug on the same stdout.
        common = ["--nats", self.stack.url, "--data-dir", str(self.stack.root)]
        common += ["--log-level", "warning"]
        self.capsys.readouterr()  # whatever was logged before this command is not its output
        code = await asyncio.to_thread(main, [*argv, *common])
        out, err = self.capsys.readouterr()
        return code, out, err

    async def json(self, *argv: str) -> Any:
        code, out, err = await self(*argv, "--json")
        assert code == 0, err
        return json.loads(out)

    async def until(self, predicate: Any, *argv: str, within: float, why: str) -> Any:
        """Run the verb (--json) until its answer satisfies `predicate`; these are other
        processes, and their API is what they announce through."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while True:
            data = await self.json(*argv)
            if predicate(data):
                return data
            assert loop.time() < deadline, f"not within {within:g} s: {why}: {data}"
            await asyncio.sleep(0.1)


async def test_cluster_verbs_end_to_end(
    tmp_path: Path, nats_server_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = tmp_path / "echo.toml"
    spec_file.write_text(SPEC)
    async with Stack(tmp_path / "stack", agents=1, nats_binary=nats_server_binary) as stack:
        cli = Cli(stack, capsys)

        assert await cli("cluster", "list") == (0, "no clusters\n", "")
        code, out, err = await cli("cluster", "create", "-f", str(spec_file))
        assert (code, out, err) == (0, "created cluster echo (1 replicas)\n", "")
        # Created twice is refused, in one line, with the JSON flag too.
        code, out, err = await cli("cluster", "create", "-f", str(spec_file), "--json")
        assert code == 1 and out == "" and err.startswith("gpumesh: error: ")
        assert "echo" in err and err.count("\n") == 1

        shown = await cli.until(
            lambda c: c["ready"] == 1, "cluster", "show", "echo", within=20, why="1 ready"
        )
        assert shown["desired"] == 1 and shown["unschedulable"] == ""
        assert shown["spec"]["regions"] == ["eu-west"]  # the TOML field reached the controller
        (replica,) = shown["replicas"]
        assert replica["node_id"] == "node-0" and replica["status"] == "ready"
        assert replica["why"].startswith("node-0: ")

        code, out, _ = await cli("cluster", "show", "echo")
        assert code == 0
        head, line = out.splitlines()
        assert head == "echo: 1/1 ready"
        assert line.split()[:5] == ["echo-0", "epoch", "1", "ready", "node-0"]
        assert replica["address"] in line and replica["why"] in line

        code, out, _ = await cli("cluster", "list")
        assert code == 0
        assert [row.split() for row in out.splitlines()] == [
            ["NAME", "READY", "UNSCHEDULABLE"],
            ["echo", "1/1"],
        ]
        listed = await cli.json("cluster", "list")
        assert [(c["name"], c["desired"], c["ready"]) for c in listed] == [("echo", 1, 1)]

        scaled = await cli.json("cluster", "scale", "echo", "2")
        assert scaled["name"] == "echo" and scaled["desired"] == 2
        await cli.until(
            lambda c: c["ready"] == 2, "cluster", "show", "echo", within=20, why="2 ready"
        )
        assert await cli("cluster", "scale", "echo", "1") == (
            0,
            "scaled echo to 1 replicas\n",
            "",
        )
        await cli.until(
            lambda c: [r["status"] for r in c["replicas"]].count("ready") == 1,
            "cluster",
            "show",
            "echo",
            within=20,
            why="scaled down to 1",
        )

        assert await cli.json("cluster", "delete", "echo") == {"name": "echo", "deleted": True}
        await cli.until(lambda c: c == [], "cluster", "list", within=20, why="deleted")
        code, out, err = await cli("cluster", "delete", "echo")
        assert code == 1 and "echo" in err
        # Text output of delete, on a second cluster.
        assert (await cli("cluster", "create", "-f", str(spec_file)))[0] == 0
        assert await cli("cluster", "delete", "echo") == (0, "deleted cluster echo\n", "")
        await cli.until(lambda c: c == [], "cluster", "list", within=20, why="deleted again")
        assert await cli("cluster", "list") == (0, "no clusters\n", "")


async def test_node_verbs_end_to_end(
    tmp_path: Path, nats_server_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    async with Stack(tmp_path / "stack", agents=1, nats_binary=nats_server_binary) as stack:
        cli = Cli(stack, capsys)
        await cli.until(lambda ns: len(ns) == 1, "nodes", within=20, why="node-0 registered")
        code, out, err = await cli("nodes", "undrain", "node-0")
        assert code == 1 and out == "" and err.count("\n") == 1 and "not drained" in err
        assert await cli("nodes", "drain", "node-0") == (0, "draining node-0\n", "")
        [node] = await cli.json("nodes")
        assert node["drained"] is True
        assert await cli.json("nodes", "undrain", "node-0") == {
            "node_id": "node-0",
            "drained": False,
        }
        code, out, err = await cli("nodes", "remove", "node-0")
        assert code == 1 and "healthy, not offline" in err and err.count("\n") == 1
        code, _, err = await cli("nodes", "remove", "nope")
        assert code == 1 and "unknown node 'nope'" in err


async def test_cluster_plan_end_to_end(
    tmp_path: Path, nats_server_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def spec(name: str, sharding: str) -> Path:
        path = tmp_path / f"{name}.toml"
        path.write_text(f'name = "{name}"\ncommand = "c"\n{sharding}')
        return path

    small = spec("small", "[sharding]\nweights_gib = 10\nlayers = 32\n")
    pair = spec("pair", "[sharding]\nweights_gib = 30\nlayers = 32\n")
    huge = spec("huge", '[sharding]\nweights_gib = 60\nlayers = 32\nparallelism = ["tensor"]\n')
    bare = spec("bare", "")
    async with Stack(tmp_path / "stack", agents=1, nats_binary=nats_server_binary) as stack:
        cli = Cli(stack, capsys)
        await cli.until(lambda ns: len(ns) == 1, "nodes", within=20, why="node-0 registered")

        plan = await cli.json("cluster", "plan", "-f", str(small))
        assert plan["fits"] and plan["gpus"] == 1
        assert [(s["node_id"], s["gpu_indices"]) for s in plan["stages"]] == [("node-0", [0])]
        code, out, err = await cli("cluster", "plan", "-f", str(pair))
        assert code == 0, err
        assert out.startswith("pair: 2 GPUs, estimated ")
        assert "node-0" in out and "0,1" in out

        code, out, err = await cli("cluster", "plan", "-f", str(huge))
        assert code == 1
        assert out.startswith("nothing fits huge, 60.0 GiB (60.0 weights + 0.0 KV cache)")
        assert "node-0: does not fit: 60.0 GiB needed, 43.2 GiB usable on 2 RTX4090" in out

        code, out, err = await cli("cluster", "plan", "-f", str(bare))
        assert code == 1
        assert "sharding: the spec has no [sharding] section to plan from" in err
        # Planning placed nothing.
        assert await cli.json("cluster", "list") == []


async def test_node_cordon_end_to_end(
    tmp_path: Path, nats_server_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = tmp_path / "echo.toml"
    spec_file.write_text(SPEC)
    async with Stack(tmp_path / "stack", agents=1, nats_binary=nats_server_binary) as stack:
        cli = Cli(stack, capsys)
        await cli.until(lambda ns: len(ns) == 1, "nodes", within=20, why="node-0 registered")
        code, out, err = await cli("nodes", "uncordon", "node-0")
        assert code == 1 and out == "" and err.count("\n") == 1 and "not cordoned" in err
        code, out, err = await cli("nodes", "cordon", "node-0", "--until", "2001-01-01T00:00:00Z")
        assert code == 1 and err.count("\n") == 1 and "is in the past" in err
        code, out, err = await cli("nodes", "cordon", "node-0", "--until", "soon")
        assert code == 1 and err.count("\n") == 1 and "--until: not a time or a duration" in err
        code, _, err = await cli("nodes", "cordon", "nope")
        assert code == 1 and "unknown node 'nope'" in err

        code, out, err = await cli(
            "nodes", "cordon", "node-0", "--until", "2h", "--reason", "kernel upgrade"
        )
        assert code == 0, err
        assert out.startswith("cordoned node-0 until 20") and out.endswith("Z: kernel upgrade\n")
        [node] = await cli.json("nodes")
        assert node["cordoned_until_ns"] > 0 and node["cordon_reason"] == "kernel upgrade"
        code, out, _ = await cli("nodes")
        assert "(cordoned)" in out
        assert (await cli("cluster", "create", "-f", str(spec_file)))[0] == 0
        [echo] = await cli.until(
            lambda cs: cs and cs[0]["unschedulable"], "cluster", "list", within=20, why="no fit"
        )
        assert "1 cordoned" in echo["unschedulable"]
        assert await cli.json("nodes", "uncordon", "node-0") == {
            "node_id": "node-0",
            "cordoned": False,
        }
        await cli.until(
            lambda cs: cs[0]["ready"] == 1, "cluster", "list", within=30, why="placed on node-0"
        )
        assert (await cli("nodes", "cordon", "node-0")) == (
            0,
            "cordoned node-0 until uncordoned: cordoned by operator\n",
            "",
        )
        assert await cli("nodes", "uncordon", "node-0") == (0, "uncordoned node-0\n", "")


async def test_create_and_scale_wait_until_ready_and_say_how_it_goes(
    tmp_path: Path, nats_server_binary: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec_file = tmp_path / "echo.toml"
    spec_file.write_text(SPEC)
    big = tmp_path / "big.toml"
    big.write_text(SPEC.replace('name = "echo"', 'name = "big"').replace("count = 1", "count = 8"))
    async with Stack(tmp_path / "stack", agents=2, nats_binary=nats_server_binary) as stack:
        cli = Cli(stack, capsys)
        code, out, err = await cli("cluster", "create", "-f", str(spec_file), "--wait")
        assert (code, out) == (0, "created cluster echo: 1 replicas ready\n"), err
        progress = err.splitlines()
        assert progress[-1] == "echo: 1/1 ready" and len(progress) >= 2, progress
        assert all(line.startswith("echo: ") for line in progress), progress
        scaled = await cli.json("cluster", "scale", "echo", "2", "--wait")
        assert scaled["ready"] == 2 and scaled["desired"] == 2
        # Nothing can hold 8 GPUs here: it says where it stands, in one line, and exits 1.
        code, out, err = await cli("cluster", "create", "-f", str(big), "--wait", "--timeout", "2")
        assert code == 1 and out == ""
        last = err.splitlines()[-1]
        assert last.startswith("gpumesh: error: not settled after 2 s: big: 0/1 ready"), err
        assert "unschedulable" in last
