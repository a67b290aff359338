"""SIGTERM/SIGINT handling: the first signal starts a graceful shutdown, a second forces it."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import structlog

from .system import ActorSystem

DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM, signal.SIGINT)

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
    system: ActorSystem,
    *,
    timeout: float | None = None,
    signals: Sequence[signal.Signals] = DEFAULT_SIGNALS,
    ready: Callable[[], None] | None = None,
) -> None:
    """Serve until SIGTERM/SIGINT, then shut `system` down (phase 1 up to `timeout`); a
    second signal forces phase 2 at once. `ready` is called once the handlers are in place.
    """
    loop = asyncio.get_running_loop()
    first = asyncio.Event()
    with install_signal_handlers(loop, first.set, system.force_stop, signals=signals):
        if ready is not None:
            ready()
        await first.wait()
        await system.shutdown(timeout)
