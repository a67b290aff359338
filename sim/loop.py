"""A virtual-time asyncio loop: production coroutines run unchanged, timers cost no wall time.

The loop is a SelectorEventLoop whose selector never polls. When nothing is runnable, the
clock jumps to the next timer. So `asyncio.sleep`, `asyncio.timeout`, `call_later`, Queues and
Tasks keep their exact semantics, and a simulated day of hourly timers takes milliseconds.

Most of a big simulation's time is the loop itself (one timer and a few callbacks per
simulated message), so the loop replaces asyncio's scheduling core (`call_at`, `call_soon`,
`_run_once`) with a leaner one for virtual time: timers due at the same virtual instant share
one bucket, a list in scheduling order, and only the instants sit in a heap of floats. So
timers due at the same instant run in the order they were scheduled (asyncio leaves that order
to the heap), and a timer for an instant that already has one (a fleet's heartbeats, messages
the network delivers on its tick) costs a dict lookup and an append instead of a heap push and
pop.
A simulated process can be frozen, as by SIGSTOP: `freeze(name)` holds every callback whose
context has `PROCESS` set to `name` (a process's tasks, and the timers and wake-ups they
scheduled, inherit it) until `thaw(name)` puts them back, in the order they came due, at the
virtual time of the thaw. Run a process's root task in `process_context(name)`.
Debug mode (`PYTHONASYNCIODEBUG`) keeps asyncio's checks on scheduling (thread, callback);
its slow-callback warning has nothing to measure here: virtual time stands still while a
callback runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import gc
import heapq
import math
import selectors
from collections.abc import Callable, Coroutine, Iterator, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple, Unpack, final

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

_MAX_LISTED = 50  # tasks named in a Deadlock message; a big simulation has thousands
# Cancelled timers stay in the heap until they reach its top, unless they are this many and
# more than half of it (asyncio's own rule: a heap of dead `asyncio.timeout` handles would
# make every push and pop slower).
_PURGE_AT = 100

# A simulation allocates handles, futures and messages by the million and frees almost all of
# them young; at the default gen-0 threshold (700) the collector runs every few hundred
# simulated messages and rescans the survivors each time. Measured on fleet-100 seed 3:
# 5-11 % of the run's CPU time.
_SIM_GC_THRESHOLD = (50_000, 20, 100)

PROCESS: contextvars.ContextVar[str] = contextvars.ContextVar("sim_process", default="")
"""The simulated process a task belongs to (see SimEventLoop.freeze)."""


def process_context(name: str) -> contextvars.Context:
    """A context for the root task of the simulated process `name` (create_task(context=))."""
    context = contextvars.copy_context()
    context.run(PROCESS.set, name)
    return context


_heappush = heapq.heappush
_heappop = heapq.heappop
_copy_context = contextvars.copy_context


class _Soon(asyncio.Handle):
    """A Handle built without asyncio's per-handle debug probe (a method call on every
    callback; a big simulation makes millions). Same slots, same behaviour."""

    __slots__ = ()

    def __init__(
        self,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        loop: SimEventLoop,
        context: contextvars.Context | None,
    ) -> None:
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._loop = loop
        self._source_traceback = None
        self._repr = None
        self._context = _copy_context() if context is None else context


class _Timer(asyncio.TimerHandle):
    """A TimerHandle built the same way as _Soon. The assignments are spelled out in both on
    purpose: a shared helper costs a call per handle, 6% of `bench/sim.py --floor`."""

    __slots__ = ()

    def __init__(
        self,
        when: float,
        callback: Callable[..., object],
        args: tuple[Any, ...],
        loop: SimEventLoop,
        context: contextvars.Context | None,
    ) -> None:
        self._when = when
        self._scheduled = True
        self._callback = callback
        self._args = args
        self._cancelled = False
        self._loop = loop
        self._source_traceback = None
        self._repr = None
        self._context = _copy_context() if context is None else context


class SimulationError(RuntimeError):
    """The simulated program did something the simulator cannot simulate."""


class Deadlock(SimulationError):
    """Nothing is runnable and no timer is pending, yet tasks still wait: they never will."""

    def __init__(self, now: float, waiting: list[str]) -> None:
        self.now = now
        self.waiting = waiting
        shown = "\n  ".join(waiting) if waiting else "(no tasks)"
        super().__init__(
            f"simulation deadlock at t={now:.6f}: nothing is runnable and no timer is "
            f"scheduled, so these tasks wait forever:\n  {shown}"
        )


def _fd(fileobj: FileDescriptorLike) -> int:
    return fileobj if isinstance(fileobj, int) else fileobj.fileno()


@final
class _VirtualSelector(selectors.BaseSelector):
    """Keeps registrations (asyncio needs its self-pipe registered) but never polls them."""

    def __init__(self, loop: SimEventLoop) -> None:
        self._loop = loop
        self._keys: dict[FileDescriptorLike, selectors.SelectorKey] = {}  # by fd
        self.sealed = False  # set once the loop's own self-pipe is registered

    def register(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        if self.sealed:
            raise SimulationError(
                "real I/O is not available in the simulator: route it through env.bus, "
                "env.store or another injected fake"
            )
        fd = _fd(fileobj)
        if fd in self._keys:
            raise KeyError(f"{fileobj!r} (fd {fd}) is already registered")
        key = selectors.SelectorKey(fileobj, fd, events, data)
        self._keys[fd] = key
        return key

    def unregister(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        return self._keys.pop(_fd(fileobj))

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        return []  # never asked: SimEventLoop._run_once moves the clock itself

    def get_map(self) -> Mapping[FileDescriptorLike, selectors.SelectorKey]:
        return self._keys

    def close(self) -> None:
        self._keys.clear()


@final
class SimEventLoop(asyncio.SelectorEventLoop):
    """An event loop on virtual time, starting at `start` seconds. No threads, no I/O.

    Raises Deadlock out of `run_until_complete` when every task waits on something that
    nothing scheduled will ever resolve. Threads (`run_in_executor`, `asyncio.to_thread`)
    and real I/O raise SimulationError at once.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._timers: list[float] = []  # a heap of the instants that have a bucket
        self._buckets: dict[float, list[Any]] = {}  # instant -> its TimerHandles, in order
        self._timer_handles = 0  # in all buckets, cancelled ones included
        self._frozen: set[str] = set()  # processes stopped (freeze); membership tests only
        self._held: list[asyncio.Handle] = []  # their callbacks that came due, in that order
        selector = _VirtualSelector(self)
        super().__init__(selector)
        selector.sealed = True

    def time(self) -> float:
        return self._now

    def freeze(self, name: str) -> None:
        """Stop the process `name` (SIGSTOP): none of its callbacks runs until `thaw`."""
        self._frozen.add(name)

    def thaw(self, name: str) -> None:
        """Let the process `name` run again (SIGCONT): what came due meanwhile runs now."""
        self._frozen.discard(name)
        held, self._held = self._held, []
        ready: Any = self._ready  # type: ignore[attr-defined]
        for handle in held:
            if handle._context.get(PROCESS) == name:  # type: ignore[attr-defined]
                ready.append(handle)
            else:
                self._held.append(handle)

    def frozen(self, name: str) -> bool:
        return name in self._frozen

    # -- the scheduling core, for virtual time ----------------------------------------------

    def call_soon(
        self, callback: Callable[[Unpack[Ts]], object], *args: *Ts, context: Any = None
    ) -> asyncio.Handle:
        if self._debug:  # type: ignore[attr-defined]
            return super().call_soon(callback, *args, context=context)
        if self.is_closed():
            raise RuntimeError("Event loop is closed")
        handle = _Soon(callback, args, self, context)
        self._ready.append(handle)  # type: ignore[attr-defined]
        return handle

    def call_later(
        self,
        delay: float,
        callback: Callable[[Unpack[Ts]], object],
        *args: *Ts,
        context: Any = None,
    ) -> asyncio.TimerHandle:
        if delay is None:
            raise TypeError("delay must not be None")
        return self.call_at(self._now + delay, callback, *args, context=context)

    def call_at(
        self,
        when: float,
        callback: Callable[[Unpack[Ts]], object],
        *args: *Ts,
        context: Any = None,
    ) -> asyncio.TimerHandle:
        if self.is_closed():
            raise RuntimeError("Event loop is closed")
        if self._debug:  # type: ignore[attr-defined]
            self._check_thread()  # type: ignore[attr-defined]
            self._check_callback(callback, "call_at")  # type: ignore[attr-defined]
            timer = asyncio.TimerHandle(when, callback, args, self, context)
            timer._scheduled = True  # type: ignore[attr-defined]
        else:
            timer = _Timer(when, callback, args, self, context)
        bucket = self._buckets.get(when)
        if bucket is None:
            self._buckets[when] = [timer]
            _heappush(self._timers, when)
        else:
            bucket.append(timer)
        self._timer_handles += 1
        return timer

    def _run_once(self) -> None:
        """One turn: run what is ready; when nothing is, jump the clock to the next timer.

        The same steps as asyncio's `_run_once` without polling, without the clock-resolution
        slack (virtual time lands on a timer's `when` exactly) and with cheaper timers."""
        timers = self._timers
        buckets = self._buckets
        ready: Any = self._ready  # type: ignore[attr-defined]
        if self._timer_cancelled_count > _PURGE_AT and 2 * self._timer_cancelled_count > (
            self._timer_handles
        ):
            self._purge_cancelled()
        if not ready:
            # The clock may only move to an instant with a live timer: drop the dead buckets
            # in front (all of whose timers were cancelled).
            while timers:
                bucket = buckets[timers[0]]
                if not all(handle._cancelled for handle in bucket):
                    break
                self._drop(_heappop(timers))
            if not timers:
                if not self._stopping:  # type: ignore[attr-defined]
                    self._deadlock()
                return
            if not self._stopping and timers[0] > self._now:  # type: ignore[attr-defined]
                if timers[0] == math.inf:
                    self._deadlock()  # `sleep(inf)` and the like: nothing will ever run again
                self._now = timers[0]
        now = self._now
        while timers and timers[0] <= now:
            bucket = buckets.pop(_heappop(timers))
            self._timer_handles -= len(bucket)
            for handle in bucket:
                handle._scheduled = False
                if handle._cancelled:
                    self._timer_cancelled_count -= 1
                else:
                    ready.append(handle)
        frozen = self._frozen
        for _ in range(len(ready)):
            handle = ready.popleft()
            if not handle._cancelled:
                if frozen and handle._context.get(PROCESS) in frozen:
                    self._held.append(handle)
                    continue
                handle._run()

    def _drop(self, when: float) -> None:
        """Forget the bucket of `when`, every timer of which was cancelled."""
        bucket = self._buckets.pop(when)
        self._timer_handles -= len(bucket)
        self._timer_cancelled_count -= len(bucket)
        for handle in bucket:
            handle._scheduled = False

    def _purge_cancelled(self) -> None:
        buckets = self._buckets
        for when, bucket in list(buckets.items()):
            kept = []
            for handle in bucket:
                if handle._cancelled:
                    handle._scheduled = False
                else:
                    kept.append(handle)
            if kept:
                buckets[when] = kept
            else:
                del buckets[when]
        # In place: the turn in progress holds these.
        self._timers[:] = list(buckets)
        heapq.heapify(self._timers)
        self._timer_handles = sum(len(bucket) for bucket in buckets.values())
        self._timer_cancelled_count = 0

    def close(self) -> None:
        super().close()  # first: it refuses to close a running loop, and then nothing is lost
        self._timers.clear()
        self._buckets.clear()
        self._timer_handles = 0

    def _deadlock(self) -> None:
        waiting = sorted(_describe(task) for task in asyncio.all_tasks(self) if not task.done())
        if len(waiting) > _MAX_LISTED:
            waiting[_MAX_LISTED:] = [f"... and {len(waiting) - _MAX_LISTED} more"]
        raise Deadlock(self._now, waiting)

    def run_in_executor(
        self, executor: Executor | None, func: Callable[[Unpack[Ts]], T], *args: *Ts
    ) -> asyncio.Future[T]:
        # A thread would finish in real time, which the virtual clock cannot wait for.
        raise SimulationError(
            f"threads are not available in the simulator (run_in_executor/to_thread of "
            f"{func!r}): give the simulated code an async fake instead"
        )


def _describe(task: asyncio.Task[Any]) -> str:
    frames = task.get_stack(limit=1)
    where = ""
    if frames:
        code = frames[-1].f_code
        where = f" at {code.co_filename}:{frames[-1].f_lineno} in {code.co_name}"
    return f"{task.get_name()}: {task.get_coro()!r}{where}"


def run_simulation(main: Coroutine[Any, Any, T], *, start: float = 0.0) -> T:
    """Run `main` to completion on a fresh SimEventLoop and return its result."""
    with (
        _young_garbage_collected_rarely(),
        asyncio.Runner(loop_factory=lambda: SimEventLoop(start)) as runner,
    ):
        return runner.run(main)


@contextlib.contextmanager
def _young_garbage_collected_rarely() -> Iterator[None]:
    # At these thresholds a full collection comes only after about 10^8 allocations, later
    # than a run ends: the cycles an earlier run left (its world, tasks and loop) would pile up
    # in a process that runs seed after seed (the fuzz's workers grew 25 MiB a run). So every
    # run starts by collecting them.
    gc.collect()
    before = gc.get_threshold()
    gc.set_threshold(*_SIM_GC_THRESHOLD)
    try:
        yield
    finally:
        gc.set_threshold(*before)
