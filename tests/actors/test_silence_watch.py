"""SilenceWatch: every node's next look on one loop timer (virtual time, no real waiting)."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from structlog.testing import capture_logs

from actors.silence_watch import SilenceWatch
from sim import run_simulation

T = TypeVar("T")


def simulate(main: Callable[[], Awaitable[T]]) -> T:
    async def run() -> T:
        return await main()

    return run_simulation(run())


def now() -> float:
    return asyncio.get_running_loop().time()


def test_looks_come_at_the_times_they_ask_for_in_time_then_watch_order() -> None:
    async def main() -> list[tuple[float, str]]:
        watch = SilenceWatch(retry_s=0.25)
        seen: list[tuple[float, str]] = []

        def every(node: str, step: float, times: int) -> Callable[[float], float | None]:
            def look(at: float) -> float | None:
                seen.append((at, node))
                return at + step if len([n for _, n in seen if n == node]) < times else None

            return look

        watch.watch("b", 1.0, every("b", 1.0, 3))
        watch.watch("a", 1.0, every("a", 0.5, 3))
        watch.watch("c", 5.0, every("c", 1.0, 1))
        await asyncio.sleep(10)
        assert len(watch) == 0  # every look ended by returning None
        return seen

    assert simulate(main) == [
        (1.0, "b"),
        (1.0, "a"),
        (1.5, "a"),
        (2.0, "b"),
        (2.0, "a"),
        (3.0, "b"),
        (5.0, "c"),
    ]


def test_an_earlier_deadline_rearms_the_timer() -> None:
    async def main() -> list[float]:
        watch = SilenceWatch(retry_s=0.25)
        seen: list[float] = []
        watch.watch("late", 10.0, lambda at: seen.append(at))  # type: ignore[func-returns-value]
        await asyncio.sleep(1)
        watch.watch("soon", 2.0, lambda at: seen.append(at))  # type: ignore[func-returns-value]
        await asyncio.sleep(20)
        return seen

    assert simulate(main) == [2.0, 10.0]


def test_stop_and_a_newer_watch_of_the_same_node_end_the_old_look() -> None:
    async def main() -> list[str]:
        watch = SilenceWatch(retry_s=0.25)
        seen: list[str] = []
        stop_one = watch.watch("one", 1.0, lambda at: seen.append("one") or at + 1)
        watch.watch("two", 1.0, lambda at: seen.append("two-old") or at + 1)
        await asyncio.sleep(1.5)
        stop_one()
        stop_stale = watch.watch("two", 1.7, lambda at: seen.append("two-new") or None)
        stop_stale()  # stops nothing more: the newer watch already replaced the older one...
        watch.watch("two", 1.8, lambda at: seen.append("two-newest") or None)
        await asyncio.sleep(5)
        return seen

    assert simulate(main) == ["one", "two-old", "two-newest"]


def test_a_look_that_raises_is_logged_and_asked_again_after_retry_s() -> None:
    async def main() -> list[float]:
        watch = SilenceWatch(retry_s=0.25)
        seen: list[float] = []

        def look(at: float) -> float | None:
            seen.append(at)
            if len(seen) < 3:
                raise RuntimeError("a bug in the look")
            return None

        told: list[str] = []
        with capture_logs() as logs:
            watch.watch("n1", 1.0, look, on_error=lambda exc: told.append(str(exc)))
            await asyncio.sleep(5)
        # Logged once for the run of failures (see the next test), told each time.
        assert [(e["event"], e["node"], e["failures"]) for e in logs] == [
            ("silence_look_failed", "n1", 1)
        ]
        assert told == ["a bug in the look"] * 2  # the owner hears of each, to crash and restart
        return seen

    assert simulate(main) == [1.0, 1.25, 1.5]


def test_a_look_that_keeps_failing_is_logged_once_then_every_hundredth_time() -> None:
    async def main() -> list[int]:
        watch = SilenceWatch(retry_s=0.25)

        def look(at: float) -> float | None:
            raise RuntimeError("always")

        with capture_logs() as logs:
            watch.watch("n1", 0.0, look)
            await asyncio.sleep(60)  # 241 looks
        watch.close()
        return [e["failures"] for e in logs]

    assert simulate(main) == [1, 100, 200]


def test_looks_run_in_an_empty_context_not_the_one_that_armed_the_timer() -> None:
    marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="")

    async def main() -> list[str]:
        watch = SilenceWatch(retry_s=0.25)
        seen: list[str] = []
        marker.set("the actor that armed the timer")
        watch.watch("a", 1.0, lambda at: seen.append(marker.get()) or None)
        await asyncio.sleep(2)
        return seen

    assert simulate(main) == [""]


def test_close_cancels_the_timer_and_refuses_new_watches() -> None:
    async def main() -> list[float]:
        watch = SilenceWatch(retry_s=0.25)
        seen: list[float] = []
        watch.watch("n1", 1.0, lambda at: seen.append(at) or at + 1)
        await asyncio.sleep(2.5)
        watch.close()
        await asyncio.sleep(5)
        with pytest.raises(RuntimeError, match="closed"):
            watch.watch("n2", 9.0, lambda at: None)
        return seen

    assert simulate(main) == [1.0, 2.0]


def test_retry_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match="retry_s"):
        SilenceWatch(retry_s=0)
