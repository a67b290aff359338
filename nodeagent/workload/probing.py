"""Readiness and liveness probes (HTTP, or a TCP connect for a stage that speaks no HTTP),
shared by the process and docker drivers."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from typing import TypeVar

import aiohttp

from events.cluster import ClusterSpec

from .base import WorkloadEnded

_T = TypeVar("_T")

ExitWaiter = Callable[[], Awaitable[int]]
"""Returns the workload's exit code once it has exited (cancellable)."""


@dataclass(frozen=True, slots=True)
class ProbeSettings:
    """The agent's probe settings: the defaults for a spec whose `[probes]` section leaves a
    value unset (events.cluster.ProbeSpec); a value the spec sets wins (`for_spec`)."""

    readiness_timeout_s: float = 300.0  # loading a large model's weights takes minutes
    readiness_interval_s: float = 0.2
    liveness_interval_s: float = 2.0
    liveness_failures: int = 3  # in a row: one slow answer under load is not a dead server
    request_timeout_s: float = 2.0  # per readiness probe, and per liveness probe unless set
    liveness_timeout_s: float | None = None  # per liveness probe; None: request_timeout_s

    def __post_init__(self) -> None:
        if self.liveness_failures < 1:
            raise ValueError(f"liveness_failures must be at least 1, got {self.liveness_failures}")

    @property
    def liveness_request_timeout_s(self) -> float:
        if self.liveness_timeout_s is None:
            return self.request_timeout_s
        return self.liveness_timeout_s

    def for_spec(self, spec: ClusterSpec) -> ProbeSettings:
        """These settings with the values the spec's `[probes]` section sets."""
        p = spec.probes
        return replace(
            self,
            readiness_timeout_s=_pick(p.readiness_timeout_s, self.readiness_timeout_s),
            liveness_interval_s=_pick(p.liveness_interval_s, self.liveness_interval_s),
            liveness_failures=_pick(p.liveness_failures, self.liveness_failures),
            liveness_timeout_s=_pick(p.liveness_timeout_s, self.liveness_timeout_s),
        )


def _pick(spec_value: _T | None, agent_value: _T) -> _T:
    return agent_value if spec_value is None else spec_value


def probe_paths(spec: ClusterSpec) -> tuple[str, str]:
    """(readiness path, liveness path): the liveness path defaults to the readiness path, and
    that to the spec's `health_path`."""
    readiness = spec.probes.readiness_path or spec.health_path
    return readiness, spec.probes.liveness_path or readiness


@asynccontextmanager
async def _session(timeout_s: float) -> AsyncIterator[aiohttp.ClientSession]:
    # force_close: every probe opens a fresh connection, as a new client would; a kept-alive
    # socket can outlive a wedged accept loop and make a dead server look healthy.
    connector = aiohttp.TCPConnector(force_close=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        yield session


def probe_urls(spec: ClusterSpec, host: str, port: int) -> tuple[str, str]:
    """(readiness URL, liveness URL) for a workload on `host:port`, by the spec's probe kind:
    `http://...` with its paths, `tcp://host:port` (the port accepts a connection: an RPC
    server that speaks no HTTP), or `none:` (running is enough)."""
    kind = spec.probes.kind or "http"
    if kind == "tcp":
        url = f"tcp://{host}:{port}"
        return url, url
    if kind == "none":
        return NONE_URL, NONE_URL
    base = f"http://{host}:{port}"
    ready_path, live_path = probe_paths(spec)
    return base + ready_path, base + live_path


NONE_URL = "none:"
NONE_SETTLE_S = 1.0  # a workload probed by nothing is ready once it has run this long


async def check(session: aiohttp.ClientSession, url: str, timeout_s: float) -> str:
    """'' when GET `url` answers 200 (for `tcp://`, when the port accepts a connection; for
    `none:`, always), else a short reason."""
    if url.startswith("tcp://"):
        return await _check_tcp(url, timeout_s)
    if url == NONE_URL:
        return ""
    try:
        async with session.get(url, allow_redirects=False) as response:
            return "" if response.status == 200 else f"HTTP {response.status}"
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except aiohttp.ClientConnectorError as exc:
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    except (aiohttp.ClientError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}"[:160]


async def _check_tcp(url: str, timeout_s: float) -> str:
    host, _, port = url.removeprefix("tcp://").rpartition(":")
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except TimeoutError:
        return f"no connection within {timeout_s:g} s"
    except OSError as exc:
        return f"cannot connect ({exc.strerror or exc})"
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return ""


async def exit_within(wait_exit: ExitWaiter, seconds: float) -> int | None:
    """The exit code if the workload exits within `seconds`, else None."""
    try:
        async with asyncio.timeout(max(seconds, 0.0)):
            return await wait_exit()
    except TimeoutError:
        return None


async def wait_ready(
    url: str, settings: ProbeSettings, wait_exit: ExitWaiter
) -> WorkloadEnded | None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settings.readiness_timeout_s
    if url == NONE_URL:
        code = await exit_within(wait_exit, min(NONE_SETTLE_S, settings.readiness_timeout_s))
        return None if code is None else WorkloadEnded("exited", code, detail="before it was ready")
    async with _session(settings.request_timeout_s) as session:
        while True:
            failure = await check(session, url, settings.request_timeout_s)
            if not failure:
                return None
            remaining = deadline - loop.time()
            if remaining <= 0:
                return WorkloadEnded(
                    "readiness_timeout",
                    detail=f"{_ready_means(url)} within "
                    f"{settings.readiness_timeout_s:g} s (last: {failure})",
                )
            code = await exit_within(wait_exit, min(settings.readiness_interval_s, remaining))
            if code is not None:
                return WorkloadEnded("exited", code, detail="before it was ready")


def _probe(url: str) -> str:
    return url if url.startswith("tcp://") else f"GET {url}"


def _ready_means(url: str) -> str:
    return f"no connection to {url}" if url.startswith("tcp://") else f"no HTTP 200 from {url}"


async def watch(url: str, settings: ProbeSettings, wait_exit: ExitWaiter) -> WorkloadEnded:
    """Probe a ready workload's liveness `url` every `liveness_interval_s`; it ends after
    `liveness_failures` failed probes in a row (or when it exits)."""
    if url.startswith("tcp://") or url == NONE_URL:
        # Alive while it runs. No connection while it is ready: an RPC server may serve one
        # client at a time (llama.cpp's ggml-rpc-server does), and a probe's connection would
        # wait in its accept queue behind the head's, filling it until probes time out.
        return WorkloadEnded("exited", await wait_exit())
    failures = 0
    timeout_s = settings.liveness_request_timeout_s
    async with _session(timeout_s) as session:
        while True:
            code = await exit_within(wait_exit, settings.liveness_interval_s)
            if code is not None:
                return WorkloadEnded("exited", code)
            failure = await check(session, url, timeout_s)
            failures = failures + 1 if failure else 0
            if failures >= settings.liveness_failures:
                # A server that just died fails its checks too; its exit code says more.
                code = await exit_within(wait_exit, 0)
                if code is not None:
                    return WorkloadEnded("exited", code)
                return WorkloadEnded(
                    "liveness_failed",
                    detail=f"{failures} failed health checks in a row "
                    f"(last: {_probe(url)}: {failure})",
                )
