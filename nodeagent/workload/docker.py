"""Run a replica as a docker container with its GPUs passed through (`--gpus`).

The container publishes its port on the agent's host only; `docker wait` tells us the exit code
and `docker logs -f` copies its output to the replica's log file, because `--rm` removes the
container, and its logs with it, once it exits.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import IO

import structlog

from events.cluster import ClusterSpec

from .base import (
    DriverUnavailable,
    WorkloadEnded,
    WorkloadStartError,
    gpu_ids,
    model_name,
    no_model_cache,
    render_args,
)
from .ports import free_port
from .probing import ProbeSettings, exit_within, probe_urls, wait_ready, watch

_log = structlog.get_logger("gpumesh.nodeagent.docker")

NODE_LABEL = "gpumesh.node"
DEFAULT_CONTAINER_PORT = 8000  # what vLLM, TGI and most OpenAI-compatible servers listen on
_CLI_TIMEOUT_S = 30.0  # for the short docker commands (info, rm, stop's own round trip)
# `docker run -d` of an image already pulled returns once the container is created; only a
# stuck engine takes longer. The pull before it has no limit: large images take long.
_RUN_TIMEOUT_S = 120.0
PULL_PROGRESS_EVERY_S = 2.0
MAX_IMAGES_LISTED = 256  # a registration stays small whatever the node holds


_LAYER = re.compile(r"[0-9a-f]{2,64}")  # a layer's short id, as `docker pull` names it


class PullProgress:
    """`docker pull`'s lines, as it writes them when its output is not a terminal
    (`<layer>: Pulling fs layer`, `<layer>: Pull complete`, `<layer>: Already exists`): which
    layers it has seen, and how many are done."""

    def __init__(self) -> None:
        self.layers: dict[str, bool] = {}

    @property
    def done(self) -> int:
        return sum(self.layers.values())

    def read(self, line: str) -> None:
        layer, sep, status = line.strip().partition(": ")
        if not sep or not _LAYER.fullmatch(layer):
            return  # "Using default tag: latest", "Status: ...", "Digest: ...", "latest: ..."
        if status in ("Pull complete", "Already exists"):
            self.layers[layer] = True
        else:
            self.layers.setdefault(layer, False)


def docker_run_argv(
    docker: str,
    *,
    name: str,
    replica_id: str,
    epoch: int,
    spec: ClusterSpec,
    gpu_indices: Sequence[int],
    host: str,
    host_port: int,
    node_id: str = "",
    model_cache: str = "",
) -> list[str]:
    """The `docker run` command line for one replica; `model_cache` is the node's model cache
    directory, `{model_cache}` in the command and the volumes."""
    container_port = spec.port or DEFAULT_CONTAINER_PORT
    argv = [docker, "run", "--rm", "-d", "--name", name]
    argv += ["--label", f"gpumesh.replica={replica_id}", "--label", f"gpumesh.epoch={epoch}"]
    if node_id:
        # What the agent's next run finds its leftovers by (stop_leftovers).
        argv += ["--label", f"{NODE_LABEL}={node_id}"]
    if gpu_indices:
        # The quotes are docker's: without them the comma would split the --gpus option.
        argv += ["--gpus", f'"device={gpu_ids(gpu_indices)}"']
    argv += ["-p", f"{host}:{host_port}:{container_port}"]
    options = spec.docker
    if options.ipc:
        argv += ["--ipc", options.ipc]
    if options.shm_size:
        argv += ["--shm-size", options.shm_size]
    for volume in options.volumes:
        argv += ["-v", volume.replace("{model_cache}", model_cache)]
    # The driver has pulled the image already (DockerDriver.pull), where its progress is seen.
    argv += ["--pull", "never"]
    for key, value in spec.env.items():
        argv += ["-e", f"{key}={value}"]
    # A secret's value is not put on the command line (every local user may read it there):
    # `-e NAME` alone, and docker takes the value from its own environment (DockerDriver.start).
    for key in spec.secret_env:
        argv += ["-e", key]
    argv.append(spec.image)
    if spec.command:
        # Inside the container the passed-through GPUs are numbered from 0 again.
        local_ids = ",".join(str(i) for i in range(len(gpu_indices)))
        argv += render_args(
            shlex.split(spec.command),
            port=container_port,
            gpu_ids=local_ids,
            model=model_name(spec),
            model_cache=model_cache,
        )
    return argv


class DockerDriver:
    """Implements WorkloadDriver with `docker run`. Call `await check()` first."""

    def __init__(
        self,
        log_dir: Path,
        *,
        docker: str = "docker",
        probes: ProbeSettings | None = None,
        host: str = "127.0.0.1",
        node_id: str = "",
        model_cache: str = "",
        allowed_volumes: Sequence[str] = (),
    ) -> None:
        self.log_dir = log_dir
        self.docker = docker
        self.probes = probes if probes is not None else ProbeSettings()
        self.host = host
        self.node_id = node_id  # labels its containers; "" leaves them unlabelled
        self.model_cache = model_cache  # {model_cache} in a spec's command and volumes
        # Host directories a spec may mount besides the model cache (`--allow-volume`): a spec
        # is written by whoever may apply one, and `/:/host` would give them the node.
        self.allowed_volumes = tuple(os.path.normpath(d) for d in allowed_volumes)

    async def stop_leftovers(self) -> list[str]:
        """Remove every container labelled with this node that a previous run of the agent
        left (the engine keeps containers running when the agent dies, unlike processes):
        its lease is gone, and the controller places what should run. Returns their ids."""
        if not self.node_id:
            return []
        label = f"label={NODE_LABEL}={self.node_id}"
        code, out, err = await _run(self.docker, "ps", "-aq", "--filter", label)
        if code != 0:
            _log.warning("leftover_containers_unlisted", error=_last_line(err))
            return []
        found = out.split()
        for container in found:
            code, _, err = await _run(self.docker, "rm", "-f", container)
            _log.warning(
                "orphan_container_stopped" if code == 0 else "orphan_container_not_removed",
                container=container[:12],
                error=_last_line(err) if code else "",
                reason="left running by this agent's previous run, whose lease is gone; the "
                "controller places what should run",
            )
        return found

    async def check(self) -> None:
        """DriverUnavailable (one clear line) unless a docker engine answers."""
        try:
            code, _, err = await _run(self.docker, "info", "--format", "{{.ServerVersion}}")
        except FileNotFoundError:
            raise DriverUnavailable(
                f"docker is not installed ({self.docker!r} not found); "
                "install docker or use --workload-driver process"
            ) from None
        except TimeoutError:
            raise DriverUnavailable(
                f"no docker engine answers (`{self.docker} info` took over "
                f"{_CLI_TIMEOUT_S:g} s); use --workload-driver process"
            ) from None
        if code != 0:
            raise DriverUnavailable(
                f"no docker engine answers (docker info: {_last_line(err)}); "
                "start the docker daemon or use --workload-driver process"
            )

    def _check_mounts(self, spec: ClusterSpec) -> None:
        """WorkloadStartError unless every host directory the spec mounts is one this node
        lets specs mount: its model cache, a directory under an `--allow-volume`, or a named
        volume (docker's own, not a host path); and `{model_cache}` only with a cache."""
        uses_cache = "{model_cache}" in spec.command or any(
            v.startswith("{model_cache}") for v in spec.docker.volumes
        )
        if uses_cache and not self.model_cache:
            raise WorkloadStartError(no_model_cache(spec.name))
        allowed = (*((self.model_cache,) if self.model_cache else ()), *self.allowed_volumes)
        for volume in spec.docker.volumes:
            host = volume.replace("{model_cache}", self.model_cache).split(":", 1)[0]
            if not host.startswith("/"):
                continue  # a named volume
            path = os.path.normpath(host)
            if not any(path == d or path.startswith(d.rstrip("/") + "/") for d in allowed):
                raise WorkloadStartError(
                    f"docker.volumes: {host} is not a directory this node lets specs mount "
                    "(its --model-cache, or one given with gpumesh agent --allow-volume DIR)"
                )

    async def images(self) -> tuple[str, ...] | None:
        """The images this engine holds, as REPOSITORY:TAG (sorted, at most MAX_IMAGES_LISTED;
        untagged ones left out), for placement (Register.images); None when it cannot list
        them now (the agent keeps what it knew)."""
        try:
            code, out, _ = await _run(
                self.docker, "image", "ls", "--format", "{{.Repository}}:{{.Tag}}"
            )
        except (OSError, TimeoutError):
            return None
        if code != 0:
            return None
        names = {line.strip() for line in out.splitlines() if line.strip()}
        tagged = sorted(n for n in names if "<none>" not in n)
        return tuple(tagged[:MAX_IMAGES_LISTED])

    async def has_image(self, image: str) -> bool:
        code, _, _ = await _run(self.docker, "image", "inspect", "--format", "{{.Id}}", image)
        return code == 0

    async def pull(self, image: str, policy: str = "missing", *, replica: str = "") -> None:
        """Make sure `image` is on this node, as the spec's `docker.pull` says, logging the
        pull's progress (layers done of those seen, at most every PULL_PROGRESS_EVERY_S) and
        how long it took. WorkloadStartError, in one line, when it cannot be had."""
        if policy != "always" and await self.has_image(image):
            return
        if policy == "never":
            raise WorkloadStartError(
                f"image {image} is not on this node and docker.pull is never: "
                f"run `docker pull {image}` there, or set docker.pull to missing"
            )
        log = _log.bind(replica=replica, image=image)
        log.info("image_pull_started", reason=policy)
        clock = asyncio.get_running_loop()  # the loop's time: virtual in the simulator
        started = clock.time()
        progress = PullProgress()
        proc = await asyncio.create_subprocess_exec(
            self.docker, "pull", image,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        assert proc.stdout is not None and proc.stderr is not None
        try:
            shown = started
            async for raw in proc.stdout:
                progress.read(raw.decode(errors="replace"))
                now = clock.time()
                if now - shown >= PULL_PROGRESS_EVERY_S:
                    shown = now
                    log.info(
                        "image_pull_progress",
                        layers_done=progress.done,
                        layers=len(progress.layers),
                        elapsed_s=round(now - started, 1),
                    )
            err = (await proc.stderr.read()).decode(errors="replace")
            code = await proc.wait()
        except BaseException:
            await _reap(proc)
            raise
        if code != 0:
            raise WorkloadStartError(
                f"docker pull {image} failed: {_last_line(err)} (is the name right? a "
                "private registry needs `docker login` on the node)"
            )
        log.info(
            "image_pulled",
            layers=len(progress.layers),
            seconds=round(clock.time() - started, 1),
        )

    async def start(
        self,
        replica_id: str,
        epoch: int,
        spec: ClusterSpec,
        gpu_indices: Sequence[int],
        port: int,
    ) -> DockerWorkload:
        if not spec.image:
            raise WorkloadStartError(f"cluster {spec.name!r} has no image for the docker driver")
        self._check_mounts(spec)
        await self.pull(spec.image, spec.docker.pull, replica=replica_id)
        host_port = port or free_port(self.host)
        name = f"gpumesh-{replica_id}-{epoch}"
        # A container of the same name is left from an earlier run of this replica: ours to end.
        await _run(self.docker, "rm", "-f", name)
        argv = docker_run_argv(
            self.docker,
            name=name,
            replica_id=replica_id,
            epoch=epoch,
            spec=spec,
            gpu_indices=gpu_indices,
            host=self.host,
            host_port=host_port,
            node_id=self.node_id,
            model_cache=self.model_cache,
        )
        try:
            secrets = {**os.environ, **spec.secret_env} if spec.secret_env else None
            code, out, err = await _run(*argv, timeout=_RUN_TIMEOUT_S, env=secrets)
        except FileNotFoundError:
            raise WorkloadStartError(f"docker is not installed ({self.docker!r})") from None
        if code != 0:
            raise WorkloadStartError(f"docker run failed: {_last_line(err)}")
        container = out.strip()
        waiter = await asyncio.create_subprocess_exec(
            self.docker,
            "wait",
            container,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            stdin=asyncio.subprocess.DEVNULL,
        )
        log_path = self.log_dir / f"{replica_id}-{epoch}.log"
        logs = await _follow_logs(self.docker, container, log_path)
        _log.info("container_started", replica=replica_id, epoch=epoch, container=container[:12])
        ready_url, live_url = probe_urls(spec, self.host, host_port)
        return DockerWorkload(
            self.docker,
            container,
            port=host_port,
            url=ready_url,
            liveness_url=live_url,
            probes=self.probes.for_spec(spec),
            waiter=waiter,
            logs=logs,
        )


class DockerWorkload:
    """Implements RunningWorkload for one container."""

    def __init__(
        self,
        docker: str,
        container: str,
        *,
        port: int,
        url: str,
        probes: ProbeSettings,
        liveness_url: str = "",
        waiter: asyncio.subprocess.Process,
        logs: asyncio.subprocess.Process,
    ) -> None:
        self._docker = docker
        self.container = container
        self._port = port
        self.url = url  # the readiness probe's
        self.liveness_url = liveness_url or url
        self._probes = probes
        self._waiter = waiter
        self._logs = logs
        self._exit_code: int | None = None

    @property
    def port(self) -> int:
        return self._port

    async def _wait_exit(self) -> int:
        # Waiting on the process, not reading its pipe, so a cancelled wait loses nothing.
        await self._waiter.wait()
        if self._exit_code is None:
            assert self._waiter.stdout is not None
            text = (await self._waiter.stdout.read()).decode().strip()
            self._exit_code = int(text) if text.lstrip("-").isdigit() else -1
        return self._exit_code

    async def wait_ready(self) -> WorkloadEnded | None:
        return await wait_ready(self.url, self._probes, self._wait_exit)

    async def wait_ended(self) -> WorkloadEnded:
        return await watch(self.liveness_url, self._probes, self._wait_exit)

    async def stop(self, grace_s: float) -> WorkloadEnded:
        try:
            if self._waiter.returncode is None:
                # docker stop sends SIGTERM, then SIGKILL after -t seconds (whole seconds only).
                seconds = str(math.ceil(max(grace_s, 0)))
                try:
                    await _run(
                        self._docker, "stop", "-t", seconds, self.container,
                        timeout=grace_s + _CLI_TIMEOUT_S,
                    )  # fmt: skip
                except TimeoutError:
                    await _run(self._docker, "kill", self.container)
            code = await exit_within(self._wait_exit, _CLI_TIMEOUT_S)
        except asyncio.CancelledError:
            await _run(self._docker, "kill", self.container)
            raise
        finally:
            # `docker logs -f` ends with the container; a moment lets it write the last lines.
            await exit_within(self._logs.wait, 2.0)
            await _reap(self._logs)
            await _reap(self._waiter)
        return WorkloadEnded("stopped", code)


async def _run(
    *argv: str, timeout: float | None = _CLI_TIMEOUT_S, env: dict[str, str] | None = None
) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=env,
    )
    try:
        async with asyncio.timeout(timeout):
            out, err = await proc.communicate()
    except BaseException:
        await _reap(proc)
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode(errors="replace"), err.decode(errors="replace")


async def _follow_logs(docker: str, container: str, log_path: Path) -> asyncio.subprocess.Process:
    def open_log() -> IO[bytes]:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        return log_path.open("ab")

    handle = await asyncio.to_thread(open_log)
    try:
        return await asyncio.create_subprocess_exec(
            docker,
            "logs",
            "-f",
            container,
            stdout=handle,
            stderr=asyncio.subprocess.STDOUT,
            stdin=asyncio.subprocess.DEVNULL,
        )
    finally:
        handle.close()  # the child holds its own copy of the descriptor


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Kill a helper process if it is still running, and wait for it."""
    if proc.returncode is None:
        try:
            proc.kill()
        except ProcessLookupError:
            pass
    await proc.wait()


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"
