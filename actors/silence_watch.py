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
import heapq
import itertools
import math
from collections.abc import Callable

import structlog

log = structlog.get_logger("gpumesh.silence")

Look = Callable[[float], float | None]
"""Called at a deadline with the loop time: does what is due and returns when to look next,
or None to stop watching."""


class SilenceWatch:
    def __init__(self, *, retry_s: float) -> None:
        if retry_s <= 0:
            raise ValueError("retry_s must be > 0")
        self._retry_s = retry_s  # after a look that raised
        self._heap: list[tuple[float, int, str]] = []  # (when, token, node id)
        self._looks: dict[str, tuple[int, Look]] = {}  # node id -> (token, look)
        self._tokens = itertools.count()
        self._timer: asyncio.TimerHandle | None = None
        self._armed_at = math.inf
        self._closed = False

    def __len__(self) -> int:
        return len(self._looks)

    def watch(self, node_id: str, at: float, look: Look) -> Callable[[], None]:
        """Call `look` at loop time `at`, then whenever it says, until it returns None, the
        returned function is called, or `node_id` is watched again (a new incarnation of its
        actor replaces the old one's look)."""
        if self._closed:
            raise RuntimeError("the silence watch is closed")
        token = next(self._tokens)
        self._looks[node_id] = (token, look)
        self._push(at, token, node_id)

        def stop() -> None:
            current = self._looks.get(node_id)
            if current is not None and current[0] == token:
                del self._looks[node_id]

        return stop

    def close(self) -> None:
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._heap.clear()
        self._looks.clear()

    def _push(self, at: float, token: int, node_id: str) -> None:
        heapq.heappush(self._heap, (at, token, node_id))
        if at < self._armed_at:
            self._arm(at)

    def _arm(self, at: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_at(at, self._fire)
        self._armed_at = at

    def _fire(self) -> None:
        self._timer = None
        self._armed_at = math.inf
        now = asyncio.get_running_loop().time()
        heap = self._heap
        due = []
        while heap and heap[0][0] <= now:
            due.append(heapq.heappop(heap))
        for _, token, node_id in due:
            current = self._looks.get(node_id)
            if current is None or current[0] != token:
                continue  # stopped, or watched again by a newer incarnation
            try:
                then = current[1](now)
            except Exception:
                # A look that fails must not end the node's watch: silence would go unseen.
                log.exception("silence_look_failed", node=node_id)
                then = now + self._retry_s
            if then is None:
                del self._looks[node_id]
            elif not self._closed:
                heapq.heappush(heap, (then, token, node_id))
        if heap and not self._closed:
            self._arm(heap[0][0])
