"""Oversized heartbeats, on virtual time: a heartbeat is stored as an event, so one over the
intake's size cap is dropped and counted before decoding, whatever the rate, and the node's
ordinary heartbeats go on counting."""

from __future__ import annotations

import msgspec

from actors.intake_limit import MAX_MESSAGE_BYTES, IntakeLimiter
from events.contract import subjects
from events.contract.messages import Heartbeat
from events.node import NodeHeartbeat
from sim import run_simulation
from tests.control.harness import fleet


class _Clock:
    def monotonic(self) -> float:
        return 0.0

    def wall_ns(self) -> int:
        return 0


def test_the_size_cap_is_inclusive() -> None:
    limit = IntakeLimiter(_Clock(), rate_per_s=1.0, burst=1, max_message_bytes=10)
    assert not limit.oversized(b"x" * 10)
    assert limit.oversized(b"x" * 11)
    assert IntakeLimiter(_Clock(), rate_per_s=1.0, burst=1).max_message_bytes == MAX_MESSAGE_BYTES


def test_an_oversized_heartbeat_is_dropped_counted_and_never_stored() -> None:
    async def main() -> None:
        async with fleet(2) as f:
            fat = Heartbeat(node_id="n0", seq=10**6, probe_error="x" * MAX_MESSAGE_BYTES)
            for _ in range(5):  # within the burst: only the size stops them
                await f.bus.publish(subjects.heartbeat("n0"), msgspec.json.encode(fat))
            await f.until(lambda: f.controller.dropped["oversized"] == 5, within=5, why="dropped")

            def beats(node: str) -> list[int]:
                return [
                    e.payload.seq
                    for e in f.store.read_all_now()
                    if isinstance(e.payload, NodeHeartbeat) and e.payload.node_id == node
                ]

            assert 10**6 not in beats("n0")
            # The node's own heartbeats still arrive and count.
            seen = len(beats("n0"))
            await f.until(lambda: len(beats("n0")) >= seen + 3, within=10, why="beats go on")
            for node in ("n0", "n1"):
                assert f.state.nodes.nodes[node].health == "healthy", node

    run_simulation(main())


def test_oversized_registrations_and_reports_are_dropped_too() -> None:
    async def main() -> None:
        async with fleet(1) as f:
            fat = (
                b'{"type": "register.v1", "node_id": "n0", "hostname": "'
                + b"x" * (MAX_MESSAGE_BYTES)
                + b'"}'
            )
            await f.bus.publish(subjects.register("n0"), fat)
            await f.bus.publish(subjects.report("n0"), fat.replace(b"register.v1", b"r"))
            await f.until(lambda: f.controller.dropped["oversized"] == 2, within=5, why="dropped")
            registered = [e for e in f.store.read_all_now() if e.type == "node.registered.v1"]
            assert all(len(e.payload.hostname) < 1000 for e in registered)  # type: ignore[union-attr]
            assert f.state.nodes.nodes["n0"].health == "healthy"

    run_simulation(main())
