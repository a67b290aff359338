"""Run a replica as a local process group: the command from the spec, probed over HTTP.

Each workload gets its own session (start_new_session), so a stop reaches the worker processes
a model server forks, not only the one we spawned. It dies with the agent, and what it forked
is stopped by the agent's next run (leftovers.py).
"""

from __future__ import annotations

import asyncio
import os
import shlex
import signal
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

import structlog

from events.cluster import ClusterSpec

from .base import (
    WorkloadEnded,
    WorkloadStartError,
    gpu_ids,
    model_name,
    no_model_cache,
    render_args,
)
from .engines import missing_program
from .leftovers import Records, die_with_parent
from .ports import free_port
from .probing import ProbeSettings, exit_within, probe_urls, wait_ready, watch

_log = structlog.get_logger("gpumesh.nodeagent.process")

_GROUP_POLL_S = 0.05


class ProcessDriver:
    """Implements WorkloadDriver with local processes; output goes to
    `log_dir/<replica_id>-<epoch>.log` (appended to across restarts)."""

    def __init__(
        self,
        log_dir: Path,
        *,
        probes: ProbeSettings | None = None,
        host: str = "127.0.0.1",
        records: Records | None = None,
        model_cache: str = "",
    ) -> None:
        self.log_dir = log_dir
        self.probes = probes if probes is not None else ProbeSettings()
        self.host = host  # where the probes reach the workload
        self.records = records  # what is running, for the agent's next run (leftovers.py)
        self.model_cache = model_cache  # {model_cache} in a command

    def log_path(self, replica_id: str, epoch: int) -> Path:
        return self.log_dir / f"{replica_id}-{epoch}.log"

    async def start(
        self,
        replica_id: str,
        epoch: int,
        spec: ClusterSpec,
        gpu_indices: Sequence[int],
        port: int,
    ) -> ProcessWorkload:
        try:
            template = shlex.split(spec.command)
        except ValueError as exc:
            raise WorkloadStartError(f"cannot parse the command {spec.command!r}: {exc}") from None
        if not template:
            raise WorkloadStartError(f"cluster {spec.name!r} has no command to run")
        port = port or spec.port or free_port(self.host)
        ids = gpu_ids(gpu_indices)
        if "{model_cache}" in spec.command and not self.model_cache:
            raise WorkloadStartError(no_model_cache(spec.name))
        argv = render_args(
            template, port=port, gpu_ids=ids, model=model_name(spec), model_cache=self.model_cache
        )
        env = {
            **os.environ,
            **spec.env,
            **spec.secret_env,  # the values, resolved by the agent (Agent._with_secrets)
            "CUDA_VISIBLE_DEVICES": ids,
            "GPUMESH_REPLICA_ID": replica_id,
            "GPUMESH_EPOCH": str(epoch),
            "GPUMESH_PORT": str(port),
        }
        log_path = self.log_path(replica_id, epoch)
        log_file = await asyncio.to_thread(_open_log, log_path, argv, ids)
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=asyncio.subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        except FileNotFoundError:
            raise WorkloadStartError(missing_program(argv[0])) from None
        except OSError as exc:
            raise WorkloadStartError(f"cannot run {argv[0]!r}: {exc.strerror or exc}") from None
        finally:
            log_file.close()  # the child holds its own copy of the descriptor
        _log.info("workload_launched", replica=replica_id, epoch=epoch, pid=proc.pid, port=port)
        ready_url, live_url = probe_urls(spec, self.host, port)
        forget = None
        if self.records is not None:
            records = self.records
            await asyncio.to_thread(records.write, replica_id, epoch, proc.pid, port)

            def forget() -> None:
                records.remove(replica_id, epoch)

        return ProcessWorkload(
            proc,
            port=port,
            url=ready_url,
            liveness_url=live_url,
            probes=self.probes.for_spec(spec),
            log_path=log_path,
            on_gone=forget,
        )


def _open_log(path: Path, argv: Sequence[str], ids: str) -> IO[bytes]:
    path.parent.mkdir(parents=True, exist_ok=True)
    log_file = path.open("ab")
    header = f"# gpumesh: CUDA_VISIBLE_DEVICES={ids} {shlex.join(argv)}\n"
    log_file.write(header.encode())
    log_file.flush()
    return log_file


class ProcessWorkload:
    """Implements RunningWorkload for one process group."""

    def __init__(
        self,
        proc: asyncio.subprocess.Process,
        *,
        port: int,
        url: str,
        probes: ProbeSettings,
        liveness_url: str = "",
        log_path: Path,
        on_gone: Callable[[], None] | None = None,
    ) -> None:
        self._on_gone = on_gone  # once the whole group has ended
        self._proc = proc
        self._port = port
        self.url = url  # the readiness probe's
        self.liveness_url = liveness_url or url
        self._probes = probes
        self.log_path = log_path

    @property
    def port(self) -> int:
        return self._port

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return self._proc.returncode

    async def wait_exit(self) -> int:
        """The exit code, once the process has exited (negative: the signal that ended it)."""
        return await self._proc.wait()

    async def wait_ready(self) -> WorkloadEnded | None:
        return await wait_ready(self.url, self._probes, self._proc.wait)

    async def wait_ended(self) -> WorkloadEnded:
        return await watch(self.liveness_url, self._probes, self._proc.wait)

    async def stop(self, grace_s: float) -> WorkloadEnded:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + max(grace_s, 0.0)
        try:
            if self._group_alive():
                self._signal_group(signal.SIGTERM)
                await exit_within(self._proc.wait, deadline - loop.time())
                # The leader may exit before the workers it forked: give them the rest of the
                # grace period too. Polling: no event announces the end of processes that are
                # not our children.
                while self._group_alive() and loop.time() < deadline:  # noqa: ASYNC110
                    await asyncio.sleep(_GROUP_POLL_S)
            if self._group_alive():
                _log.warning("workload_killed", pid=self.pid, grace_s=grace_s)
                self._signal_group(signal.SIGKILL)
            code = await self._proc.wait()
        except asyncio.CancelledError:
            # No time left for grace: make sure nothing keeps holding the GPU.
            self._signal_group(signal.SIGKILL)
            raise
        if self._on_gone is not None and not self._group_alive():
            await asyncio.to_thread(self._on_gone)
        return WorkloadEnded("stopped", code)

    def _group_alive(self) -> bool:
        # True while any member lives, the leader included (also while it is an unreaped
        # zombie); once asyncio has reaped the leader, only its workers keep the group alive.
        try:
            os.killpg(self._proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True  # a member changed its user (setuid); it still exists
        return True

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self._proc.pid, sig)
        except ProcessLookupError:
            pass  # everyone already gone
