"""`kill -USR1 PID` prints every asyncio task of a gpumesh process, with where each waits, to
stderr: what a process that seems stuck is waiting on, without stopping it (as a Go program's
SIGQUIT, less the exit). Installed by gpumesh/cli.py for every command."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Coroutine, Iterator
from typing import Any, TextIO, TypeVar

T = TypeVar("T")

DUMP_SIGNAL = signal.SIGUSR1


def dump_tasks(out: TextIO | None = None, *, loop: asyncio.AbstractEventLoop | None = None) -> int:
    """Write each unfinished task of `loop` (the running one) and its stack; how many."""
    out = out if out is not None else sys.stderr
    tasks = sorted((t for t in asyncio.all_tasks(loop) if not t.done()), key=lambda t: t.get_name())
    print(f"== {len(tasks)} asyncio task(s)", file=out)
    for task in tasks:
        print(f"-- {task.get_name()}: {task.get_coro()!r}", file=out)
        task.print_stack(limit=12, file=out)
    out.flush()
    return len(tasks)


@contextlib.contextmanager
def task_dump_on_signal(loop: asyncio.AbstractEventLoop) -> Iterator[None]:
    """Dump the tasks on DUMP_SIGNAL while inside; the previous handler is put back after.
    A loop that cannot take signal handlers (not the main thread) goes without."""
    previous = signal.getsignal(DUMP_SIGNAL)
    try:
        loop.add_signal_handler(DUMP_SIGNAL, dump_tasks)
    except (RuntimeError, ValueError, NotImplementedError):
        yield
        return
    try:
        yield
    finally:
        loop.remove_signal_handler(DUMP_SIGNAL)
        if previous is not None:
            signal.signal(DUMP_SIGNAL, previous)


async def with_task_dump(main: Coroutine[Any, Any, T]) -> T:
    """Await `main` with task_dump_on_signal in place."""
    with task_dump_on_signal(asyncio.get_running_loop()):
        return await main
