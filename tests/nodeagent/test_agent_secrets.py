"""The agent's side of secrets: it registers its public key, opens a StartReplica's sealed
values (for that node, replica and epoch only), reads `file:` references on the node, and hands
the values to the driver alone; a secret it cannot have fails the start, in one line."""

from __future__ import annotations

import random
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from events.cluster import ClusterSpec
from events.secret_store import reference
from nodeagent.config import AgentConfig, RestartPolicy
from nodeagent.workload.docker import docker_run_argv
from sim import run_simulation
from wire.sealing import NodeKey, aad, seal

from .harness import NODE, Harness, start

KEY = NodeKey(X25519PrivateKey.from_private_bytes(random.Random(3).randbytes(32)))
TOKEN = "hf_agentSideSecret42"
SPEC = ClusterSpec(
    name="chat",
    command="serve --port {port}",
    secret_env={"HF_TOKEN": reference(TOKEN)},
)
NO_RESTARTS = AgentConfig(node_id=NODE, restart=RestartPolicy(max_restarts=0))


def keyed(config: AgentConfig | None = None) -> Harness:
    h = Harness(config=config)
    h.agent.key = KEY
    return h


def test_the_key_is_registered_and_the_sealed_value_reaches_the_driver_only() -> None:
    async def scenario() -> None:
        h = keyed()
        async with h.running():
            box = seal(KEY.public, {"HF_TOKEN": TOKEN}, aad(NODE, "r1", 1))
            await h.send(start("r1", 1, spec=SPEC, secrets=box))
            reports = await h.reports.until(lambda r: r.state == "ready")
        assert h.registrations[0][1].sealing_key == KEY.public
        [workload] = h.driver.started
        assert workload.spec.secret_env == {"HF_TOKEN": TOKEN}
        assert not any(TOKEN in r.detail for r in reports)

    run_simulation(scenario())


def test_a_box_for_another_epoch_does_not_open_and_the_start_fails_in_one_line() -> None:
    async def scenario() -> None:
        h = keyed(NO_RESTARTS)
        async with h.running():
            box = seal(KEY.public, {"HF_TOKEN": TOKEN}, aad(NODE, "r1", 1))
            await h.send(start("r1", 2, spec=SPEC, secrets=box))
            (*_, failed) = await h.reports.until(lambda r: r.state == "failed")
        assert "do not open with this node's key" in failed.detail
        assert "\n" not in failed.detail and TOKEN not in failed.detail
        assert h.driver.started == []

    run_simulation(scenario())


def test_an_agent_without_a_key_takes_no_secret_env() -> None:
    async def scenario() -> None:
        h = Harness(config=NO_RESTARTS)
        async with h.running():
            await h.send(start("r1", 1, spec=SPEC))
            (*_, failed) = await h.reports.until(lambda r: r.state == "failed")
        assert h.registrations[0][1].sealing_key == ""
        assert "this agent has no sealing key: it cannot take secret_env" in failed.detail
        assert h.driver.started == []

    run_simulation(scenario())


def test_a_file_reference_is_read_on_the_node(tmp_path: Path) -> None:
    secret = tmp_path / "token"
    secret.write_text("from-a-file\n")
    spec = ClusterSpec(name="chat", command="x", secret_env={"T": f"file:{secret}"})

    async def scenario() -> None:
        h = keyed()
        async with h.running():
            await h.send(start("r1", 1, spec=spec))
            await h.reports.until(lambda r: r.state == "ready")
        assert h.driver.started[0].spec.secret_env == {"T": "from-a-file"}

    run_simulation(scenario())


def test_docker_gets_a_secrets_name_on_its_command_line_never_its_value() -> None:
    spec = ClusterSpec(name="chat", image="img", env={"A": "1"}, secret_env={"HF_TOKEN": TOKEN})
    argv = docker_run_argv(
        "docker", name="n", replica_id="r", epoch=1, spec=spec, gpu_indices=(),
        host="127.0.0.1", host_port=8000,
    )  # fmt: skip
    assert argv[argv.index("A=1") - 1 : argv.index("A=1") + 1] == ["-e", "A=1"]
    assert argv[argv.index("HF_TOKEN") - 1] == "-e"
    assert not any(TOKEN in arg for arg in argv)
