"""The agent's decision logic on the virtual-time loop: MemoryBus, MemoryCommandQueue,
FakeGpuProbe and the in-memory workload driver. Timings are exact because time is virtual."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Coroutine
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from events.contract import subjects
from events.contract.messages import (
    Command,
    Fault,
    HeartbeatAck,
    RegisterReply,
    ReplicaState,
    StartReplica,
)
from nodeagent.config import AgentConfig, RestartPolicy
from nodeagent.gpu import Inventory, ProbeError
from nodeagent.workload.fake import SIGKILL_EXIT, SIGTERM_EXIT, FakeDriver
from sim import run_simulation

from .harness import NODE, Harness, start, states, stop, wait_until


def simulate(scenario: Coroutine[Any, Any, None]) -> None:
    run_simulation(scenario)


# Registration.


def test_registration_is_retried_until_a_controller_answers() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running(controller=False):
            await asyncio.sleep(10)
            assert not h.agent.registered
            h.start_controller()
            await wait_until(lambda: h.agent.registered)
            beat = await h.heartbeats.next()
        (at, register), *_ = h.registrations
        assert at > 10  # it kept trying while nobody answered
        assert register.node_id == NODE
        assert [(g.model, g.vram_mib) for g in register.gpus] == [("RTX4090", 24576)] * 2
        assert register.driver_version and register.address == "127.0.0.1"
        assert beat.seq == 1  # heartbeats begin once registered

    simulate(scenario())


def test_retry_back_off_is_jittered_from_the_env_and_repeats_for_a_seed() -> None:
    def first_registration(seed: int) -> float:
        async def scenario() -> float:
            h = Harness(seed=seed)
            async with h.running(controller=False):
                await asyncio.sleep(5)
                h.start_controller()
                await wait_until(lambda: h.agent.registered)
            return h.registrations[0][0]

        return run_simulation(scenario())

    assert first_registration(1) == first_registration(1)
    assert first_registration(1) != first_registration(2)


def test_a_rejected_or_garbled_reply_is_retried() -> None:
    async def scenario() -> None:
        h = Harness()
        h.reply = RegisterReply(accepted=False, error="unknown region")
        async with h.running():
            await wait_until(lambda: len(h.registrations) >= 3)
            assert not h.agent.registered
            h.reply = RegisterReply(accepted=True, heartbeat_interval_s=1.0)
            await wait_until(lambda: h.agent.registered)

    simulate(scenario())


def test_the_reply_sets_the_heartbeat_interval() -> None:
    async def scenario() -> None:
        h = Harness()
        h.reply = RegisterReply(accepted=True, heartbeat_interval_s=0.25)
        loop = asyncio.get_running_loop()
        async with h.running():
            await h.heartbeats.next()
            times = []
            for _ in range(4):
                await h.heartbeats.next()
                times.append(loop.time())
        gaps = {round(b - a, 9) for a, b in itertools.pairwise(times)}
        assert gaps == {0.25}

    simulate(scenario())


def test_reconnect_registers_again_with_the_running_replicas() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            await h.send(start("r1"), start("r2", 4))
            await h.reports.until(lambda r: r.replica_id == "r2" and r.state == "ready")
            await h.agent.on_reconnect()
            await wait_until(lambda: len(h.registrations) == 2)
        first, again = (r for _, r in h.registrations)
        assert first.replicas == ()
        assert [(r.replica_id, r.epoch, r.state) for r in again.replicas] == [
            ("r1", 1, "ready"),
            ("r2", 4, "ready"),
        ]
        assert h.agent.registrations == 2

    simulate(scenario())


# Heartbeats.


def test_heartbeats_carry_gpu_metrics_and_replica_states() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            first = await h.heartbeats.next()
            await h.send(start())
            await h.reports.until(lambda r: r.state == "ready")
            later = await h.fresh_heartbeat()
        assert first.node_id == NODE and first.probe_error == ""
        assert [(m.index, m.temperature_c, m.memory_total_mib) for m in first.gpus] == [
            (0, 35.0, 24576),
            (1, 35.0, 24576),
        ]
        assert later.seq > first.seq
        assert [(r.replica_id, r.state) for r in later.replicas] == [("r1", "ready")]

    simulate(scenario())


def test_a_failing_probe_is_reported_in_the_heartbeat_and_recovers() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            await h.heartbeats.next()
            h.fake_probe.set_driver_error(True)
            broken = await h.fresh_heartbeat()
            h.fake_probe.set_driver_error(False)
            healed = await h.fresh_heartbeat()
        assert broken.gpus == () and "NVML" in broken.probe_error
        assert len(healed.gpus) == 2 and healed.probe_error == ""

    simulate(scenario())


class HangingProbe:
    """A wedged driver: the inventory answers, sampling never returns."""

    async def inventory(self) -> Inventory:
        return Inventory(gpus=())

    async def sample(self) -> tuple[Any, ...]:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


def test_a_hung_probe_delays_no_heartbeat_beyond_its_interval() -> None:
    async def scenario() -> None:
        h = Harness(probe=HangingProbe())
        loop = asyncio.get_running_loop()
        async with h.running():
            beat = await h.heartbeats.next()
            began = loop.time()
            await h.heartbeats.next()
            assert loop.time() - began == pytest.approx(1.0)
        assert "did not answer within 0.8 s" in beat.probe_error

    simulate(scenario())


class BrokenInventory(HangingProbe):
    async def inventory(self) -> Inventory:
        raise ProbeError("NVML: driver/library version mismatch")


def test_an_unreadable_inventory_delays_registration_without_crashing() -> None:
    async def scenario() -> None:
        h = Harness(probe=BrokenInventory())
        async with h.running():
            await asyncio.sleep(30)
            assert not h.agent.registered and not h.registrations

    simulate(scenario())


# Commands and reports.


def test_start_reports_starting_then_ready_with_the_address() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            await h.send(start("r1", 2, gpu_indices=(1,)))
            reports = await h.reports.until(lambda r: r.state == "ready")
            await h.acked()
        assert states(reports) == ["starting", "ready"]
        ready = reports[-1]
        assert (ready.replica_id, ready.epoch, ready.port) == ("r1", 2, 20000)
        assert ready.address == "http://127.0.0.1:20000"
        (workload,) = h.driver.started
        assert workload.gpu_indices == (1,)

    simulate(scenario())


def test_a_replica_is_ready_only_once_the_lease_covers_it() -> None:
    """Ready is when routing starts: a node that would refuse the replica (its lease from
    before the placement) asks for a fresh lease at once and reports ready after it."""

    async def scenario() -> None:
        h = Harness()
        async with h.running():
            h.grant_leases()
            await wait_until(lambda: h.agent.fenced("r1", 2) != "")  # a first lease, without r1
            await h.send(start("r1", 2))
            await h.reports.until(lambda r: r.state == "starting")
            loop = asyncio.get_running_loop()
            await asyncio.sleep(0.3)  # the workload is ready at once; its lease has not come
            assert h.agent.fenced("r1", 2)
            assert h.agent.replicas()[0].state == "starting"  # heartbeats say starting too
            asked_at = loop.time()
            h.leased.add(("r1", 2))
            (ready,) = await h.reports.until(lambda r: r.state == "ready")
            assert h.agent.fenced("r1", 2) == ""
        # Asked for at once (not at the next heartbeat, up to an interval away): an ack within
        # half an interval of the lease being there to grant.
        assert any(asked_at <= at < asked_at + 0.5 for at, _ in h.lease_acks)
        assert ready.replica_id == "r1"

    simulate(scenario())


def test_a_replica_is_reported_ready_anyway_when_no_lease_comes() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            h.grant_leases()
            await wait_until(lambda: h.agent.fenced("r1", 2) != "")
            await h.send(start("r1", 2))
            loop = asyncio.get_running_loop()
            began = loop.time()
            await h.reports.until(lambda r: r.state == "ready")
            waited = loop.time() - began
        assert 1.5 <= waited <= 2.5  # two heartbeat intervals, then ready regardless

    simulate(scenario())


def test_start_is_idempotent_by_command_id_and_by_replica_epoch() -> None:
    async def scenario() -> None:
        first = start("r1", 1, command_id="c1")
        queue = ScriptedQueue(
            [first, first, start("r1", 1, command_id="c2"), start("r1", 2, command_id="c3")]
        )
        h = Harness(commands=queue)
        async with h.running():
            await wait_until(lambda: queue.acked == 4)
            await h.reports.until(lambda r: r.epoch == 2 and r.state == "ready")
        assert [(w.replica_id, w.epoch) for w in h.driver.started] == [("r1", 1), ("r1", 2)]

    with capture_logs() as logs:
        simulate(scenario())
    seen = [
        (e["event"], e.get("command")) for e in logs if e["event"].startswith(("command", "start"))
    ]
    assert seen == [("command_duplicate", "c1"), ("start_ignored", "c2")]


def test_stop_ends_the_workload_with_its_grace_and_reports_stopped() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            await h.send(start())
            await h.reports.until(lambda r: r.state == "ready")
            await h.send(stop(grace_s=7.5, reason="scale down"))
            (stopped,) = await h.reports.until(lambda r: r.state == "stopped")
            await h.acked()
            beat = await h.fresh_heartbeat()
        assert stopped.detail == "scale down" and stopped.exit_code == SIGTERM_EXIT
        (workload,) = h.driver.started
        assert workload.stop_grace == 7.5 and not workload.alive
        assert beat.replicas == ()

    simulate(scenario())


def test_stops_for_epochs_not_running_here_are_acked_no_ops() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            await h.send(start("r1", 2))
            await h.reports.until(lambda r: r.state == "ready")
            await h.send(stop("r1", 1), stop("r9", 2))
            await h.acked()
            beat = await h.fresh_heartbeat()
            # Stopping twice, or starting a stopped epoch again, changes nothing either.
            await h.send(
                stop("r1", 2), stop("r1", 2, command_id="again"), start("r1", 2, command_id="late")
            )
            await h.reports.until(lambda r: r.state == "stopped")
            await h.acked()
            await asyncio.sleep(5)
        assert [(r.replica_id, r.epoch, r.state) for r in beat.replicas] == [("r1", 2, "ready")]
        assert len(h.driver.started) == 1
        assert h.agent.replicas() == ()

    simulate(scenario())


def test_a_start_is_acked_only_once_it_was_launched() -> None:
    async def scenario() -> None:
        h = Harness()
        gate = h.driver.start_gate = asyncio.Event()
        async with h.running():
            command = start()
            await h.send(command)
            await wait_until(lambda: h.driver.start_calls == 1)
            await asyncio.sleep(30)
            assert h.queue.pending(NODE) == [command]
            gate.set()
            await h.acked()
            assert h.driver.started

    simulate(scenario())


def test_a_stop_is_acked_only_once_the_workload_is_gone() -> None:
    async def scenario() -> None:
        h = Harness(driver=FakeDriver(ignore_sigterm=True))
        loop = asyncio.get_running_loop()
        async with h.running():
            await h.send(start())
            await h.reports.until(lambda r: r.state == "ready")
            await h.acked()
            command = stop(grace_s=3.0)
            began = loop.time()
            await h.send(command)
            await wait_until(lambda: h.driver.started[0].stop_grace is not None)
            await asyncio.sleep(2.9)
            assert h.queue.pending(NODE) == [command]
            await h.acked()
            assert loop.time() - began == pytest.approx(3.0, abs=0.02)
            (stopped,) = await h.reports.until(lambda r: r.state == "stopped")
        assert stopped.exit_code == SIGKILL_EXIT

    simulate(scenario())


def test_undecodable_and_unknown_commands_are_acked_and_dropped() -> None:
    async def scenario() -> None:
        queue = ScriptedQueue(
            [
                msgspec.DecodeError("JSON is malformed"),
                "not a command",
                start("r1"),
            ]
        )
        h = Harness(commands=queue)
        async with h.running():
            await h.reports.until(lambda r: r.state == "ready")
            await wait_until(lambda: queue.acked == 3)

    simulate(scenario())


def test_a_broken_command_stream_is_consumed_again() -> None:
    async def scenario() -> None:
        queue = ScriptedQueue([start("r1")], fail_first=True)
        h = Harness(commands=queue)
        async with h.running():
            await h.reports.until(lambda r: r.state == "ready")
            await wait_until(lambda: queue.acked == 1)
        assert queue.consumers == 2

    simulate(scenario())


# Crashes.


def test_a_crashed_workload_restarts_in_place_on_the_same_port() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            await h.send(start())
            await h.reports.until(lambda r: r.state == "ready")
            h.driver.started[0].crash(3)
            reports = await h.reports.until(lambda r: r.state == "ready")
        assert states(reports) == ["starting", "ready"]
        assert reports[0].detail == "restart 1 after exit code 3"
        first, second = h.driver.started
        assert first.port == second.port == reports[-1].port

    simulate(scenario())


def test_a_crash_loop_backs_off_doubling_then_reports_failed() -> None:
    async def scenario() -> None:
        h = Harness(driver=FakeDriver(exit_on_start=3))
        loop = asyncio.get_running_loop()
        async with h.running():
            await h.send(start())
            times: list[float] = []
            reports: list[ReplicaState] = []
            while not reports or reports[-1].state != "failed":
                reports.append(await h.reports.next())
                times.append(loop.time())
            await h.acked()
            beat = await h.fresh_heartbeat()
            # The controller stops the failed replica to clear it from the node.
            await h.send(stop())
            (stopped,) = await h.reports.until(lambda r: r.state == "stopped")
        assert states(reports) == ["starting"] * 4 + ["failed"]
        assert [r.detail for r in reports[:4]] == [
            "",
            "restart 1 after exit code 3",
            "restart 2 after exit code 3",
            "restart 3 after exit code 3",
        ]
        # A restart is reported the moment the workload dies (not ready: nothing may route to
        # it), then the agent backs off: so the gaps between those reports are the back-offs.
        gaps = [round(b - a, 6) for a, b in itertools.pairwise(times[1:5])]
        assert gaps == [0.5, 1.0, 2.0]
        failed = reports[-1]
        assert failed.detail.startswith("crash loop: 4 failures within 60 s")
        assert failed.exit_code == 3
        assert len(h.driver.started) == 4
        assert [(r.replica_id, r.state) for r in beat.replicas] == [("r1", "failed")]
        assert stopped.exit_code == 3

    simulate(scenario())


def test_crashes_spread_wider_than_the_window_never_give_up() -> None:
    async def scenario() -> None:
        policy = RestartPolicy(max_restarts=1, window_s=10.0)
        h = Harness(config=AgentConfig(node_id=NODE, restart=policy))
        async with h.running():
            await h.send(start())
            for restart in range(1, 5):
                await h.reports.until(lambda r: r.state == "ready")
                await asyncio.sleep(11)
                h.driver.started[-1].crash(1)
                (starting,) = await h.reports.until(lambda r: r.state == "starting")
                assert starting.detail == f"restart {restart} after exit code 1"

    simulate(scenario())


def test_a_failed_liveness_probe_stops_the_hung_workload_and_restarts_it() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            await h.send(start())
            await h.reports.until(lambda r: r.state == "ready")
            hung = h.driver.started[0]
            hung.fail_liveness("3 failed health checks in a row")
            reports = await h.reports.until(lambda r: r.state == "ready")
        assert (
            reports[0].detail == "restart 1 after liveness_failed (3 failed health checks in a row)"
        )
        assert not hung.alive and hung.stop_grace == h.config.stop_grace_s

    simulate(scenario())


def test_a_workload_that_cannot_launch_ends_failed_with_the_reason() -> None:
    async def scenario() -> None:
        h = Harness(driver=FakeDriver(start_error="no such image: llama:7b"))
        async with h.running():
            await h.send(start())
            await h.acked()  # acted on: the launch was attempted
            reports = await h.reports.until(lambda r: r.state == "failed")
        failed = reports[-1]
        assert "start failed: no such image: llama:7b" in failed.detail
        assert {r.state for r in reports[:-1]} <= {"starting"}  # retried in place first

    simulate(scenario())


class BuggyDriver(FakeDriver):
    """A driver with a bug: its workloads blow up while being watched."""

    async def start(self, *args: Any, **kwargs: Any) -> Any:
        workload = await super().start(*args, **kwargs)

        async def broken() -> None:
            raise RuntimeError("driver bug")

        workload.wait_ready = broken  # type: ignore[method-assign]
        return workload


def test_a_driver_bug_fails_that_replica_only() -> None:
    async def scenario() -> None:
        h = Harness(driver=BuggyDriver())
        async with h.running():
            await h.send(start("r1"))
            failed = (await h.reports.until(lambda r: r.state == "failed"))[-1]
            assert "agent error: RuntimeError('driver bug')" in failed.detail
            assert not h.driver.running()  # its workload was stopped
            h.driver.__class__ = FakeDriver  # the next replica gets a working driver
            await h.send(start("r2"))
            await h.reports.until(lambda r: r.replica_id == "r2" and r.state == "ready")

    simulate(scenario())


# Faults.


def test_the_fault_subject_drives_the_fake_probe() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            await h.heartbeats.next()
            assert (await h.fault(Fault(kind="thermal", value=95, gpu=1))).ok
            assert (await h.fault(Fault(kind="ecc", value=2))).ok
            assert (await h.fault(Fault(kind="xid", value=79, gpu=0))).ok
            hot = await h.fresh_heartbeat()
            assert (await h.fault(Fault(kind="driver"))).ok
            broken = await h.fresh_heartbeat()
            assert (await h.fault(Fault(kind="clear"))).ok
            cleared = await h.fresh_heartbeat()
        assert [m.temperature_c for m in hot.gpus] == [35.0, 95.0]
        assert [m.ecc_uncorrected for m in hot.gpus] == [2, 2]
        assert [(m.xid_errors, m.xids) for m in hot.gpus] == [(1, (79,)), (0, ())]  # XID 79
        assert broken.probe_error and broken.gpus == ()
        assert cleared.probe_error == "" and {m.temperature_c for m in cleared.gpus} == {35.0}

    simulate(scenario())


@pytest.mark.parametrize(
    ("data", "error"),
    [
        (b"garbage", "undecodable fault"),
        (b'{"type": "fault.v1", "kind": "meteor"}', "undecodable fault"),
        (b'{"type": "fault.v1", "kind": "thermal", "value": 90, "gpu": 5}', "no GPU 5"),
    ],
)
def test_bad_faults_are_answered_with_an_error_and_the_agent_keeps_running(
    data: bytes, error: str
) -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            await h.heartbeats.next()
            reply = await h.fault(data)
            assert not reply.ok and error in reply.error
            await h.fresh_heartbeat()
            assert (await h.fault(Fault(kind="thermal", value=80))).ok

    simulate(scenario())


class RealLookingProbe(HangingProbe):
    async def sample(self) -> tuple[Any, ...]:
        return ()


def test_a_real_probe_refuses_faults() -> None:
    async def scenario() -> None:
        h = Harness(probe=RealLookingProbe())
        async with h.running():
            await h.heartbeats.next()
            reply = await h.fault(Fault(kind="thermal", value=95))
        assert not reply.ok and "--fake-gpus" in reply.error

    simulate(scenario())


# Shutdown and determinism.


def test_shutdown_stops_every_workload_before_returning() -> None:
    async def scenario() -> None:
        h = Harness(driver=FakeDriver(ignore_sigterm=True))
        loop = asyncio.get_running_loop()
        async with h.running():
            await h.send(start("r1"), start("r2"))
            await h.reports.until(lambda r: r.replica_id == "r2" and r.state == "ready")
            began = loop.time()
        # The running() block cancelled the agent and waited for it to return.
        assert loop.time() - began == pytest.approx(h.config.stop_grace_s)
        assert not h.driver.running()
        stopped = [await h.reports.next(), await h.reports.next()]
        assert sorted((r.replica_id, r.state, r.detail) for r in stopped) == [
            ("r1", "stopped", "agent shutting down"),
            ("r2", "stopped", "agent shutting down"),
        ]

    simulate(scenario())


def test_force_stop_kills_workloads_still_in_their_grace_period() -> None:
    async def scenario() -> None:
        h = Harness(
            driver=FakeDriver(ignore_sigterm=True),
            config=AgentConfig(node_id=NODE, stop_grace_s=30.0),
        )
        loop = asyncio.get_running_loop()
        async with h.running():
            await h.send(start("r1"), start("r2"))
            await h.reports.until(lambda r: r.replica_id == "r2" and r.state == "ready")
            began = loop.time()
            h.tasks[0].cancel()  # the first SIGTERM
            await asyncio.sleep(1)
            h.agent.force_stop()  # the second
        assert loop.time() - began == pytest.approx(1.0)
        assert not h.driver.running()

    simulate(scenario())


def test_the_same_seed_publishes_the_same_messages_at_the_same_times() -> None:
    def trace(seed: int) -> list[tuple[float, str, bytes]]:
        async def scenario() -> list[tuple[float, str, bytes]]:
            h = Harness(seed=seed, driver=FakeDriver(exit_on_start=1))
            seen: list[tuple[float, str, bytes]] = []
            everything = await h.bus.subscribe("gpumesh.>")
            loop = asyncio.get_running_loop()
            async with h.running(controller=False):
                await asyncio.sleep(3)
                h.start_controller()
                await h.send(start())
                await h.reports.until(lambda r: r.state == "failed")
            await everything.unsubscribe()
            async for msg in everything:
                seen.append((loop.time(), msg.subject, msg.data))
            return seen

        return run_simulation(scenario())

    assert trace(3) == trace(3)


# Test doubles.


class ScriptedDelivery:
    def __init__(self, queue: ScriptedQueue, item: object) -> None:
        self._queue = queue
        self._item = item

    @property
    def command(self) -> Command:
        if isinstance(self._item, Exception):
            raise self._item
        return self._item  # type: ignore[return-value]  # garbage on purpose, sometimes

    async def ack(self) -> None:
        self._queue.acked += 1


class ScriptedQueue:
    """Delivers a fixed list (duplicates and garbage included), then waits forever."""

    def __init__(self, items: list[object], *, fail_first: bool = False) -> None:
        self.items = items
        self.acked = 0
        self.consumers = 0
        self.fail_first = fail_first

    async def send(self, node_id: str, command: Command) -> None:
        raise NotImplementedError

    def consume(self, node_id: str) -> AsyncIterator[ScriptedDelivery]:
        assert node_id == NODE
        self.consumers += 1
        return self._deliver(fail=self.fail_first and self.consumers == 1)

    async def _deliver(self, *, fail: bool) -> AsyncIterator[ScriptedDelivery]:
        if fail:
            raise ConnectionError("JetStream consumer lost")
        for item in self.items:
            yield ScriptedDelivery(self, item)
        await asyncio.Event().wait()


def test_the_harness_subjects_are_the_contract() -> None:
    assert subjects.fault(NODE) == "gpumesh.v1.node.n1.fault"
    assert isinstance(start(), StartReplica)


# -- no controller: the data plane outlives the control plane ---------------------------------


def test_a_connected_node_serves_on_its_last_lease_while_no_controller_answers() -> None:
    """With nobody taking heartbeats in, NATS answers each "no responders": the node is
    connected, the controller is away, and it keeps serving what it was leased, for as long as
    that takes; it says so once, and once again when a controller answers."""

    async def scenario() -> None:
        h = Harness()
        h.lease_s = 2.4
        async with h.running(watch_heartbeats=False):
            h.leased.add(("r1", 1))
            controller = h.grant_leases()
            await h.send(start("r1", 1))
            await h.reports.until(lambda r: r.state == "ready")
            assert h.agent.fenced("r1", 1) == ""
            controller.cancel()
            await asyncio.wait({controller})
            for _ in range(30):  # thirty leases' worth of seconds, looked at every second
                await asyncio.sleep(1.0)
                assert h.agent.fenced("r1", 1) == ""
                assert h.agent.controller_absent
            assert h.agent.fenced("r2", 1)  # only what the last lease named
            h.grant_leases()
            await wait_until(lambda: not h.agent.controller_absent)
            assert h.agent.fenced("r1", 1) == ""

    with capture_logs() as logs:
        simulate(scenario())
    said = [e["event"] for e in logs if e["event"] in ("controller_absent", "controller_back")]
    assert said == ["controller_absent", "controller_back"]


def test_a_lapsed_lease_stays_lapsed_when_no_controller_answers() -> None:
    """A node that heard nothing for longer than its lease (cut off: its heartbeats went
    nowhere and no answer came) may have had its replicas replaced meanwhile: a later "no
    responders" does not revive its lease; only a controller's own does."""

    async def scenario() -> None:
        h = Harness()
        h.lease_s = 2.4
        async with h.running():  # the harness's own heartbeat watcher: no "no responders"
            h.leased.add(("r1", 1))
            controller = h.grant_leases()
            await h.send(start("r1", 1))
            await h.reports.until(lambda r: r.state == "ready")
            controller.cancel()
            await asyncio.wait({controller})
            await asyncio.sleep(3.0)
            assert "lapsed" in h.agent.fenced("r1", 1)
            await h.stop_watching_heartbeats()  # now every heartbeat is answered "no responders"
            await asyncio.sleep(5.0)
            assert h.agent.controller_absent is False
            assert "lapsed" in h.agent.fenced("r1", 1)
            h.grant_leases()
            await wait_until(lambda: h.agent.fenced("r1", 1) == "")

    simulate(scenario())


# -- leadership terms: a deposed leader's word no longer counts ------------------------------


def test_a_command_from_an_older_term_is_dropped_and_a_newer_terms_resend_is_obeyed() -> None:
    async def scenario() -> None:
        h = Harness()
        async with h.running():
            await h.send(msgspec.structs.replace(start("r1", 1), term=7))
            await h.reports.until(lambda r: r.state == "ready")
            assert h.agent.term == 7
            # A leader of term 5, paused past its lease, resumes and sends what it meant to.
            await h.send(msgspec.structs.replace(start("r2", 1), term=5))
            await h.send(msgspec.structs.replace(stop("r1", 1), term=5))
            await h.acked()
            assert [(w.replica_id, w.epoch) for w in h.driver.started] == [("r1", 1)]
            assert h.agent.replicas()[0].state == "ready"
            # The leader of term 7 re-sends the same command: it is obeyed.
            await h.send(msgspec.structs.replace(stop("r1", 1), term=7))
            await h.reports.until(lambda r: r.state == "stopped")

    with capture_logs() as logs:
        simulate(scenario())
    dropped = [e for e in logs if e["event"] == "command_from_old_term"]
    assert [(e["term"], e["current"]) for e in dropped] == [(5, 7), (5, 7)]


def test_a_lease_from_an_older_term_is_ignored() -> None:
    async def scenario() -> None:
        h = Harness()
        h.lease_s = 2.4
        async with h.running():
            h.leased.add(("r1", 1))
            h.grant_leases()
            await h.send(msgspec.structs.replace(start("r1", 1), term=9))
            await h.reports.until(lambda r: r.state == "ready")
            # Leases from the harness's controller carry no term (0): they count. One from a
            # deposed leader of term 3 naming nothing does not revoke r1.
            stale = HeartbeatAck(node_id=NODE, seq=10_000, lease_s=2.4, term=3)
            h.agent._sent_at[10_000] = asyncio.get_running_loop().time()
            await h.bus.publish(h.agent._lease_subject, msgspec.json.encode(stale))
            await asyncio.sleep(0.1)
            assert h.agent.fenced("r1", 1) == ""

    simulate(scenario())
