"""SIGTERM/SIGINT handling for every entry point: the first signal starts a graceful stop, a
second one forces it. `run_until_signal` is the one way a gpumesh process serves until told to
stop; `install_signal_handlers` is its building block."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import structlog

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)

T = TypeVar("T")

_log = structlog.get_logger("gpumesh.shutdown")


@contextmanager
def install_signal_handlers(
    loop: asyncio.AbstractEventLoop,
    on_first: Callable[[], None],
    on_second: Callable[[], None],
    *,
    signals: Sequence[signal.Signals] = DEFAULT_SIGNALS,
) -> Iterator[None]:
    """Call `on_first` on the first of `signals`, `on_second` on every later one.

    The callbacks run on the loop, not in a signal frame. On exit the handlers that were in
    place before (including asyncio.Runner's own SIGINT handler) are put back. Main thread
    of a Unix loop only, as for `loop.add_signal_handler`.
    """
    received = 0

    def handle(sig: signal.Signals) -> None:
        nonlocal received
        received += 1
        _log.warning("signal_received", signal=sig.name, count=received)
        if received == 1:
            on_first()
        else:
            on_second()

    previous: dict[signal.Signals, Any] = {sig: signal.getsignal(sig) for sig in signals}
    installed: list[signal.Signals] = []
    try:
        for sig in signals:
            loop.add_signal_handler(sig, handle, sig)
            installed.append(sig)
        yield
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
            # remove_signal_handler resets to the default; put back what was there.
            if previous[sig] is not None:
                signal.signal(sig, previous[sig])


async def run_until_signal(
    main: Coroutine[Any, Any, T],
    *,
    on_signal: Callable[[], None] | None = None,
    cancel: bool = True,
    on_second: Callable[[], None] | None = None,
    signals: Sequence[signal.Signals] = DEFAULT_SIGNALS,
    ready: Callable[[], None] | None = None,
) -> T | None:
    """Run `main` until it returns or the first of `signals` arrives, and return its result
    (None when a signal cancelled it).

    The first signal calls `on_signal` (if given) and then, with `cancel`, cancels `main`,
    which cleans up as it unwinds; a `main` that stops by itself when told (`on_signal` sets
    its stop event) passes `cancel=False`. Every later signal calls `on_second`: by default it
    cancels `main` again, which interrupts a clean-up that waits; a process that forces its
    stop otherwise (kill the workloads still stopping) passes its own. The handlers stay in
    place until `main` has finished, so a signal during the clean-up is never the default
    one that kills the process. `ready` is called once they are installed. What `main` raises
    is raised here.
    """
    loop = asyncio.get_running_loop()
    task = loop.create_task(main, name="main")

    def first() -> None:
        if on_signal is not None:
            on_signal()
        if cancel:
            task.cancel()

    def again() -> None:
        if on_second is not None:
            on_second()
        else:
            task.cancel()

    try:
        with install_signal_handlers(loop, first, again, signals=signals):
            if ready is not None:
                ready()
            await asyncio.wait({task})
    finally:
        if not task.done():  # we were cancelled ourselves: so is main, and we wait for it
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        return None
    return task.result()
