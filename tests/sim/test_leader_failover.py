"""Standby controllers in the simulator (`controllers = 2`): the lease on virtual time, a frozen
process, the leader faults, and the one_writer invariant, with the planted bug it must catch."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from actors.errors import ControllerError
from actors.leadership import LeaseLost, LeaseTaken
from sim import SimNetwork, run_simulation
from sim.env import SeededStreams
from sim.lease import REQUEST_TIMEOUT_S, LeaseKey, SimLease
from sim.loop import process_context
from sim.run import SCENARIOS, run_scenario
from sim.scenario import ClusterPlan, FaultPlan, Fleet, Scenario, from_mapping, load
from tests.sim.planted_bugs import plant_expiry_ignored, plant_no_term_fence

REPO = Path(__file__).resolve().parents[2]


def test_the_lease_key_is_created_once_renewed_at_its_revision_and_expires() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        network = SimNetwork(SeededStreams(1)("net"))
        key = LeaseKey(loop.time)
        a = SimLease(key, network, "a", SeededStreams(1)("a"))
        b = SimLease(key, network, "b", SeededStreams(1)("b"))
        seen = []
        first = await a.create(b"a", 3.0)
        with pytest.raises(LeaseTaken):
            await b.create(b"b", 3.0)
        second = await a.renew(b"a", first, 3.0)
        assert second > first
        with pytest.raises(LeaseLost):
            await b.renew(b"b", first, 3.0)  # not at the revision it names
        await asyncio.sleep(3.1)  # not renewed: expired on the server
        assert await b.read() is None
        third = await b.create(b"b", 3.0)
        assert third > second  # a new term: revisions are never reused
        with pytest.raises(LeaseLost):
            await a.renew(b"a", second, 3.0)
        await a.release(second)  # not its revision any more: nothing happens
        assert await a.read() == (b"b", third)
        await b.release(third)
        assert await a.read() is None
        # Cut off from NATS: the request times out, and reaches nothing.
        network.isolate("a")
        began = loop.time()
        with pytest.raises(ControllerError):
            await a.create(b"a", 3.0)
        assert loop.time() - began == pytest.approx(REQUEST_TIMEOUT_S)
        assert await b.read() is None
        seen.append("done")
        return seen

    assert run_simulation(main()) == ["done"]


def test_a_frozen_process_runs_nothing_until_it_is_thawed() -> None:
    async def main() -> list[tuple[str, float]]:
        loop = asyncio.get_running_loop()
        ticks: list[tuple[str, float]] = []

        async def ticking(name: str) -> None:
            while True:
                await asyncio.sleep(1.0)
                ticks.append((name, loop.time()))

        tasks = [
            loop.create_task(ticking(name), context=process_context(name)) for name in ("a", "b")
        ]
        await asyncio.sleep(1.5)
        loop.freeze("a")  # type: ignore[attr-defined]
        await asyncio.sleep(3.0)
        loop.thaw("a")  # type: ignore[attr-defined]
        await asyncio.sleep(1.2)
        for task in tasks:
            task.cancel()
        return ticks

    ticks = run_simulation(main())
    assert [t for name, t in ticks if name == "b"] == [1.0, 2.0, 3.0, 4.0, 5.0]
    # a's timer came due at 2.0 while frozen; it ran at the thaw (4.5), then on from there.
    assert [t for name, t in ticks if name == "a"] == [1.0, 4.5, 5.5]


def _ha(*faults: FaultPlan, duration_s: float = 60.0) -> Scenario:
    return Scenario(
        name="ha",
        duration_s=duration_s,
        settle_s=40.0,
        fleet=Fleet(nodes=4),
        clusters=(ClusterPlan(name="llama", replicas=2),),
        rate_per_s=4.0,
        faults=faults,
        controllers=2,
    )


def _led(timeline: list[str]) -> list[tuple[float, str]]:
    """(when, who) for each term begun."""
    return [
        (float(line.split()[0]), line.split()[2])
        for line in timeline
        if line.split()[1:2] == ["leader"]
    ]


def test_a_standby_takes_over_within_the_lease_when_the_leader_crashes() -> None:
    result, world = run_scenario(
        _ha(FaultPlan(at_s=20.0, kind="leader_crash", duration_s=10.0)), seed=4
    )
    assert result.violations == []
    led = _led(result.timeline)
    assert len(led) == 2 and led[0][1] != led[1][1]
    # The key expires 3 s after the last renewal (every 1 s); the standby looks every 0.25 s.
    assert 20.0 + 2.0 <= led[1][0] <= 20.0 + 3.3
    assert world.controllers is not None
    assert world.checker.appends_by_term and len(world.checker.appends_by_term) == 2
    assert all(r["availability"] >= 0.99 for r in result.availability.values())


def test_a_leader_woken_past_its_lease_writes_nothing_and_steps_down() -> None:
    result, world = run_scenario(
        _ha(FaultPlan(at_s=20.0, kind="leader_pause", duration_s=6.0)), seed=2
    )
    assert result.violations == []
    led = _led(result.timeline)
    assert len(led) == 2 and led[0][1] != led[1][1] and led[1][0] < 26.0
    controllers = world.controllers
    assert controllers is not None
    paused = next(p for p in controllers.history if p.name == led[0][1])
    assert paused.term not in {p.term for p in controllers.processes if p.leading}
    assert paused.leadership.stepped_down, "it found out it no longer leads"
    assert sum(f.refused for f in paused.fences) >= 1, "it tried to write on waking"


def test_the_term_fence_stops_a_leader_that_ignores_its_expiry(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fence in the log holds where the one in the process failed: the woken leader's
    appends are refused once its successor recorded its term."""
    plant_expiry_ignored(monkeypatch)
    result, world = run_scenario(
        _ha(FaultPlan(at_s=20.0, kind="leader_pause", duration_s=6.0)), seed=2
    )
    assert result.violations == []
    controllers = world.controllers
    assert controllers is not None
    led = _led(result.timeline)
    paused = next(p for p in controllers.history if p.name == led[0][1])
    assert sum(f.refused for f in paused.fences) >= 1, "its appends were refused"


def test_one_writer_catches_a_leader_that_ignores_its_expiry_without_the_term_fence(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plant_expiry_ignored(monkeypatch)
    plant_no_term_fence(monkeypatch)
    result, _ = run_scenario(_ha(FaultPlan(at_s=20.0, kind="leader_pause", duration_s=6.0)), seed=2)
    assert "one_writer" in {v["invariant"] for v in result.violations}


def test_a_scenario_takes_the_number_of_controllers() -> None:
    assert load(SCENARIOS / "leader-failover.toml").controllers == 2
    assert from_mapping({"duration_s": 10}).controllers == 1
    with pytest.raises(ValueError, match="controllers: must be a whole number"):
        from_mapping({"duration_s": 10, "controllers": 0})
    with pytest.raises(ValueError, match=r"faults\[0\].duration_s: a pause needs one"):
        from_mapping({"duration_s": 10, "faults": [{"at_s": 1, "kind": "leader_pause"}]})


def test_leader_failover_is_byte_identical_under_different_hash_seeds() -> None:
    outputs = []
    for hash_seed in ("1", "3"):
        done = subprocess.run(
            [sys.executable, "-m", "gpumesh", "sim", "run", "leader-failover", "--seed", "2"],
            cwd=REPO,
            env={**os.environ, "PYTHONHASHSEED": hash_seed},
            capture_output=True,
            timeout=120,
            check=False,
        )
        outputs.append(done.stdout)
    assert outputs[0] == outputs[1]
    assert b"fault  nats_server_loss" in outputs[0] and b"leader controller-" in outputs[0]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_leader_failover_runs_clean(seed: int) -> None:
    """Seed 1 once served two epochs at once: a leader woken past its lease answered the
    heartbeats queued for it with leases of its old term, and an agent that had not heard the
    new term took one. Two changes closed it: the controller's publishes are fenced by the
    lease (FencedBus), and the leader's subscriptions are in no queue group, so a frozen
    leader no longer takes a share of the heartbeats the new leader must hear."""
    result, _ = run_scenario(load(SCENARIOS / "leader-failover.toml"), seed)
    assert result.violations == []
    assert all(a["availability"] >= 0.94 for a in result.availability.values())
    kinds = {line.split()[2] for line in result.timeline if line.split()[1:2] == ["fault"]}
    assert {"leader_crash", "leader_pause", "nats_server_loss", "controller_partition"} <= kinds


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_leader_frozen_past_its_lease_costs_no_node_its_lease(
    monkeypatch: pytest.MonkeyPatch, seed: int
) -> None:
    """A frozen leader keeps its subscriptions: heartbeats reach it and go unanswered, with no
    "no responders". Each agent watches the leader's renewals and, once the last one it saw is
    LEADER_ACTS_S old and the lease (read through its stream's leader) still holds it, keeps
    its lease (nodeagent/agent.py). Without that, every node's lease lapsed 1.4-2.4 s into the
    pause, before the standby led (20 of 20 seeds)."""
    import nodeagent.agent as agent_module

    lapsed: set[str] = set()
    real = agent_module.Agent.fenced

    def fenced(self: agent_module.Agent, replica_id: str, epoch: int) -> str:
        why = real(self, replica_id, epoch)
        if why.startswith("this node's lease lapsed") and 20 < self._env.clock.monotonic() < 27:
            lapsed.add(self.config.node_id)
        return why

    monkeypatch.setattr(agent_module.Agent, "fenced", fenced)
    result, _ = run_scenario(_ha(FaultPlan(at_s=20.0, kind="leader_pause", duration_s=6.0)), seed)
    assert result.violations == []
    assert lapsed == set()
    assert any("leader controller-" in line for line in result.timeline)
