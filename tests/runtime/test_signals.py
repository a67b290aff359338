"""Signal handling, in-process and against a real child process."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path
from types import FrameType

import pytest

from runtime import install_signal_handlers

REPO = Path(__file__).resolve().parents[2]
real_loop_only = pytest.mark.asyncio(loop_factories=["asyncio"])


@real_loop_only
async def test_first_and_later_signals_reach_their_callbacks_and_handlers_are_restored() -> None:
    def previous_handler(signum: int, frame: FrameType | None) -> None:
        raise AssertionError("the installed handler should have taken this signal")

    old = signal.signal(signal.SIGUSR1, previous_handler)
    try:
        first = asyncio.Event()
        later = [asyncio.Event(), asyncio.Event()]
        count = 0

        def on_second() -> None:
            nonlocal count
            later[count].set()
            count += 1

        loop = asyncio.get_running_loop()
        with install_signal_handlers(loop, first.set, on_second, signals=[signal.SIGUSR1]):
            os.kill(os.getpid(), signal.SIGUSR1)
            await asyncio.wait_for(first.wait(), 10)
            assert count == 0
            for event in later:  # every signal after the first goes to on_second
                os.kill(os.getpid(), signal.SIGUSR1)
                await asyncio.wait_for(event.wait(), 10)
        assert signal.getsignal(signal.SIGUSR1) is previous_handler
    finally:
        signal.signal(signal.SIGUSR1, old)


async def _start_child(*args: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "tests.runtime.signal_child",
        *args,
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )


async def _read_until(proc: asyncio.subprocess.Process, marker: str, seen: list[str]) -> None:
    assert proc.stdout is not None
    while True:
        raw = await asyncio.wait_for(proc.stdout.readline(), 20)
        if not raw:
            raise AssertionError(f"child exited before {marker!r}; output: {seen}")
        seen.append(raw.decode().rstrip())
        if marker in seen[-1]:
            return


async def _finish(proc: asyncio.subprocess.Process, seen: list[str]) -> int:
    assert proc.stdout is not None
    rest = await asyncio.wait_for(proc.stdout.read(), 20)
    seen.extend(rest.decode().splitlines())
    return await asyncio.wait_for(proc.wait(), 20)


@real_loop_only
async def test_sigterm_stops_a_real_process_gracefully() -> None:
    proc = await _start_child()
    seen: list[str] = []
    try:
        await _read_until(proc, "ready", seen)
        proc.send_signal(signal.SIGTERM)
        code = await _finish(proc, seen)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0, seen
    assert "on_stop service" in seen
    assert seen[-1] == "exited"


@real_loop_only
async def test_a_second_sigterm_forces_phase_two() -> None:
    proc = await _start_child("stuck")
    seen: list[str] = []
    try:
        await _read_until(proc, "ready", seen)
        await _read_until(proc, "hanging", seen)
        proc.send_signal(signal.SIGTERM)
        await _read_until(proc, "signal_received", seen)  # phase 1 waits on "stuck" now
        proc.send_signal(signal.SIGTERM)
        code = await _finish(proc, seen)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert code == 0, seen
    assert not [line for line in seen if "on_stop" in line]  # all cancelled in phase 2
    assert seen[-1] == "exited"
