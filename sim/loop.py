"""A virtual-time asyncio loop: production coroutines run unchanged, timers cost no wall time.

The loop is a stock SelectorEventLoop whose selector never polls. When nothing is runnable,
asyncio asks the selector to wait until the next timer; ours adds that wait to the virtual
clock and returns at once. So `asyncio.sleep`, `asyncio.timeout`, `call_later`, Queues and
Tasks keep their exact semantics, and a simulated day of hourly timers takes milliseconds.
"""

from __future__ import annotations

import asyncio
import selectors
from collections.abc import Callable, Coroutine, Mapping
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, TypeVar, TypeVarTuple, Unpack, final

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

T = TypeVar("T")
Ts = TypeVarTuple("Ts")

_MAX_LISTED = 50  # tasks named in a Deadlock message; a big simulation has thousands


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
        if timeout is None:
            # asyncio passes None only when nothing is ready and no timer is scheduled.
            self._loop._deadlock()
        elif timeout > 0:
            self._loop._advance(timeout)
        return []

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
        selector = _VirtualSelector(self)
        super().__init__(selector)
        selector.sealed = True

    def time(self) -> float:
        return self._now

    def _advance(self, seconds: float) -> None:
        self._now += seconds

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
    with asyncio.Runner(loop_factory=lambda: SimEventLoop(start)) as runner:
        return runner.run(main)
