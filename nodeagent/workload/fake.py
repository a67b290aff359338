"""An in-memory workload driver: replicas that start, get ready, crash and stop on command.

For the agent's unit tests and the simulator: no processes, no sockets, no threads, so it runs
on the virtual-time loop.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Sequence

from events.cluster import ClusterSpec

from .base import WorkloadEnded, WorkloadStartError
from .probing import ProbeSettings

SIGTERM_EXIT = -15  # how asyncio reports a process ended by SIGTERM
SIGKILL_EXIT = -9


class FakeWorkload:
    """Implements RunningWorkload; the test (or simulator) drives it."""

    def __init__(
        self,
        driver: FakeDriver,
        replica_id: str,
        epoch: int,
        spec: ClusterSpec,
        gpu_indices: tuple[int, ...],
        port: int,
    ) -> None:
        self.driver = driver
        self.replica_id = replica_id
        self.epoch = epoch
        self.spec = spec
        self.gpu_indices = gpu_indices
        self._port = port
        self.ready = False
        self.alive = True
        self.stop_grace: float | None = None  # set once stop() was called
        self._ended: WorkloadEnded | None = None
        self._changed = asyncio.Event()

    @property
    def port(self) -> int:
        return self._port

    # Controls.

    def make_ready(self) -> None:
        if self.alive and self._ended is None:
            self.ready = True
            self._changed.set()

    def readiness_timed_out(self, timeout_s: float) -> None:
        """Still loading when its readiness timeout ends: what the real prober reports."""
        if self.alive and not self.ready and self._ended is None:
            detail = f"not ready within {timeout_s:g} s"
            self._ended = WorkloadEnded("readiness_timeout", detail=detail)
            self._changed.set()

    def crash(self, exit_code: int = 1) -> None:
        """The process exits on its own."""
        if self.alive:
            self.alive = False
            self._ended = WorkloadEnded("exited", exit_code)
            self._changed.set()

    def fail_liveness(self, detail: str = "fake liveness failure") -> None:
        """The process hangs: still alive, no longer answering."""
        if self.alive and self._ended is None:
            self._ended = WorkloadEnded("liveness_failed", detail=detail)
            self._changed.set()

    # RunningWorkload.

    async def wait_ready(self) -> WorkloadEnded | None:
        while True:
            if self._ended is not None:
                return self._ended
            if self.ready:
                return None
            self._changed.clear()
            await self._changed.wait()

    async def wait_ended(self) -> WorkloadEnded:
        while self._ended is None:
            self._changed.clear()
            await self._changed.wait()
        return self._ended

    async def stop(self, grace_s: float) -> WorkloadEnded:
        self.stop_grace = grace_s
        if not self.alive:
            return WorkloadEnded("stopped", self._exit_code())
        exit_code = SIGTERM_EXIT
        if self.driver.ignore_sigterm:
            try:
                await asyncio.sleep(grace_s)
            finally:
                self.alive = False  # SIGKILL: also when the stop itself is cancelled
            exit_code = SIGKILL_EXIT
        self.alive = False
        self._ended = self._ended or WorkloadEnded("stopped", exit_code)
        self._changed.set()
        return WorkloadEnded("stopped", exit_code)

    def _exit_code(self) -> int | None:
        return self._ended.exit_code if self._ended is not None else None


class FakeDriver:
    """Implements WorkloadDriver in memory.

    `auto_ready`: workloads pass readiness `ready_delay_s` after they start. `exit_on_start`:
    every workload exits at once with that code (a crash loop). `start_error`: start() raises
    WorkloadStartError with it. `start_gate`: start() waits for it (to observe the agent
    mid-action). `ignore_sigterm`: stop() takes the whole grace period, then SIGKILLs.
    `probes`: the agent's probe settings, with each spec's `[probes]` over them as the real
    drivers do: a workload whose `ready_delay_s` is longer than its readiness timeout ends
    with `readiness_timeout` when the timeout does.
    """

    def __init__(
        self,
        *,
        auto_ready: bool = True,
        ready_delay_s: float = 0.0,
        exit_on_start: int | None = None,
        start_error: str | None = None,
        ignore_sigterm: bool = False,
        first_port: int = 20_000,
        probes: ProbeSettings | None = None,
    ) -> None:
        self.auto_ready = auto_ready
        self.ready_delay_s = ready_delay_s
        self.exit_on_start = exit_on_start
        self.start_error = start_error
        self.ignore_sigterm = ignore_sigterm
        self.probes = probes if probes is not None else ProbeSettings()
        self.start_gate: asyncio.Event | None = None
        self.started: list[FakeWorkload] = []
        self.start_calls = 0  # counted before the gate, so a test sees a start in progress
        self.host = "127.0.0.1"
        self._ports = itertools.count(first_port)

    def running(self) -> list[FakeWorkload]:
        return [w for w in self.started if w.alive]

    def latest(self, replica_id: str, epoch: int) -> FakeWorkload:
        for workload in reversed(self.started):
            if (workload.replica_id, workload.epoch) == (replica_id, epoch):
                return workload
        raise KeyError(f"{replica_id}@{epoch} was never started")

    async def start(
        self,
        replica_id: str,
        epoch: int,
        spec: ClusterSpec,
        gpu_indices: Sequence[int],
        port: int,
    ) -> FakeWorkload:
        self.start_calls += 1
        if self.start_gate is not None:
            await self.start_gate.wait()
        if self.start_error is not None:
            raise WorkloadStartError(self.start_error)
        port = port or spec.port or next(self._ports)
        workload = FakeWorkload(self, replica_id, epoch, spec, tuple(gpu_indices), port)
        self.started.append(workload)
        if self.exit_on_start is not None:
            workload.crash(self.exit_on_start)
        elif self.auto_ready:
            # Timers, not tasks: nothing to own or cancel if the workload goes first.
            loop = asyncio.get_running_loop()
            timeout = self.probes.for_spec(spec).readiness_timeout_s
            if self.ready_delay_s > timeout:
                loop.call_later(timeout, workload.readiness_timed_out, timeout)
            else:
                loop.call_later(self.ready_delay_s, workload.make_ready)
        return workload
