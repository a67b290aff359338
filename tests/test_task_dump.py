"""SIGUSR1 prints a process's asyncio tasks, and where each waits, and the process goes on."""

from __future__ import annotations

import asyncio
import io
import os
import signal

import pytest

from runtime.task_dump import DUMP_SIGNAL, dump_tasks, task_dump_on_signal, with_task_dump


async def _parked(gate: asyncio.Event) -> None:
    await gate.wait()


async def test_dump_names_each_task_and_the_line_it_waits_on() -> None:
    gate = asyncio.Event()
    async with asyncio.TaskGroup() as tasks:
        tasks.create_task(_parked(gate), name="parked-one")
        await asyncio.sleep(0)
        out = io.StringIO()
        count = dump_tasks(out)
        gate.set()
    text = out.getvalue()
    assert count >= 2  # this test's own task and the parked one
    assert "-- parked-one: <coroutine object _parked" in text
    assert "await gate.wait()" in text  # the stack shows where it waits


async def test_the_signal_dumps_and_the_process_goes_on(capsys: pytest.CaptureFixture[str]) -> None:
    gate = asyncio.Event()

    async def main() -> str:
        async with asyncio.TaskGroup() as tasks:
            tasks.create_task(_parked(gate), name="waits-for-the-gate")
            await asyncio.sleep(0)
            os.kill(os.getpid(), DUMP_SIGNAL)
            await asyncio.sleep(0.05)  # the handler runs on the loop
            gate.set()
        return "went on"

    before = signal.getsignal(DUMP_SIGNAL)
    assert await with_task_dump(main()) == "went on"
    assert "-- waits-for-the-gate:" in capsys.readouterr().err
    assert signal.getsignal(DUMP_SIGNAL) == before  # put back


def test_a_loop_that_cannot_take_signals_goes_without() -> None:
    class NoSignals(asyncio.SelectorEventLoop):
        def add_signal_handler(self, *args: object) -> None:
            raise RuntimeError("not the main thread")

    loop = NoSignals()
    try:
        with task_dump_on_signal(loop):
            pass
    finally:
        loop.close()
