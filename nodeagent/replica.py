"""One replica on this node: launch it, watch it, restart it in place, give up on a crash loop.

A ReplicaRunner's `run()` is a task in the agent's TaskGroup. It returns after giving up
(state "failed"); cancelling it is how the replica is stopped, whether for a StopReplica or
because the agent shuts down: it then stops the workload within the grace period and reports
"stopped".
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from events.cluster import ClusterSpec
from events.contract.messages import ReplicaRunState, ReplicaState, StartReplica
from runtime.env import Env
from runtime.supervision import CrashWindow

from .config import AgentConfig
from .stage import worker_address
from .workload.base import RunningWorkload, WorkloadDriver, WorkloadEnded, WorkloadStartError

Publish = Callable[[ReplicaState], Awaitable[None]]
LeaseWait = Callable[[str, int], Awaitable[None]]


async def _no_lease_needed(replica_id: str, epoch: int) -> None:
    return None


class ReplicaRunner:
    def __init__(
        self,
        command: StartReplica,
        *,
        env: Env,
        driver: WorkloadDriver,
        config: AgentConfig,
        publish: Publish,
        advertise: str = "",
        leased: LeaseWait = _no_lease_needed,
        prepare: Callable[[], ClusterSpec] | None = None,
        worker: bool = False,
    ) -> None:
        """`advertise`: the address to report instead of the workload's own (the node's
        front, which fences it). `leased`: returns once the node's lease covers this replica
        (or gives up waiting), so it is not reported ready while its node would refuse it.
        `prepare`: what the driver runs, made before each launch when not the command's
        spec (its secrets resolved, on this node only); a WorkloadStartError from it is a
        failed start, restarted with back-off like any other (a secret file may appear).
        `worker`: a pipeline's worker stage, whose address is host:port for the head's
        engine, not a URL."""
        self._worker = worker
        self._prepare = prepare
        self.key = (command.replica_id, command.epoch)
        self._advertise = advertise
        self._command = command
        self._env = env
        self._log: Any = env.log.bind(replica=f"{command.replica_id}@{command.epoch}")
        self._driver = driver
        self._config = config
        self._publish = publish
        self._leased = leased
        self._port = command.port
        self._workload: RunningWorkload | None = None
        self._stop_grace_s = config.stop_grace_s
        self._stop_reason = "agent shutting down"
        self.launched = asyncio.Event()  # set once the first launch was attempted
        self.state = ReplicaState(
            replica_id=command.replica_id, epoch=command.epoch, state="starting", port=self._port
        )

    @property
    def command(self) -> StartReplica:
        """What it runs: the start command, its spec already the stage's for a pipeline."""
        return self._command

    def prepare_stop(self, grace_s: float, reason: str) -> None:
        """Say how the coming cancellation should stop the workload."""
        self._stop_grace_s = grace_s
        self._stop_reason = reason or "stop requested"

    async def mark_stopped(self) -> None:
        """For a replica that already gave up: its workload is gone, only the state changes."""
        await self._set("stopped", detail=self._stop_reason, exit_code=self.state.exit_code)

    async def run(self) -> None:
        try:
            await self._supervise()
        except asyncio.CancelledError:
            await self._wind_down()
            raise
        except Exception as exc:
            # A bug here must cost this replica, not the agent and every other replica.
            self._log.exception("replica_runner_crashed")
            try:
                await self._wind_down(state="failed", detail=f"agent error: {exc!r}")
            except Exception:
                self._log.exception("replica_cleanup_failed")
        finally:
            self.launched.set()

    async def _supervise(self) -> None:
        policy = self._config.restart
        failures = CrashWindow(policy.window_s)
        restarts = 0
        detail = ""
        while True:
            ended = await self._attempt(detail)
            recent = failures.record(self._env.clock.monotonic())
            if recent > policy.max_restarts:
                self._log.error("replica_crash_loop", failures=recent, last=ended.describe())
                await self._set(
                    "failed",
                    detail=f"crash loop: {recent} failures within {policy.window_s:g} s, "
                    f"gave up (last: {ended.describe()})",
                    exit_code=ended.exit_code,
                )
                return
            restarts += 1
            detail = f"restart {restarts} after {ended.describe()}"
            delay = policy.backoff(recent)
            self._log.warning("replica_restarting", restart=restarts, delay_s=delay, why=detail)
            # Not ready while it is down: say so at once (and in every heartbeat meanwhile), so
            # nothing routes to a dead address during the back-off.
            await self._set("starting", detail=detail)
            await asyncio.sleep(delay)

    async def _attempt(self, detail: str) -> WorkloadEnded:
        """Launch once and watch until the workload ends; nothing of it is left running after."""
        c = self._command
        try:
            spec = self._prepare() if self._prepare is not None else c.spec
            workload = await self._driver.start(
                c.replica_id, c.epoch, spec, c.gpu_indices, self._port
            )
        except (WorkloadStartError, OSError) as exc:
            self._log.warning("replica_launch_failed", error=str(exc))
            return WorkloadEnded("start_failed", detail=str(exc))
        finally:
            self.launched.set()
        self._workload = workload
        # Later restarts keep the port, so the replica's address stays what routing knows.
        self._port = workload.port
        await self._set("starting", detail=detail)
        ended = await workload.wait_ready()
        if ended is None:
            # Ready is when the controller starts routing here: not before this node's lease
            # covers the replica, or the first requests would meet its own fence.
            await self._leased(c.replica_id, c.epoch)
            await self._set("ready")
            ended = await workload.wait_ended()
        # After a readiness timeout or a failed liveness probe it may still run: end it first.
        await workload.stop(self._config.stop_grace_s)
        self._workload = None
        return ended

    async def _wind_down(self, state: ReplicaRunState = "stopped", detail: str = "") -> None:
        workload, self._workload = self._workload, None
        exit_code = self.state.exit_code
        if workload is not None:
            exit_code = (await workload.stop(self._stop_grace_s)).exit_code
        await self._set(state, detail=detail or self._stop_reason, exit_code=exit_code)

    async def _set(
        self, state: ReplicaRunState, *, detail: str = "", exit_code: int | None = None
    ) -> None:
        previous = self.state
        self.state = ReplicaState(
            replica_id=self._command.replica_id,
            epoch=self._command.epoch,
            state=state,
            port=self._port,
            address=self._address() if self._port else "",
            detail=detail,
            exit_code=exit_code,
        )
        if self.state == previous:
            return  # nothing new to report (a relaunch after the crash was already reported)
        self._log.info("replica_state", state=state, port=self._port, detail=detail)
        await self._publish(self.state)

    def _address(self) -> str:
        if self._worker:
            return worker_address(self._config.address, self._port)
        return self._advertise or http_address(self._config.address, self._port)


def http_address(host: str, port: int) -> str:
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"  # an IPv6 literal
    return f"http://{host}:{port}"
