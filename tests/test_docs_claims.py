"""What README.md and docs/gateway.md say about behaviour, held to the code (issue 17, item 11).

Numbers the docs state are read out of the docs and compared with the constants they come
from; behaviour they describe is run on virtual time with the real controller (fast: no
processes). docs/security.md's remote-node recipe runs for real in
tests/integration/test_remote_node_recipe.py.
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import msgspec
import pytest

from events.contract.messages import RoutingUpdate
from gateway.router import Router
from gpumesh.cli import build_parser
from nodeagent.config import RestartPolicy
from sim import run_simulation
from tests.control.harness import ScriptedAgent, fleet

ROOT = Path(__file__).resolve().parent.parent
ORDINALS = {"first": 1, "second": 2, "third": 3, "fourth": 4, "fifth": 5, "sixth": 6}


def _prose(path: str) -> str:
    """The document with its line breaks folded, so a sentence reads as one line."""
    return " ".join((ROOT / path).read_text().split())


# -- README: a crashing workload -------------------------------------------------------------


def test_readme_crash_loop_numbers_are_the_agents_restart_policy() -> None:
    found = re.search(
        r"restarts in place after a back-off of ([\d.]+) s, doubling; the (\w+) failure "
        r"within ([\d.]+) s is a crash loop",
        _prose("README.md"),
    )
    assert found is not None, "README's crash-loop sentence changed: update this test"
    backoff, ordinal, window = float(found[1]), ORDINALS[found[2]], float(found[3])
    policy = RestartPolicy()
    # The agent restarts after each of the first `max_restarts` failures in the window and
    # gives up on the next one (nodeagent/replica.py: `recent > policy.max_restarts`).
    assert ordinal == policy.max_restarts + 1
    assert window == policy.window_s
    assert backoff == policy.backoff(1)
    assert policy.backoff(2) == 2 * policy.backoff(1)
    # Behaviour: tests/nodeagent/test_agent.py::test_a_crash_loop_backs_off_doubling_then_
    # reports_failed (4 failures, gaps 0.5/1/2 s), and with real processes
    # tests/integration/test_failover_processes.py::test_workload_crash_loop_restarts_in_place_
    # then_moves (same slot at epoch 2 on another node).


# -- README: what happens to a replica on a lost node ----------------------------------------

SPEC = {"name": "llama", "replicas": 2, "command": "gpumesh workload echo --port {port}"}


def test_readme_says_lost_nodes_replicas_keep_their_id_at_the_next_epoch() -> None:
    text = _prose("README.md")
    assert (
        "Replicas on offline or unhealthy nodes fail (an unhealthy node is told to stop them) "
        "and are placed again on another node under the same replica id at the next epoch "
        "(epoch 2 after a first move)" in text
    )
    assert "new replicas (new ids, epoch 1) start on good nodes" in text


@pytest.mark.parametrize("how", ["unhealthy", "offline"])
def test_a_lost_nodes_replica_is_placed_again_under_its_id_at_the_next_epoch(how: str) -> None:
    async def main() -> None:
        async with fleet(3) as f:
            assert (await f.api("cluster.create", SPEC)).ok
            await f.until(lambda: len(f.ready("llama")) == 2, within=10, why="2 ready")
            lost = f.state.replicas.replicas["llama-1"].node_id
            if how == "unhealthy":
                f.agents[lost].probe_error = "NVML_ERROR_GPU_IS_LOST"
            else:
                f.kill(lost)

            def moved() -> bool:
                r = f.state.replicas.replicas["llama-1"]
                return r.status == "ready" and r.node_id != lost

            await f.until(moved, within=15, why="llama-1 ready elsewhere")
            replica = f.state.replicas.replicas["llama-1"]
            assert replica.epoch == 2
            assert sorted(f.state.replicas.replicas) == ["llama-0", "llama-1"]  # no new id
            if how == "unhealthy":  # "an unhealthy node is told to stop them"
                await f.until(
                    lambda: ("llama-1", 1) in f.agents[lost].stopped, within=5, why="stopped"
                )

    run_simulation(main())


def test_when_no_node_fits_until_the_unhealthy_node_stopped_it_the_replacement_is_a_new_id() -> (
    None
):
    assert (
        "if no node fits until the unhealthy node has reported the replica stopped, the "
        "replacement is a new replica id at epoch 1 instead" in _prose("README.md")
    )

    async def main() -> None:
        async with fleet(1) as f:
            assert (await f.api("cluster.create", {**SPEC, "replicas": 1})).ok
            await f.until(lambda: f.ready("llama") == ["llama-0"], within=10, why="ready")
            f.agents["n0"].probe_error = "NVML_ERROR_GPU_IS_LOST"
            await f.until(
                lambda: f.state.replicas.replicas["llama-0"].status == "stopped",
                within=10,
                why="the unhealthy node stopped it; no other node to place it on",
            )
            await f.start_agent(ScriptedAgent("n1", f.bus, f.commands))
            await f.until(lambda: len(f.ready("llama")) == 1, within=15, why="replaced")
            new = f.state.replicas.replicas["llama-1"]
            assert (new.node_id, new.epoch, new.status) == ("n1", 1, "ready")
            old = f.state.replicas.replicas["llama-0"]
            assert (old.node_id, old.epoch, old.status) == ("n0", 1, "stopped")

    run_simulation(main())


# -- README: the docker driver ----------------------------------------------------------------


def test_readme_says_where_docker_is_tested_against_a_real_engine() -> None:
    status = next(
        line for line in (ROOT / "README.md").read_text().splitlines() if "docker drivers" in line
    )
    assert "NVML only against a stand-in" in status
    assert "tests/nodeagent/test_docker_engine.py" in status
    assert "tests/nodeagent/fake_docker.py" in status
    assert (ROOT / "tests/nodeagent/fake_docker.py").is_file()
    engine_tests = (ROOT / "tests/nodeagent/test_docker_engine.py").read_text()
    assert "docker import" in engine_tests and "no registry is reachable" in status
    # CI starts the engine that test runs against.
    assert "tests/nodeagent/test_docker_engine.py" in (ROOT / ".ci/run").read_text()


# -- docs/gateway.md -------------------------------------------------------------------------


def test_gateway_doc_says_nats_is_tls_by_default_in_up() -> None:
    text = _prose("docs/gateway.md")
    assert "NATS has no TLS" not in text
    assert "NATS is TLS, with one NKEY identity per process, by default in `gpumesh up`" in text
    args = build_parser().parse_args(["up"])
    assert args.insecure is False and args.nats is None  # so `up` secures its NATS
    # With real processes: tests/integration/test_secure_stack.py (`up` prints a tls:// URL).


def test_gateway_doc_says_a_spec_model_name_routes_to_its_cluster() -> None:
    text = _prose("docs/gateway.md")
    assert "plays no part in routing" not in text
    assert "a cluster spec's `model`, when it sets one other than the cluster's name, names" in text

    async def main() -> None:
        async with fleet(1) as f:
            spec = {**SPEC, "replicas": 1, "model": "llama-3-8b"}
            assert (await f.api("cluster.create", spec)).ok
            await f.until(lambda: f.ready("llama") == ["llama-0"], within=10, why="ready")
            update = msgspec.json.decode(f.controller.routing_update(), type=RoutingUpdate)
            assert update.models == {"llama-3-8b": "llama"}
            router = Router(f.env.clock, random.Random(1))
            assert router.apply(update)
            assert router.resolve("llama-3-8b") == "llama"
            assert router.resolve("llama") == "llama"  # its own name still answers
            assert router.models() == ["llama-3-8b"]  # what /v1/models lists
            assert router.choose("llama") is not None

    run_simulation(main())
