"""A small service for the signal tests: serves until SIGTERM, then shuts down.

`python -m tests.runtime.signal_child [stuck]`; prints one line per milestone on stdout.
With `stuck`, one actor never finishes its message, so only a second signal ends phase 1.
"""

from __future__ import annotations

import asyncio
import sys

from events import MemoryEventStore
from runtime import Actor, ActorContext, ActorSystem, run_until_signal
from runtime.real_env import real_env


def say(line: str) -> None:
    print(line, flush=True)


class Service(Actor[str]):
    async def handle(self, ctx: ActorContext[str], msg: str) -> object:
        if msg == "hang":
            say("hanging")
            await asyncio.Event().wait()
        return None

    async def on_stop(self, ctx: ActorContext[str]) -> None:
        say(f"on_stop {ctx.name}")


async def serve(system: ActorSystem) -> None:
    """Serve until cancelled (the first signal), then shut the system down gracefully."""
    try:
        await asyncio.Event().wait()
    finally:
        await system.shutdown(600)


async def main(stuck: bool) -> None:
    async with ActorSystem(real_env(MemoryEventStore(), seed=1)) as system:
        await system.spawn(Service, "service")
        if stuck:
            await (await system.spawn(Service, "stuck")).tell("hang")
        await run_until_signal(
            serve(system), on_second=system.force_stop, ready=lambda: say("ready")
        )
    say("exited")


if __name__ == "__main__":
    asyncio.run(main(stuck="stuck" in sys.argv[1:]))
