"""Every node's silence deadline on one loop timer, instead of one task per node.

A NodeActor must look at its node when the next threshold (suspect, then offline) would be
crossed if no heartbeat came. A task per node sleeping until then woke once per heartbeat
(the heartbeat moved the deadline, the task woke, saw that and slept again): at 1,000 nodes in
the simulator that was a task wake-up per heartbeat and 13% of a run. Here the deadlines wait
in one heap behind one `loop.call_at`; a heartbeat moves nothing (the controller only writes
`NodeLiveness.last_heard`), and a deadline that comes up asks its node what to do now and when
to look next. Every deadline due at one instant is handled in one callback.

The watch keeps no task, only a timer handle: `close()` (the controller's, on shutdown)
cancels it. It never reads a clock of its own: `look(now)` gets the loop's time, which is
virtual in the simulator.
"""

from __future__ import annotations

import asyncio
import contextvars
import heapq
import itertools
import math
from collections.abc import Callable

import structlog

log = structlog.get_logger("gpumesh.silence")

Look = Callable[[float], float | None]
"""Called at a deadline with the loop time: does what is due and returns when to look next,
or None to stop watching."""

OnError = Callable[[Exception], None]
"""Told what a look raised. The look is asked again `retry_s` later until it is replaced or
stopped: its owner should crash and restart (and so watch again), as it would have if the
look had been its own task."""


class SilenceWatch:
    def __init__(self, *, retry_s: float) -> None:
        if retry_s <= 0:
            raise ValueError("retry_s must be > 0")
        self._retry_s = retry_s  # after a look that raised
        self._heap: list[tuple[float, int, str]] = []  # (when, token, node id)
        self._looks: dict[str, tuple[int, Look, OnError | None]] = {}  # node id -> ...
        self._failures: dict[int, int] = {}  # token -> looks that raised in a row
        self._tokens = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self._closed = False

    def __len__(self) -> int:
        return len(self._looks)

    def watch(
        self, node_id: str, at: float, look: Look, *, on_error: OnError | None = None
    ) -> Callable[[], None]:
        """Call `look` at loop time `at`, then whenever it says, until it returns None, the
        returned function is called, or `node_id` is watched again (a new incarnation of its
        actor replaces the old one's look)."""
        if self._closed:
            raise RuntimeError("the silence watch is closed")
        token = next(self._tokens)
        self._looks[node_id] = (token, look, on_error)
        self._push(at, token, node_id)

        def stop() -> None:
            self._forget(node_id, token)

        return stop

    def _forget(self, node_id: str, token: int) -> None:
        current = self._looks.get(node_id)
        if current is not None and current[0] == token:
            del self._looks[node_id]
        self._failures.pop(token, None)

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()
        self._looks.clear()
        self._failures.clear()

    def _push(self, at: float, token: int, node_id: str) -> None:
        heapq.heappush(self._heap, (at, token, node_id))
        if at < self._armed_at:
            self._arm(at)

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        # An empty context: the callback must not run (and log) in the context of whichever
        # actor happened to arm the timer.
        loop = asyncio.get_running_loop()
        self._timer = loop.call_at(at, self._fire, context=contextvars.Context())
        self._armed_at = at

    def _fire(self) -> None:
        self._timer = None
        self._armed_at = math.inf
        now = asyncio.get_running_loop().time()
        heap = self._heap
        due = []
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap))
        done = 0
        try:
            for _, token, node_id in due:
                self._look(now, token, node_id)
                done += 1
        finally:
            # Whatever escaped a look (a BaseException), the other nodes stay watched.
            for entry in due[done:]:
                heapq.heappush(heap, entry)
            if heap and not self._closed:
                self._arm(heap[0][0])

    def _look(self, now: float, token: int, node_id: str) -> None:
        current = self._looks.get(node_id)
        if current is None or current[0] != token:
            return  # stopped, or watched again by a newer incarnation
        _, look, on_error = current
        try:
            then = look(now)
        except Exception as exc:
            # Never the end of the node's watch: silence would go unseen. Its owner is told
            # (to crash and restart), and the look is asked again meanwhile.
            failures = self._failures.get(token, 0) + 1
            self._failures[token] = failures
            if failures == 1 or failures % 100 == 0:
                log.exception("silence_look_failed", node=node_id, failures=failures)
            if on_error is not None:
                try:
                    on_error(exc)
                except Exception:
                    log.exception("silence_on_error_failed", node=node_id)
            then = now + self._retry_s
        else:
            self._failures.pop(token, None)
        if then is None:
            self._forget(node_id, token)
        elif not self._closed:
            heapq.heappush(self._heap, (then, token, node_id))
