"""A workload never outlives its agent unseen, end to end with real processes: after SIGKILL of
an agent alone (its workloads left to the OS), the workloads die with it, and the agent started
again on the same data directory serves a clean replacement, with no orphan or duplicate
anywhere (issue: after `kill -9` of an agent its echo workload lived on holding its port)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.stack import Stack, echo_spec, pid_alive, started_stack
from tests.integration.test_failover_processes import serving

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture
async def stack(tmp_path: Path, nats_server_binary: Path) -> AsyncIterator[Stack]:
    async with started_stack(tmp_path / "stack", 2, nats_server_binary) as s:
        yield s


@pytest.mark.timeout(120)
async def test_an_agent_killed_alone_leaves_no_workload_behind(stack: Stack) -> None:
    await stack.create_cluster(echo_spec(2))
    await serving(stack, 2)
    node = sorted(stack.agents)[0]
    victims = stack.workloads(node)
    assert victims, f"no workload under {node}"
    records = sorted(p.name for p in (stack.root / "workloads" / node).glob("*.json"))
    assert records == sorted(f"{w.replica_id}-{w.epoch}.json" for w in victims)
    await stack.kill_agent(node, with_workloads=False)
    await stack.wait_until(
        lambda: not any(pid_alive(w.pid) for w in victims),
        timeout=10,
        why="the workloads die with their agent",
    )
    stack.start_agent(node)
    # serving() requires every workload to run under the agent the controller names, and no
    # other workload process anywhere.
    await serving(stack, 2)
    # The new run found the records of the old one, their workloads already gone, and kept
    # only those of what it runs now.
    now = sorted(f"{w.replica_id}-{w.epoch}.json" for w in stack.workloads(node))
    assert sorted(p.name for p in (stack.root / "workloads" / node).glob("*.json")) == now
