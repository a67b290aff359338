"""One node flooding heartbeats is rate-limited without starving the others (virtual time)."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from actors.intake_limit import IntakeLimiter
from events.contract import subjects
from events.contract.messages import Heartbeat
from sim import run_simulation
from tests.control.harness import fleet


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def wall_ns(self) -> int:
        return int(self.now * 1e9)


def test_a_bucket_refills_at_its_rate_and_caps_at_its_burst() -> None:
    clock = _Clock()
    limit = IntakeLimiter(clock, rate_per_s=2.0, burst=3)
    assert [limit.admit("a") for _ in range(4)] == [True, True, True, False]
    assert limit.admit("b")  # buckets are per sender
    clock.now = 0.5  # one token back
    assert limit.admit("a") and not limit.admit("a")
    clock.now = 100.0  # long idle: full again, never more than the burst
    assert [limit.admit("a") for _ in range(4)] == [True, True, True, False]
    with pytest.raises(ValueError, match="rate_per_s"):
        IntakeLimiter(clock, rate_per_s=0, burst=1)


def test_a_flooding_node_is_limited_and_the_others_stay_healthy() -> None:
    flood = 20_000

    async def main() -> None:
        async with fleet(3) as f:
            before = sum(1 for e in f.store.read_all_now() if e.stream == "node/n0")
            beat = msgspec.json.encode(Heartbeat(node_id="n0", seq=10**6, sent_at_ns=1))
            loop = asyncio.get_running_loop()
            start = loop.time()
            # 20,000 heartbeats in 10 virtual seconds: 2,000 a second, against 1 expected.
            for i in range(flood):
                await f.bus.publish(subjects.heartbeat("n0"), beat)
                if i % 200 == 199:
                    await asyncio.sleep(0.1)
            await f.until(lambda: f.controller.dropped["rate_limited"] > 0, within=5, why="limited")
            took = loop.time() - start
            recorded = sum(1 for e in f.store.read_all_now() if e.stream == "node/n0") - before
            # The burst, then 4 per interval, plus the agent's own beats: nowhere near 20,000.
            allowed = f.controller.config.heartbeat_burst + 4 * (took + 1)
            assert recorded <= allowed, (recorded, allowed)
            assert f.controller.dropped["rate_limited"] >= flood - allowed
            # Nobody else lost a heartbeat's worth of standing.
            for node in ("n0", "n1", "n2"):
                assert f.state.nodes.nodes[node].health == "healthy", node
            offline = [e for e in f.store.read_all_now() if e.type == "node.health_changed.v1"]
            assert not [e for e in offline if getattr(e.payload, "state", "") == "offline"]

    run_simulation(main())
