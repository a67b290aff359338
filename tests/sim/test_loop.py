"""The virtual-time loop: fast timers, deadlock detection, no real I/O."""

from __future__ import annotations

import asyncio
import gc
import math
import os
import time
import weakref

import pytest

from runtime import Actor, ActorContext, ActorSystem
from sim import (
    SIM_EPOCH_NS,
    Deadlock,
    SimClock,
    SimEventLoop,
    SimulationError,
    run_simulation,
    sim_env as make_env,
)


class Hourly(Actor[str]):
    """A periodic timer in the production style: a sleep loop owned by the actor."""

    def __init__(self, ticks: list[float]) -> None:
        self.ticks = ticks

    async def on_start(self, ctx: ActorContext[str]) -> None:
        ctx.create_task(self.every_hour(ctx), name="hourly")

    async def every_hour(self, ctx: ActorContext[str]) -> None:
        while True:
            await asyncio.sleep(3600)
            await ctx.self_ref.tell("tick")

    async def handle(self, ctx: ActorContext[str], msg: str) -> object:
        self.ticks.append(ctx.env.clock.monotonic())
        return None


def test_a_simulated_day_of_hourly_timers_takes_well_under_a_second() -> None:
    ticks: list[float] = []

    async def day() -> float:
        async with ActorSystem(make_env(1)) as system:
            await system.spawn(lambda: Hourly(ticks), "hourly")
            await asyncio.sleep(24 * 3600 + 1)
        return asyncio.get_running_loop().time()

    began = time.perf_counter()
    ended_at = run_simulation(day())
    wall = time.perf_counter() - began
    assert wall < 1.0
    assert ticks == [3600.0 * h for h in range(1, 25)]
    assert ended_at == 24 * 3600 + 1


def test_deadlock_when_main_awaits_a_future_nothing_will_resolve() -> None:
    async def stuck() -> None:
        await asyncio.get_running_loop().create_future()

    with pytest.raises(Deadlock) as info:
        run_simulation(stuck(), start=5.0)
    assert info.value.now == 5.0
    assert len(info.value.waiting) == 1
    assert "in stuck" in info.value.waiting[0]
    assert "nothing is runnable and no timer is scheduled" in str(info.value)


class Idle(Actor[str]):
    async def handle(self, ctx: ActorContext[str], msg: str) -> object:
        return None


def test_deadlock_lists_every_waiting_task_including_idle_actors() -> None:
    async def forgotten_event() -> None:
        async with ActorSystem(make_env(1)) as system:
            await system.spawn(Idle, "idle")
            await asyncio.Event().wait()  # nobody will set it

    with pytest.raises(Deadlock) as info:
        run_simulation(forgotten_event())
    assert any("in forgotten_event" in line for line in info.value.waiting)
    assert any(line.startswith("actor:idle:") for line in info.value.waiting)


def test_time_starts_where_asked_and_advances_only_by_timers() -> None:
    async def main() -> list[float]:
        loop = asyncio.get_running_loop()
        seen = [loop.time()]
        for _ in range(100):
            await asyncio.sleep(0)  # runnable work takes no virtual time
        seen.append(loop.time())
        await asyncio.sleep(2.5)
        seen.append(loop.time())
        return seen

    assert run_simulation(main(), start=100.0) == [100.0, 100.0, 102.5]


def test_timers_fire_in_deadline_order_and_ties_in_scheduling_order() -> None:
    async def main() -> list[str]:
        loop = asyncio.get_running_loop()
        fired: list[str] = []
        done = loop.create_future()
        for name, delay in [("c", 3.0), ("a1", 1.0), ("b", 2.0), ("a2", 1.0), ("a3", 1.0)]:
            loop.call_later(delay, fired.append, name)
        loop.call_later(10.0, done.set_result, None)
        await done
        return fired

    assert run_simulation(main()) == ["a1", "a2", "a3", "b", "c"]


def test_timeouts_use_virtual_time() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(7200):
                await asyncio.Event().wait()
        return loop.time()

    began = time.perf_counter()
    assert run_simulation(main()) == 7200.0
    assert time.perf_counter() - began < 1.0


def test_real_io_is_refused() -> None:
    read_fd, write_fd = os.pipe()

    async def main() -> None:
        asyncio.get_running_loop().add_reader(read_fd, lambda: None)

    try:
        with pytest.raises(SimulationError, match="real I/O is not available"):
            run_simulation(main())
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_sim_clock_maps_virtual_time_onto_a_fixed_epoch() -> None:
    async def main() -> tuple[float, int]:
        clock = SimClock()
        await asyncio.sleep(1.5)
        return clock.monotonic(), clock.wall_ns()

    assert run_simulation(main()) == (1.5, SIM_EPOCH_NS + 1_500_000_000)
    assert SIM_EPOCH_NS == 1_767_225_600_000_000_000  # 2026-01-01T00:00:00Z


def test_runner_accepts_the_loop_class_as_factory() -> None:
    with asyncio.Runner(loop_factory=SimEventLoop) as runner:
        assert runner.run(asyncio.sleep(60, result="done")) == "done"
        assert runner.get_loop().time() == 60.0


def test_threads_are_refused() -> None:
    async def main() -> None:
        await asyncio.to_thread(print, "from a thread")

    with pytest.raises(SimulationError, match="threads are not available"):
        run_simulation(main())


def test_timers_fire_once_each_in_time_order_through_a_purge_of_cancelled_ones() -> None:
    """Hundreds of cancelled timers (as `asyncio.timeout` leaves behind) make the loop purge
    its heap in the middle of a turn; every live timer still fires exactly once, at its time,
    and timers due at the same instant fire in the order they were scheduled."""
    fired: list[tuple[float, int]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        dead = [loop.call_later(5.0 + i, fired.append, (-1.0, i)) for i in range(500)]
        for k in range(300):
            loop.call_at(1.0 + (k % 3), lambda k=k: fired.append((loop.time(), k)))
        for handle in dead:
            handle.cancel()
        await asyncio.sleep(10.0)

    run_simulation(main())
    assert sorted(fired) == fired
    assert [k for _, k in fired] == sorted(range(300), key=lambda k: (k % 3, k))
    assert {t for t, _ in fired} == {1.0, 2.0, 3.0}


def test_the_loop_keeps_asyncio_checks_in_debug_mode() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        loop.set_debug(True)
        with pytest.raises(TypeError):
            loop.call_soon("not callable")  # type: ignore[arg-type]
        with pytest.raises(TypeError):
            loop.call_later(1.0, "not callable")  # type: ignore[arg-type]
        await asyncio.sleep(2.5)
        return loop.time()

    assert run_simulation(main()) == 2.5


def test_a_run_starts_by_collecting_the_cycles_an_earlier_run_left() -> None:
    """A run collects young garbage rarely, so a long-lived cycle from one run reaches the
    oldest generation; a process running seed after seed (the fuzz's workers) must not pile
    them up."""

    class Cycle:
        me: object

    async def leave_a_cycle() -> weakref.ref[Cycle]:
        cycle = Cycle()
        cycle.me = cycle
        gc.collect()  # it survives into the oldest generation, as a world does over a run
        return weakref.ref(cycle)

    left = run_simulation(leave_a_cycle())
    run_simulation(asyncio.sleep(0))
    assert left() is None


def test_sleeping_forever_is_a_deadlock_not_a_jump_to_infinity() -> None:
    async def main() -> None:
        await asyncio.sleep(math.inf)

    with pytest.raises(Deadlock):
        run_simulation(main())


def test_a_refused_close_keeps_the_pending_timers() -> None:
    async def main() -> float:
        loop = asyncio.get_running_loop()
        later = loop.create_future()
        loop.call_later(5.0, later.set_result, "fired")
        with pytest.raises(RuntimeError, match="running"):
            loop.close()
        assert await later == "fired"
        return loop.time()

    assert run_simulation(main()) == 5.0


def test_timers_sharing_an_instant_fire_together_and_cancelled_ones_are_purged() -> None:
    """Timers due at the same instant share one bucket: they fire in scheduling order, a
    cancelled one among them does not fire, and buckets whose timers were all cancelled are
    dropped (the purge counts handles, not instants) instead of piling up."""
    fired: list[tuple[float, int]] = []

    async def main() -> tuple[int, int]:
        loop = asyncio.get_running_loop()
        assert isinstance(loop, SimEventLoop)
        handles = [loop.call_at(1.0, lambda i=i: fired.append((loop.time(), i))) for i in range(6)]
        handles[2].cancel()
        # 400 instants with a dead timer each, and one live timer among them.
        dead = [loop.call_at(10.0 + i, fired.append, (-1.0, -1)) for i in range(400)]
        loop.call_at(10.5, lambda: fired.append((loop.time(), 99)))
        for handle in dead:
            handle.cancel()
        await asyncio.sleep(0)  # a turn: the purge runs at the start of one
        kept = len(loop._buckets)
        await asyncio.sleep(20.0)
        return kept, len(loop._buckets)

    kept, left = run_simulation(main())
    assert fired == [(1.0, 0), (1.0, 1), (1.0, 3), (1.0, 4), (1.0, 5), (10.5, 99)]
    assert kept <= 3  # the instants 1.0 and 10.5, and the sleep's own; not 400 dead ones
    assert left == 0
