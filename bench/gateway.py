"""The gateway's data path against a direct connection and the proxies a user would pick instead.

Every part is its own process on 127.0.0.1 (free ports), started and stopped here: three fake
OpenAI replicas (bench/_upstream.py serve: a fixed 317-byte chat.completion, or 20 SSE chunks
5 ms apart and `data: [DONE]`), nats-server, a stand-in for the controller's routing feed, the
overlay's agent-side tunnel server, the proxy under test, and the load generator.

    python bench/gateway.py [--seconds 10] [--connections 64] [--runs 1] [--json] [--quick]
                            [--only direct,gateway,gateway-log,overlay,gateway-front,...]
                            [--peers-venv DIR | --install-peers] [--streams 10000]
                            [--dashboard N [--dashboard-nodes 100] [--dashboard-alternate K]]

Rows: direct (one replica, no proxy); gateway (`gpumesh gateway --transport direct
--no-access-log`, three replicas); gateway-log (the same with its access log on); overlay
(`--transport overlay`: requests tunnelled over NATS to the agent); gateway-front and
gateway-front-tls (the replicas behind nodes' fronts, plain and mutual TLS: below);
aiohttp-proxy (a bare round-robin aiohttp proxy: what any aiohttp gateway starts from); nginx
(when `nginx` is on PATH: 1 worker, keepalive 64, proxy_buffering off); vllm-router and the
LiteLLM proxy (only with --peers-venv or --install-peers). Each row: non-streaming at
--connections (wrk when on PATH, else a Python closed loop), streaming at --connections (a
Python client: time to the first `data:` line), and both again at one connection (the unloaded
hop cost). CPU per request is the proxy's utime+stime from /proc over its process tree, divided
by 2xx answers.

gateway-front and gateway-front-tls: the direct transport as a secured stack runs it, each of
the three replicas behind a node's fencing front (nodeagent/fencing_front.py's DirectFront, one
process per node: bench/_tls_fronts.py front), the gateway dialling the fronts' addresses
(http://127.0.0.1:<front>/replica/<id>/1). Both rows run on one secured stack made here with the
real CLI (`gpumesh certs init`, `gpumesh node issue bench-node-N` for 127.0.0.1; a nats-server
with its nats.conf, TLS and NKEYs; the routing stand-in connects as the controller) and a
`gpumesh gateway --nats-creds gateway.creds.json`: gateway-front-tls is what `gpumesh up` does
by default (each front serves its node's certificate and requires a gateway's of the CA, re-
reading the CA's revocation list; the gateway dials them over mutual TLS with its certificate and
checks theirs), gateway-front the same with the fronts and the gateway given --insecure-front
(plain HTTP). The gateway keeps its connections to the fronts alive, so TLS costs a handshake per
connection, not per request: issue 22's target is CPU per request at most 15% more with TLS,
counted over the hop's two ends (the gateway and the fronts' processes); the report gives each
run's figures, the gateway's alone too, and the TLS/plain ratio per run and its median, with the
TLS handshakes the fronts accepted during the row.

The machine may be shared: before each measurement the bench waits until processes not its own
use under --quiet cores, and prints the foreign load during each run beside it.

--quick (for CI) runs every row for a fraction of a second at 4 connections and does not wait
for a quiet machine (it samples the foreign load over 0.2 s instead of 2 s, once): its figures
are marked, and not comparable.

`--dashboard N` keeps N headless Chromium pages (tests/integration/browser.py's launcher) on
the gateway's /ui fleet page, signed in with an admin key and following its live event stream,
for each gateway-type row's whole measured run: the issue's "the gateway's CPU per proxied
request does not change by more than 2% while a dashboard is open". A stand-in controller (bench/
dashboard.py's SyntheticController, served over this stack's NATS) answers the pages' reads with
`--dashboard-nodes` nodes and publishes a heartbeat event for each once a second (an agent's
default interval), which the gateway relays to every page. `--dashboard 0` sets up the same
(admin key, stand-in controller, heartbeats) and opens no page: the run to compare with.
`--dashboard-alternate K` (with N >= 1) then adds, in each gateway row's same process, K pairs of
non-streaming runs with the pages open and closed, in turn: what separate processes and a shared
machine's drifting load blur between two invocations.

`--streams N` adds the many-streams check: N concurrent long streams (a chunk every 5 s) held
open through one gateway process, its RSS before, with them open and after; for the direct and
the overlay transport (a direct stream holds two sockets in the gateway, an overlay stream one).

Targets (issue): gateway CPU per request <= 5x nginx's; <= 1 ms added at p50; overlay >= 50% of
the direct transport's requests/s; streaming time to first chunk within 1 ms of nginx's at p50
and CPU per stream <= 2x nginx's; one gateway process holding 10,000 open streams. A benchmark
that prints figures, not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import secrets
import select
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

ROOT = Path(__file__).resolve().parent.parent
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

from _http_load import BODY, body  # noqa: E402
from _quick import add_quick, announce, apply_quick, mark  # noqa: E402

ALL_TARGETS = (
    *("direct", "gateway", "gateway-log", "overlay", "gateway-front", "gateway-front-tls"),
    "aiohttp-proxy",
    *("nginx", "vllm-router", "litellm"),
)
GATEWAY_ROWS = ("gateway", "gateway-log", "overlay")  # the rows --dashboard opens pages on
DASHBOARD_IDLE_S = 3.0  # --dashboard: the gateway's CPU with no requests, pages open (or not)
UPSTREAMS = 3
CLUSTER = "bench"
HOLD_CLUSTER = "hold"
NODE = "bench-node"
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

CPU_VS_NGINX = 5.0
ADDED_P50_MS = 1.0
OVERLAY_SHARE = 0.5
TTFC_VS_NGINX_MS = 1.0
STREAM_CPU_VS_NGINX = 2.0
FRONT_TLS_CPU = 1.15  # issue 22: CPU per request through TLS fronts at most 15% more
FRONT_ROWS = ("gateway-front", "gateway-front-tls")
FRONT_NODE = "bench-node-{}"  # the fronts' node identities, one per upstream
MANY_STREAMS = 10_000

QUIET_SAMPLE_S = 2.0  # the foreign load is measured over this long before each measurement
QUICK_QUIET_SAMPLE_S = 0.2
QUICK = {
    "seconds": 0.5,
    "connections": 4,
    "warmup": 0.25,
    "unloaded_seconds": 0.25,
    "quiet_timeout": 0.0,
    "stream_interval": 0.5,
    "stream_hold": 1.0,
}


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# -- /proc accounting ------------------------------------------------------------------------


def _stat(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on


def tree(root: int) -> list[int]:
    """`root` and every descendant, from /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            fields = _stat(int(entry))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def cpu_s(roots: Sequence[int]) -> float:
    """utime + stime of every process in the trees (all their threads), seconds."""
    ticks = 0
    for root in roots:
        for pid in tree(root):
            fields = _stat(pid)
            if fields is not None:
                ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / CLK_TCK


def rss_bytes(roots: Sequence[int]) -> int:
    total = 0
    for root in roots:
        for pid in tree(root):
            try:
                total += int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE
            except OSError:
                pass
    return total


def open_fds(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def box_busy() -> tuple[float, float]:
    """(busy, total) jiffies of the whole machine."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]
    return float(sum(fields) - idle), float(sum(fields))


# -- processes -------------------------------------------------------------------------------


@dataclass
class Child:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def tail(self, lines: int = 15) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""


class StartFailed(RuntimeError):
    pass


@dataclass
class Procs:
    """Every child this bench starts, each in its own session (Ctrl-C here does not reach
    them half-way); stopped by their process group, SIGTERM then SIGKILL."""

    workdir: Path
    children: list[Child] = field(default_factory=list)

    def start(
        self,
        name: str,
        argv: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        ready_line: bool = False,
        pipe: bool = False,
        timeout: float = 30.0,
    ) -> Child:
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                list(argv),
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE if ready_line or pipe else out,
                stderr=out,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        child = Child(name, popen, log)
        self.children.append(child)
        if ready_line:
            assert popen.stdout is not None
            line = _readline(popen.stdout, timeout)
            if line.strip() != b"ready":
                self.stop(child)
                raise StartFailed(f"{name} did not start: {line!r}\n{child.tail()}")
        return child

    def stop(self, child: Child, timeout: float = 10.0) -> None:
        if child.popen.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGTERM)
            try:
                child.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child.pid, signal.SIGKILL)
                child.popen.wait()
        # Leftovers in its group (a worker that outlived its parent) go too.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(child.pid, signal.SIGKILL)
        if child.popen.stdout is not None:
            child.popen.stdout.close()
        if child in self.children:
            self.children.remove(child)

    def stop_all(self) -> None:
        for child in reversed(list(self.children)):
            self.stop(child)


def _readline(stream: IO[bytes], timeout: float) -> bytes:
    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline() if ready else b"(timed out)"


def http(
    url: str, body: bytes | None = None, *, key: str = "", timeout: float = 5.0
) -> tuple[int, bytes]:
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(url, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc).encode()


def wait_http(
    child: Child, url: str, *, body: bytes | None = None, key: str = "", timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    status, text = 0, b""
    while time.monotonic() < deadline:
        if child.popen.poll() is not None:
            raise StartFailed(f"{child.name} exited ({child.popen.returncode}):\n{child.tail()}")
        status, text = http(url, body, key=key, timeout=5.0)
        if status == 200:
            return
        time.sleep(0.1)
    raise StartFailed(f"{child.name}: {url} answered {status} {text[:200]!r}\n{child.tail()}")


# -- the proxies under test ------------------------------------------------------------------


@dataclass
class Target:
    name: str
    base: str  # http://127.0.0.1:port
    key: str = ""
    children: list[Child] = field(default_factory=list)  # the proxy's processes
    other_hops: list[int] = field(default_factory=list)  # nats-server, agent (overlay); fronts
    note: str = ""
    aux: list[Child] = field(default_factory=list)  # the row's other processes, stopped with it
    front_stats: list[Path] = field(default_factory=list)  # the fronts' handshakes, on exit

    @property
    def url(self) -> str:
        return f"{self.base}/v1/chat/completions"

    @property
    def pids(self) -> list[int]:
        return [c.pid for c in self.children]


@dataclass
class Stack:
    procs: Procs
    workdir: Path
    upstreams: list[tuple[str, int, Child]]  # id, port, process
    nats_url: str
    nats_pid: int
    agent_pid: int
    hold_upstream: tuple[str, int, Child] | None
    admin_key: str = ""  # with --dashboard: in the gateways' data directory
    secure: SecureStack | None = None  # the front rows' secured NATS, made for the first


@dataclass
class SecureStack:
    """What `gpumesh up` secures, for the front rows: a data directory's CA and identities (made
    with the CLI), and a nats-server run with its nats.conf (TLS, an NKEY per identity)."""

    data_dir: Path
    nats_url: str  # tls://127.0.0.1:port
    nats: Child

    @property
    def layout(self) -> Any:
        from wire.nats_access import SecurityLayout

        return SecurityLayout(self.data_dir)


def start_stack(procs: Procs, workdir: Path, args: argparse.Namespace) -> Stack:
    py = sys.executable
    upstreams = []
    for i in range(1, UPSTREAMS + 1):
        port = free_port()
        child = procs.start(
            f"upstream-u{i}",
            [py, str(BENCH / "_upstream.py"), "serve", "--port", str(port), "--id", f"u{i}"],
            ready_line=True,
        )
        upstreams.append((f"u{i}", port, child))
    hold = None
    if args.streams:
        port = free_port()
        child = procs.start(
            "upstream-hold",
            [
                py,
                str(BENCH / "_upstream.py"),
                "serve",
                "--port",
                str(port),
                "--id",
                "h1",
                "--chunks",
                "0",
                "--chunk-delay-ms",
                str(args.stream_interval * 1000),
            ],
            ready_line=True,
        )
        hold = ("h1", port, child)
    nats_port = free_port()
    from wire.nats_server import find_nats_server

    nats = procs.start(
        "nats-server",
        [str(find_nats_server()), "-a", "127.0.0.1", "-p", str(nats_port)],
    )
    nats_url = f"nats://127.0.0.1:{nats_port}"
    deadline = time.monotonic() + 10
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", nats_port)) == 0:
                break
        if time.monotonic() > deadline or nats.popen.poll() is not None:
            raise StartFailed(f"nats-server did not start:\n{nats.tail()}")
        time.sleep(0.05)
    routes = [f"{CLUSTER},r-{uid},{NODE},http://127.0.0.1:{port}" for uid, port, _ in upstreams]
    replicas = [f"r-{uid}=http://127.0.0.1:{port}" for uid, port, _ in upstreams]
    if hold is not None:
        routes.append(f"{HOLD_CLUSTER},r-h1,{NODE},http://127.0.0.1:{hold[1]}")
        replicas.append(f"r-h1=http://127.0.0.1:{hold[1]}")
    procs.start(
        "routing",
        [py, str(BENCH / "_upstream.py"), "routing", "--nats", nats_url]
        + [x for r in routes for x in ("--route", r)],
        ready_line=True,
    )
    agent = procs.start(
        "agent",
        [py, str(BENCH / "_upstream.py"), "agent", "--nats", nats_url, "--node", NODE]
        + [x for r in replicas for x in ("--replica", r)]
        + ["--max", str(max(args.streams + 100, 1024))],
        ready_line=True,
    )
    stack = Stack(procs, workdir, upstreams, nats_url, nats.pid, agent.pid, hold)
    if args.dashboard is not None:
        # The same for --dashboard 0 and N: an admin key (tenant auth stays off, so the request
        # path is the same as without one) and a controller that heartbeats.
        stack.admin_key = "gm-bench-admin-" + secrets.token_hex(16)
        data_dir = workdir / "gpumesh-data"
        data_dir.mkdir(parents=True, exist_ok=True)
        (data_dir / "admin-key").write_text(stack.admin_key + "\n")
        argv = [py, str(Path(__file__).resolve()), "--serve-fleet", nats_url]
        procs.start(
            "fleet", [*argv, "--dashboard-nodes", str(args.dashboard_nodes)], ready_line=True
        )
    return stack


# -- --dashboard: a stand-in controller, and browsers on /ui ---------------------------------


async def serve_fleet(nats_url: str, nodes: int) -> None:
    """The stand-in controller for --dashboard: bench/dashboard.py's SyntheticController
    (`nodes` nodes, two GPUs each, 20 clusters) answering node.list, cluster.list and
    events.list over NATS, and publishing a heartbeat event per node every second."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from bench.dashboard import SyntheticController
    from events.contract import subjects
    from gpumesh.logconfig import configure_logging
    from wire.nats_bus import NatsBus

    configure_logging(level="warning", json=True)  # stdout is for `ready`
    controller = SyntheticController(nodes)
    bus = await NatsBus.connect(nats_url, name="bench-fleet")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    async def answer(verb: str) -> None:
        async for msg in await bus.subscribe(subjects.api(verb)):
            if msg.reply:
                reply = await controller.request(msg.subject, msg.data, timeout=5.0)
                await bus.publish(msg.reply, reply.data)

    async def heartbeats() -> None:
        start, sent = time.perf_counter(), 0
        while True:
            due = int((time.perf_counter() - start) * nodes)  # each node once a second
            while sent < due:
                msg = controller.append(controller._heartbeat(sent % nodes, 1 + sent // nodes))
                await bus.publish(msg.subject, msg.data, headers=msg.headers)
                sent += 1
            await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(answer(v)) for v in ("node.list", "cluster.list", "events.list")]
    await bus.flush()
    tasks.append(asyncio.create_task(heartbeats()))
    print("ready", flush=True)
    await stop.wait()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    await bus.close()


class Dashboards:
    """One headless Chromium (tests/integration/browser.py), driven from a thread of its own
    with its own event loop; `open(base, key)` signs in to a gateway's /ui and keeps N pages
    on its fleet page, following the live stream, until `close_pages()`."""

    READY = "document.body.dataset.ready === '1'"
    LIVE = "document.getElementById('live').classList.contains('on')"

    def __init__(self, pages: int) -> None:
        if str(ROOT) not in sys.path:
            sys.path.insert(0, str(ROOT))
        from tests.integration.browser import chromium_path

        if chromium_path() is None:
            raise StartFailed("--dashboard: no chromium (apt-get install -y chromium)")
        self.count = pages
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._stack = contextlib.AsyncExitStack()
        self.browser: Any = None
        self.pages: list[Any] = []
        self.problems: list[str] = []

    def _run(self, coro: Any, timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def start(self) -> None:
        async def launch() -> None:
            from tests.integration.browser import Chromium

            self.browser = await self._stack.enter_async_context(Chromium.launch())

        self._run(launch())

    def open(self, base: str, key: str) -> None:
        async def go() -> None:
            for _ in range(self.count):
                page = await self.browser.new_page()
                self.pages.append(page)
                await page.goto(f"{base}/ui/fleet")
                # One session cookie for the browser's every page, until the gateway goes.
                await page.wait_for(f"location.pathname === '/ui/login' || {self.READY}")
                if await page.evaluate("location.pathname === '/ui/login'"):
                    await page.fill("#key", key)
                    await page.evaluate("document.querySelector('form.login').submit()")
                    await page.wait_for("location.pathname === '/ui/fleet'")
                await page.wait_for(self.READY, timeout=30)
                await page.wait_for(self.LIVE, timeout=30)

        self._run(go())

    def close_pages(self) -> dict[str, Any]:
        """Closes the pages; whether each was still live, and what they logged."""

        async def close() -> dict[str, Any]:
            live = [bool(await page.evaluate(self.LIVE)) for page in self.pages]
            rows = [
                int(await page.evaluate("document.querySelectorAll('#nodes tbody tr').length"))
                for page in self.pages
            ]
            problems = [p for page in self.pages for p in page.problems]
            for page in self.pages:
                await page.close()
            self.pages.clear()
            return {
                "pages": len(live),
                "live_at_end": sum(live),
                "rows": rows,
                "problems": problems,
            }

        out: dict[str, Any] = self._run(close())
        self.problems += out["problems"]
        return out

    def cpu_s(self) -> float:
        """The browser's CPU (every process of it) so far, seconds."""
        return cpu_s([self.browser._process.pid])

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._run(self._stack.aclose(), timeout=30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def start_gateway(
    stack: Stack,
    name: str,
    transport: str,
    access_log: bool,
    *,
    nats_url: str = "",
    extra: Sequence[str] = (),
) -> Target:
    port = free_port()
    argv = [sys.executable, "-m", "gpumesh", "gateway", "--nats", nats_url or stack.nats_url]
    argv += ["--listen", f"127.0.0.1:{port}", "--transport", transport, "--gateway-id", name]
    if not access_log:
        argv.append("--no-access-log")
    argv += extra
    child = stack.procs.start(
        name, argv, env={"GPUMESH_DATA_DIR": str(stack.workdir / "gpumesh-data")}
    )
    target = Target(name, f"http://127.0.0.1:{port}", children=[child])
    wait_http(child, f"{target.base}/readyz")
    wait_http(child, target.url, body=BODY)
    if transport == "overlay":
        target.other_hops = [stack.nats_pid, stack.agent_pid]
        target.note = "requests tunnelled over NATS to the agent, which calls the replica"
    if access_log:
        target.note = "access log on: a JSON line per request to stderr (a file)"
    return target


def _wait_port(child: Child, port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        if time.monotonic() > deadline or child.popen.poll() is not None:
            raise StartFailed(f"{child.name} did not start:\n{child.tail()}")
        time.sleep(0.05)


def _gpumesh(data_dir: Path, *argv: str) -> None:
    """One `gpumesh` command on the data directory `data_dir`, as an operator runs it."""
    out = subprocess.run(
        [sys.executable, "-m", "gpumesh", *argv],
        cwd=ROOT,
        env={**os.environ, "GPUMESH_DATA_DIR": str(data_dir)},
        capture_output=True,
        timeout=120,
    )
    if out.returncode != 0:
        why = (out.stderr or out.stdout).decode(errors="replace").strip()
        raise StartFailed(f"gpumesh {' '.join(argv)} exited {out.returncode}: {why[-500:]}")


def start_secure(stack: Stack) -> SecureStack:
    """The front rows' secured stack: `gpumesh certs init` (CA, nats-server's certificate, the
    controller's and the gateway's credentials, the gateway's with its TLS certificate, nats.conf),
    `gpumesh node issue` for each front's node (its certificate names 127.0.0.1 and localhost),
    and a nats-server with that nats.conf (TLS and an NKEY required of every client)."""
    from wire.nats_server import find_nats_server

    data_dir = stack.workdir / "secure-data"
    _gpumesh(data_dir, "certs", "init")
    for i in range(1, UPSTREAMS + 1):
        _gpumesh(data_dir, "node", "issue", FRONT_NODE.format(i))
    port = free_port()
    from wire.nats_access import SecurityLayout

    config = SecurityLayout(data_dir).server_config
    nats = stack.procs.start(
        "nats-server-secure",
        [str(find_nats_server()), "-a", "127.0.0.1", "-p", str(port), "-c", str(config)],
    )
    _wait_port(nats, port)
    return SecureStack(data_dir, f"tls://127.0.0.1:{port}", nats)


def _start_ready(procs: Procs, specs: Sequence[tuple[str, list[str]]]) -> list[Child]:
    """Start every process at once, then wait for each one's `ready` line."""
    children = [procs.start(name, argv, pipe=True) for name, argv in specs]
    for child in children:
        assert child.popen.stdout is not None
        line = _readline(child.popen.stdout, 30.0)
        if line.strip() != b"ready":
            tail = child.tail()
            for started in children:
                procs.stop(started)
            raise StartFailed(f"{child.name} did not start: {line!r}\n{tail}")
    return children


def start_gateway_front(stack: Stack, name: str, tls: bool) -> Target:
    """gateway-front(-tls): each upstream behind a node's front (a process of its own), on the
    secured stack; with `tls` the fronts serve mutual TLS and the gateway dials them with its
    certificate, as `gpumesh up` runs them; else both are given --insecure-front."""
    if stack.secure is None:
        stack.secure = start_secure(stack)
    secure = stack.secure
    layout = secure.layout
    py = sys.executable
    specs: list[tuple[str, list[str]]] = []
    routes: list[str] = []
    stats: list[Path] = []
    for i, (uid, port, _child) in enumerate(stack.upstreams, 1):
        node, front_port = FRONT_NODE.format(i), free_port()
        stat = stack.workdir / f"{name}-front-{i}.json"
        stat.unlink(missing_ok=True)
        argv = [py, str(BENCH / "_tls_fronts.py"), "front", "--port", str(front_port)]
        argv += ["--upstream", f"http://127.0.0.1:{port}", "--stats", str(stat)]
        if tls:
            argv += ["--creds", str(layout.creds(node)), "--crl", str(layout.crl)]
        specs.append((f"{name}-front-{i}", argv))
        stats.append(stat)
        # What an agent advertises for a replica behind its front (epoch 1 throughout here).
        routes.append(f"{CLUSTER},r-{uid},{node},http://127.0.0.1:{front_port}/replica/r-{uid}/1")
    fronts = _start_ready(stack.procs, specs)
    aux = list(fronts)
    try:
        argv = [py, str(BENCH / "_tls_fronts.py"), "routing", "--nats", secure.nats_url]
        argv += ["--creds", str(layout.creds("controller"))]
        aux.append(
            stack.procs.start(
                f"{name}-routing",
                argv + [x for r in routes for x in ("--route", r)],
                ready_line=True,
            )
        )
        extra = ["--nats-creds", str(layout.creds("gateway"))]
        if not tls:
            extra.append("--insecure-front")
        target = start_gateway(
            stack, name, "direct", access_log=False, nats_url=secure.nats_url, extra=extra
        )
        said = target.children[0].log.read_text(errors="replace")
        if tls and "nodes' fronts over mutual TLS" not in said:
            stack.procs.stop(target.children[0])
            raise StartFailed(f"{name}: the gateway does not dial fronts over TLS:\n{said[-500:]}")
    except BaseException:
        for child in aux:
            stack.procs.stop(child)
        raise
    target.aux = aux
    target.other_hops = [c.pid for c in fronts]
    target.front_stats = stats
    target.note = "each replica behind a node's front (its own process), on a secured stack: " + (
        "mutual TLS, the nodes' and the gateway's certificates of the stack's CA"
        if tls
        else "fronts and gateway with --insecure-front (plain HTTP)"
    )
    return target


def start_nginx(stack: Stack) -> Target:
    nginx = shutil.which("nginx")
    assert nginx is not None
    port = free_port()
    prefix = stack.workdir / "nginx"
    prefix.mkdir(exist_ok=True)
    servers = "".join(f"server 127.0.0.1:{p}; " for _, p, _ in stack.upstreams)
    temp = " ".join(
        f"{kind}_temp_path {prefix}/{kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    (prefix / "nginx.conf").write_text(
        f"daemon off; master_process on; worker_processes 1; pid {prefix}/nginx.pid;\n"
        f"error_log {prefix}/error.log warn;\n"
        "events { worker_connections 4096; }\n"
        f"http {{ access_log off; {temp}\n"
        f"  upstream llm {{ {servers} keepalive 64; }}\n"
        f"  server {{ listen 127.0.0.1:{port};\n"
        "    location / { proxy_pass http://llm; proxy_http_version 1.1;\n"
        '      proxy_set_header Connection ""; proxy_next_upstream error timeout;\n'
        "      proxy_buffering off; } } }\n"
    )
    child = stack.procs.start(
        "nginx",
        [nginx, "-p", str(prefix), "-c", str(prefix / "nginx.conf"), "-e", str(prefix / "e.log")],
    )
    target = Target("nginx", f"http://127.0.0.1:{port}", children=[child])
    wait_http(child, target.url, body=BODY)
    return target


def find_peer(args: argparse.Namespace, executable: str) -> Path | None:
    roots = [Path(d) for d in (args.peers_venv, args.install_dir) if d]
    for root in roots:
        for candidate in (root / "bin" / executable, *root.glob(f"*/bin/{executable}")):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
    return None


def install_peer(args: argparse.Namespace, name: str, requirement: str, executable: str) -> str:
    """pip install into <install-dir>/<name>; '' when it worked, else why not."""
    venv = Path(args.install_dir) / name
    say(f"installing {requirement} into {venv} (up to {args.install_timeout:g} s)")
    try:
        if not (venv / "bin" / "python").exists():
            subprocess.run(
                [sys.executable, "-m", "venv", str(venv)], check=True, capture_output=True
            )
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", requirement],
            check=True,
            capture_output=True,
            timeout=args.install_timeout,
        )
    except subprocess.TimeoutExpired:
        return f"pip install {requirement} took over {args.install_timeout:g} s"
    except subprocess.CalledProcessError as exc:
        last = (exc.stderr or b"").decode(errors="replace").strip().splitlines()[-1:] or [""]
        return f"pip install {requirement} failed: {last[0][:200]}"
    if not (venv / "bin" / executable).exists():
        return f"{requirement} installed no `{executable}`"
    return ""


def peer_version(executable: Path, package: str) -> str:
    python = executable.parent / "python"
    try:
        out = subprocess.run(
            [str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
            capture_output=True,
            timeout=30,
        )
        return out.stdout.decode().strip()
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def start_vllm_router(stack: Stack, executable: Path) -> Target:
    port = free_port()
    argv = [str(executable), "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin"]
    argv += ["--worker-urls", *(f"http://127.0.0.1:{p}" for _, p, _ in stack.upstreams)]
    child = stack.procs.start("vllm-router", argv)
    target = Target("vllm-router", f"http://127.0.0.1:{port}", children=[child])
    wait_http(child, target.url, body=BODY, timeout=120)
    target.note = f"vllm-router {peer_version(executable, 'vllm-router')}, round_robin"
    return target


def start_litellm(stack: Stack, executable: Path) -> Target:
    port = free_port()
    key = "sk-" + secrets.token_hex(32)
    config = stack.workdir / "litellm.yaml"
    config.write_text(
        "model_list:\n"
        + "".join(
            f"  - model_name: {CLUSTER}\n"
            f"    litellm_params: {{model: openai/{CLUSTER}, "
            f'api_base: "http://127.0.0.1:{p}/v1", api_key: sk-fake}}\n'
            for _, p, _ in stack.upstreams
        )
    )
    child = stack.procs.start(
        "litellm",
        [str(executable), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)],
        env={"LITELLM_MASTER_KEY": key, "LITELLM_LOCAL_MODEL_COST_MAP": "True"},
    )
    target = Target("litellm", f"http://127.0.0.1:{port}", key=key, children=[child])
    wait_http(child, target.url, body=BODY, key=key, timeout=180)
    target.note = (
        f"LiteLLM {peer_version(executable, 'litellm')}, 1 worker, as installed "
        "(master key, access log on)"
    )
    return target


# -- load ------------------------------------------------------------------------------------


def wrk_script(workdir: Path, key: str) -> Path:
    path = workdir / f"post-{'key' if key else 'nokey'}.lua"
    auth = f'wrk.headers["Authorization"] = "Bearer {key}"\n' if key else ""
    path.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = '{BODY.decode()}'\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"{auth}"
        "done = function(summary, latency, requests)\n"
        "  local e = summary.errors\n"
        '  io.write(string.format("\\nWRKJSON {\\"requests\\":%d,\\"duration_us\\":%d,'
        '\\"connect\\":%d,\\"read\\":%d,\\"write\\":%d,\\"status\\":%d,\\"timeout\\":%d,'
        '\\"p50_us\\":%d,\\"p99_us\\":%d}\\n", summary.requests, summary.duration, e.connect,'
        " e.read, e.write, e.status, e.timeout, latency:percentile(50),"
        " latency:percentile(99)))\n"
        "end\n"
    )
    return path


@dataclass
class Load:
    workdir: Path
    procs: Procs
    use_wrk: bool

    def plain(self, target: Target, connections: int, seconds: float) -> dict[str, Any]:
        if self.use_wrk:
            script = wrk_script(self.workdir, target.key)
            seconds = max(1, round(seconds))  # wrk takes whole seconds
            argv = ["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "--timeout", "10s"]
            argv += ["--latency", "-s", str(script), target.url]
            out = subprocess.run(argv, capture_output=True, timeout=seconds + 60)
            line = next(
                (x for x in out.stdout.decode().splitlines() if x.startswith("WRKJSON ")), None
            )
            if line is None:
                raise RuntimeError(f"wrk printed no result: {out.stdout!r} {out.stderr!r}")
            w = json.loads(line[len("WRKJSON ") :])
            duration = w["duration_us"] / 1e6
            errors = w["connect"] + w["read"] + w["write"] + w["timeout"]
            return {
                "requests": w["requests"],
                "ok": w["requests"] - w["status"],
                "non2xx": w["status"],
                "errors": errors,
                "seconds": duration,
                "rps": w["requests"] / duration,
                "p50_ms": w["p50_us"] / 1000,
                "p99_ms": w["p99_us"] / 1000,
            }
        return self._python("plain", target, connections, seconds)

    def stream(self, target: Target, connections: int, seconds: float) -> dict[str, Any]:
        return self._python("stream", target, connections, seconds)

    def _python(
        self, mode: str, target: Target, connections: int, seconds: float
    ) -> dict[str, Any]:
        argv = [sys.executable, str(BENCH / "_http_load.py"), mode, "--url", target.url]
        argv += ["--connections", str(connections), "--seconds", str(seconds)]
        if target.key:
            argv += ["--key", target.key]
        child = self.procs.start(f"load-{mode}", argv)
        try:
            child.popen.wait(seconds + 120)  # reaped here: its CPU is in RUSAGE_CHILDREN
        finally:
            self.procs.stop(child)
        # Its stdout went to the log file: the JSON is there.
        lines = child.log.read_text().strip().splitlines()
        result = next((json.loads(x) for x in reversed(lines) if x.startswith("{")), None)
        if result is None:
            raise RuntimeError(f"the {mode} client printed no result:\n{child.tail()}")
        child.log.unlink()
        return result


def reaped_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def ours_cpu_s() -> float:
    """This bench and every process it started (and has not reaped)."""
    return cpu_s([os.getpid()])


def wait_quiet(args: argparse.Namespace) -> float:
    """Wait until processes that are not ours use under --quiet cores (the machine is shared);
    returns that foreign load, or the last one seen when --quiet-timeout ran out."""
    deadline = time.monotonic() + args.quiet_timeout
    told = 0.0
    while True:
        busy0, total0 = box_busy()
        ours0, reaped0 = ours_cpu_s(), reaped_cpu_s()
        time.sleep(QUICK_QUIET_SAMPLE_S if args.quick else QUIET_SAMPLE_S)
        busy1, total1 = box_busy()
        ours1, reaped1 = ours_cpu_s(), reaped_cpu_s()
        box = (busy1 - busy0) / (total1 - total0) * (os.cpu_count() or 1)
        foreign = max(0.0, box - (ours1 - ours0 + reaped1 - reaped0) / 2.0)
        now = time.monotonic()
        if foreign < args.quiet or now > deadline:
            if foreign >= args.quiet and not args.quick:
                say(f"  the machine is still busy ({foreign:.2f} foreign cores): measuring anyway")
            return foreign
        if now - told > 30:
            say(f"  waiting for a quiet machine: {foreign:.2f} cores used by other processes")
            told = now


def measure(
    target: Target,
    upstream_pids: list[int],
    fn: Callable[[], dict[str, Any]],
    args: argparse.Namespace,
) -> dict[str, Any]:
    foreign_before = wait_quiet(args)
    proxy0, hops0 = cpu_s(target.pids), cpu_s(target.other_hops)
    up0, (busy0, total0) = cpu_s(upstream_pids), box_busy()
    ours0, reaped0, t0 = ours_cpu_s(), reaped_cpu_s(), time.monotonic()
    result = fn()
    ours1, reaped1, t1 = ours_cpu_s(), reaped_cpu_s(), time.monotonic()
    proxy1, hops1 = cpu_s(target.pids), cpu_s(target.other_hops)
    up1, (busy1, total1) = cpu_s(upstream_pids), box_busy()
    cores = os.cpu_count() or 1
    box = (busy1 - busy0) / (total1 - total0) * cores
    result["proxy_cpu_s"] = proxy1 - proxy0
    result["other_hops_cpu_s"] = hops1 - hops0
    result["upstream_cpu_s"] = up1 - up0
    result["loadgen_cpu_s"] = reaped1 - reaped0  # the load generator, reaped in fn()
    result["box_cores"] = box
    result["foreign_cores"] = max(0.0, box - (ours1 - ours0 + reaped1 - reaped0) / (t1 - t0))
    result["foreign_cores_before"] = foreign_before
    result["proxy_rss_mb"] = rss_bytes(target.pids) / 2**20 if target.pids else 0.0
    return result


def alternate(
    load: Load,
    target: Target,
    upstream_pids: list[int],
    args: argparse.Namespace,
    dashboards: Dashboards,
    key: str,
) -> list[dict[str, Any]]:
    """--dashboard-alternate: pairs of non-streaming runs of one gateway process, its pages
    open for one and closed for the other (which goes first alternates)."""
    c, s = args.connections, args.seconds
    pairs: list[dict[str, Any]] = []
    for i in range(args.dashboard_alternate):
        pair: dict[str, Any] = {}
        for state in ("open", "closed") if i % 2 == 0 else ("closed", "open"):
            if state == "open":
                dashboards.open(target.base, key)
                time.sleep(1.0)  # the page's first drawing done, as in a row's idle second
            r = measure(target, upstream_pids, lambda: load.plain(target, c, s), args)
            if state == "open":
                dashboards.close_pages()
            pair[state] = {
                "proxy_us": r["proxy_cpu_s"] / max(r["ok"], 1) * 1e6,
                "rps": r["rps"],
                "foreign_cores": r["foreign_cores"],
            }
        pair["change"] = pair["open"]["proxy_us"] / pair["closed"]["proxy_us"] - 1
        say(
            f"  {target.name}: pair {i + 1}: pages closed {pair['closed']['proxy_us']:.1f} µs/req"
            f", open {pair['open']['proxy_us']:.1f} µs/req ({100 * pair['change']:+.1f}%)"
        )
        pairs.append(pair)
    return pairs


def run_target(
    load: Load, target: Target, upstream_pids: list[int], args: argparse.Namespace
) -> dict[str, Any]:
    c, s = args.connections, args.seconds
    say(f"  {target.name}: warm-up {args.warmup:g} s")
    load.plain(target, c, args.warmup)
    out: dict[str, Any] = {}
    say(f"  {target.name}: non-streaming, {c} connections, {s:g} s")
    out["plain"] = measure(target, upstream_pids, lambda: load.plain(target, c, s), args)
    say(f"  {target.name}: streaming, {c} connections, {s:g} s")
    out["stream"] = measure(target, upstream_pids, lambda: load.stream(target, c, s), args)
    if args.unloaded_seconds > 0:
        u = args.unloaded_seconds
        say(f"  {target.name}: one connection, {u:g} s each")
        out["plain_c1"] = measure(target, upstream_pids, lambda: load.plain(target, 1, u), args)
        out["stream_c1"] = measure(target, upstream_pids, lambda: load.stream(target, 1, u), args)
    for kind in ("plain", "plain_c1"):
        if kind in out:
            r = out[kind]
            ok = max(r["ok"], 1)
            r["proxy_us"] = r["proxy_cpu_s"] / ok * 1e6
            r["other_hops_us"] = r["other_hops_cpu_s"] / ok * 1e6
            r["upstream_us"] = r["upstream_cpu_s"] / ok * 1e6
    for kind in ("stream", "stream_c1"):
        if kind in out:
            r = out[kind]
            done = max(r["complete"], 1)
            r["proxy_us"] = r["proxy_cpu_s"] / done * 1e6
            r["other_hops_us"] = r["other_hops_cpu_s"] / done * 1e6
            r["upstream_us"] = r["upstream_cpu_s"] / done * 1e6
    return out


# -- the many-streams check ------------------------------------------------------------------


def many_streams(stack: Stack, args: argparse.Namespace, transport: str) -> dict[str, Any]:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    wanted = streams = args.streams
    note = ""
    if transport == "direct" and 2 * wanted + 64 > hard:
        # Each stream is two sockets in the gateway: the client's and the replica's.
        streams = (hard - 64) // 2
        note = (
            f"the direct transport holds 2 sockets per stream ({2 * wanted:,} for {wanted:,}); "
            f"the hard limit on open files here is {hard:,} and cannot be raised (no "
            f"CAP_SYS_RESOURCE), so {streams:,} streams"
        )
    gateway = start_gateway(stack, f"gw-hold-{transport}", transport, access_log=False)
    pid = gateway.pids[0]
    try:
        for _ in range(20):
            http(gateway.url, body(HOLD_CLUSTER))
        time.sleep(1.0)
        idle_rss, idle_fds = rss_bytes([pid]), open_fds(pid)
        say(
            f"  many streams, {transport} transport: {streams:,} streams, a chunk every "
            f"{args.stream_interval:g} s, held {args.stream_hold:g} s"
        )
        argv = [sys.executable, str(BENCH / "_http_load.py"), "hold", "--url", gateway.url]
        argv += ["--model", HOLD_CLUSTER, "--streams", str(streams)]
        argv += ["--hold", str(args.stream_hold), "--opening", "128"]
        client = stack.procs.start(f"hold-client-{transport}", argv, pipe=True)
        try:
            result = _hold(stack, client, pid, streams, args)
        finally:
            stack.procs.stop(client)
        time.sleep(2.0)
        result["closed_rss_mb"] = rss_bytes([pid]) / 2**20
        result["closed_fds"] = open_fds(pid)
    finally:
        stack.procs.stop(gateway.children[0])
    opened = max(result["open"], 1)
    result.update(
        transport=transport,
        wanted=wanted,
        streams=streams,
        note=note,
        idle_rss_mb=idle_rss / 2**20,
        idle_fds=idle_fds,
        rss_per_stream_kb=(result["open_rss_mb"] - idle_rss / 2**20) * 1024 / opened,
        interval_s=args.stream_interval,
    )
    return result


def _hold(
    stack: Stack, client: Child, pid: int, streams: int, args: argparse.Namespace
) -> dict[str, Any]:
    assert client.popen.stdout is not None
    out: dict[str, Any] = {"peak_rss_mb": 0.0}
    deadline = time.monotonic() + 120 + streams / 50 + args.stream_hold
    cpu_open = 0.0
    cpu_start = cpu_s([pid])
    while time.monotonic() < deadline:
        out["peak_rss_mb"] = max(out["peak_rss_mb"], rss_bytes([pid]) / 2**20)
        ready, _, _ = select.select([client.popen.stdout], [], [], 1.0)
        if not ready:
            if client.popen.poll() is not None:
                raise RuntimeError(f"the hold client exited:\n{client.tail()}")
            continue
        line = client.popen.stdout.readline()
        if not line:
            raise RuntimeError(f"the hold client exited:\n{client.tail()}")
        event = json.loads(line)
        if event["event"] == "open":
            cpu_open = cpu_s([pid])
            out["open_cpu_us_per_stream"] = (cpu_open - cpu_start) / max(event["open"], 1) * 1e6
            out.update(
                open=event["open"],
                failed=event["failed"],
                errors=event["errors"],
                open_s=event["open_s"],
                ttfc_p50_ms=event["ttfc_p50_ms"],
                ttfc_p99_ms=event["ttfc_p99_ms"],
                open_rss_mb=rss_bytes([pid]) / 2**20,
                open_fds=open_fds(pid),
                agent_rss_mb=rss_bytes([stack.agent_pid]) / 2**20,
            )
            say(
                f"  {event['open']:,} open, {event['failed']} failed in {event['open_s']:.1f} s;"
                f" gateway RSS {out['open_rss_mb']:.0f} MB, {out['open_fds']:,} fds"
            )
        elif event["event"] == "held":
            cpu_held = cpu_s([pid])
            out.update(
                chunks_during_hold=event["chunks_during_hold"],
                ended_early=event["ended"],
                hold_errors=event["errors"],
                hold_cpu_cores=(cpu_held - cpu_open) / args.stream_hold,
                hold_cpu_us_per_chunk=(cpu_held - cpu_open)
                / max(event["chunks_during_hold"], 1)
                * 1e6,
            )
            client.popen.wait(60)
            return out
    raise RuntimeError("the many-streams check did not finish in time")


# -- aggregation and output ------------------------------------------------------------------


def front_handshakes(paths: Sequence[Path]) -> int:
    """The TLS handshakes the fronts accepted, from what each wrote as it stopped."""
    total = 0
    for path in paths:
        with contextlib.suppress(OSError, ValueError, KeyError):
            total += int(json.loads(path.read_text())["tls_handshakes"])
    return total


def _front_row(r: dict[str, Any]) -> dict[str, Any]:
    """One front row's run: the figures the TLS comparison reads."""
    p = r["plain"]
    out = {
        "rps": p["rps"],
        "p50_ms": p["p50_ms"],
        "gateway_us": p["proxy_us"],
        "fronts_us": p["other_hops_us"],
        "total_us": p["proxy_us"] + p["other_hops_us"],
        "box_cores": p["box_cores"],
        "foreign_cores": p["foreign_cores"],
        "tls_handshakes": r.get("fronts", {}).get("tls_handshakes", 0),
        # Requests measured (warm-ups not counted): what the handshakes compare with.
        "requests": sum(r[k]["ok"] for k in ("plain", "plain_c1") if k in r)
        + sum(r[k]["complete"] for k in ("stream", "stream_c1") if k in r),
    }
    if "stream" in r:
        out["stream_gateway_us"] = r["stream"]["proxy_us"]
        out["stream_total_us"] = r["stream"]["proxy_us"] + r["stream"]["other_hops_us"]
    if "plain_c1" in r:  # one connection: the machine not saturated
        out["c1_total_us"] = r["plain_c1"]["proxy_us"] + r["plain_c1"]["other_hops_us"]
    return out


def front_tls_summary(runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """gateway-front-tls against gateway-front, run by run (each round runs both, one after the
    other: the same machine state), and the medians of the per-run ratios."""
    plain, tls = runs.get("gateway-front"), runs.get("gateway-front-tls")
    if not plain or not tls:
        return None
    pairs = []
    for a, b in zip(plain, tls, strict=False):
        pa, pb = _front_row(a), _front_row(b)
        pair: dict[str, Any] = {"plain": pa, "tls": pb}
        pair["cpu_ratio"] = pb["total_us"] / pa["total_us"] if pa["total_us"] else float("nan")
        pair["gateway_ratio"] = (
            pb["gateway_us"] / pa["gateway_us"] if pa["gateway_us"] else float("nan")
        )
        if pa.get("stream_total_us"):
            pair["stream_ratio"] = pb["stream_total_us"] / pa["stream_total_us"]
        if pa.get("c1_total_us") and "c1_total_us" in pb:
            pair["c1_ratio"] = pb["c1_total_us"] / pa["c1_total_us"]
        pairs.append(pair)
    out: dict[str, Any] = {"runs": pairs, "target": FRONT_TLS_CPU}
    for key in ("cpu_ratio", "gateway_ratio", "stream_ratio", "c1_ratio"):
        values = [p[key] for p in pairs if key in p]
        if values:
            out[key] = statistics.median(values)
    for side in ("plain", "tls"):
        out[side] = {
            key: statistics.median(p[side][key] for p in pairs)
            for key in pairs[0][side]
            if all(key in p[side] for p in pairs)
        }
    return out


def front_tls_report(summary: dict[str, Any]) -> str:
    rows = []

    def cells(label: str, side: str, r: dict[str, Any]) -> list[str]:
        stream = r.get("stream_total_us")
        return [
            label,
            side,
            fmt(r["rps"]),
            fmt(r["p50_ms"], 3),
            fmt(r["gateway_us"], 1),
            fmt(r["fronts_us"], 1),
            fmt(r["total_us"], 1),
            fmt(stream, 1) if stream is not None else "-",
            f"{int(r['tls_handshakes'])} / {int(r['requests']):,}" if side == "TLS" else "-",
            f"{r['box_cores']:.2f}/{r['foreign_cores']:.2f}",
        ]

    for i, pair in enumerate(summary["runs"], 1):
        rows.append(cells(f"run {i}", "plain", pair["plain"]))
        rows.append(cells(f"run {i}", "TLS", pair["tls"]))
    rows.append(cells("median", "plain", summary["plain"]))
    rows.append(cells("median", "TLS", summary["tls"]))
    text = table(
        [
            "",
            "fronts",
            "req/s",
            "p50 ms",
            "gateway µs/req",
            "fronts µs/req",
            "gateway+fronts µs/req",
            "gateway+fronts µs/stream",
            "TLS handshakes / requests",
            "box/foreign cores",
        ],
        rows,
    )

    def ratios(key: str) -> str:
        each = ", ".join(f"{p[key]:.3f}" for p in summary["runs"] if key in p)
        return f"{each}; median {summary[key]:.3f}" if key in summary else "-"

    return (
        f"{text}\n\nTLS/plain, CPU per request, gateway + fronts (the hop's two ends): "
        f"{ratios('cpu_ratio')} (target <= {summary['target']:g}); the gateway alone: "
        f"{ratios('gateway_ratio')}; per stream, gateway + fronts: {ratios('stream_ratio')}; "
        f"per request at one connection (unloaded), gateway + fronts: {ratios('c1_ratio')}"
    )


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per kind (plain, stream, ...), the median of every number over the runs."""
    out: dict[str, Any] = {}
    for kind in runs[0]:
        merged: dict[str, Any] = {}
        for key, value in runs[0][kind].items():
            values = [r[kind][key] for r in runs if kind in r]
            if isinstance(value, int | float) and not isinstance(value, bool):
                merged[key] = statistics.median(values)
            else:
                merged[key] = value
        out[kind] = merged
    return out


def ratio(a: float | None, b: float | None) -> str:
    if a is None or b is None or not b or a != a or b != b:
        return "-"
    value = a / b
    return f"{value:.3f}" if value < 0.1 else f"{value:.2f}"


def fmt(value: float | None, digits: int = 2) -> str:
    if value is None or value != value:
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.0f}"
    return f"{value:.{digits}f}"


def get(med: dict[str, Any], target: str, kind: str, key: str) -> float | None:
    value = med.get(target, {}).get(kind, {}).get(key)
    return float(value) if value is not None else None


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |"]
    lines.append("|" + "|".join("---" if i == 0 else "---:" for i in range(len(headers))) + "|")
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _against_baselines(med: dict[str, Any], kind: str, key: str, value: float) -> list[str]:
    """A figure, then its ratio to the direct run's and to nginx's."""
    return [
        fmt(value),
        ratio(value, get(med, "direct", kind, key)),
        ratio(value, get(med, "nginx", kind, key)),
    ]


def _cpu_cells(med: dict[str, Any], target: str, kind: str, r: dict[str, Any]) -> list[str]:
    """Proxy CPU per request and its ratios; for the direct run, the upstream's own CPU."""
    if target == "direct":
        return [
            f"(upstream {fmt(r['upstream_us'], 1)})",
            "1.00",
            ratio(r["upstream_us"], get(med, "nginx", kind, "proxy_us")),
        ]
    return [
        fmt(r["proxy_us"], 1),
        ratio(r["proxy_us"], get(med, "direct", kind, "upstream_us")),
        ratio(r["proxy_us"], get(med, "nginx", kind, "proxy_us")),
    ]


def plain_table(med: dict[str, Any], order: list[str], kind: str) -> str:
    rows = []
    for t in order:
        if kind not in med.get(t, {}):
            continue
        r = med[t][kind]

        def three(key: str, r: dict[str, Any] = r) -> list[str]:
            return _against_baselines(med, kind, key, r[key])

        cpu = _cpu_cells(med, t, kind, r)
        cores = r["proxy_cpu_s"] / r["seconds"] if t != "direct" else 0.0
        bad = f"{int(r['non2xx'])}/{int(r['errors'])}"
        rows.append(
            [
                t,
                *three("rps"),
                *three("p50_ms"),
                *three("p99_ms"),
                *cpu,
                fmt(cores) if t != "direct" else "-",
                f"{r['box_cores']:.2f}/{r['foreign_cores']:.2f}",
                bad,
            ]
        )
    return table(
        [
            "target",
            "req/s",
            "÷direct",
            "÷nginx",
            "p50 ms",
            "÷direct",
            "÷nginx",
            "p99 ms",
            "÷direct",
            "÷nginx",
            "proxy CPU µs/req",
            "÷direct¹",
            "÷nginx",
            "proxy cores",
            "box/foreign cores",
            "non-2xx/errors",
        ],
        rows,
    )


def stream_table(med: dict[str, Any], order: list[str], kind: str) -> str:
    rows = []
    for t in order:
        if kind not in med.get(t, {}):
            continue
        r = med[t][kind]

        def three(key: str, r: dict[str, Any] = r) -> list[str]:
            return _against_baselines(med, kind, key, r[key])

        cpu = _cpu_cells(med, t, kind, r)
        bad = f"{int(r['incomplete'])}/{int(r['non2xx'])}/{int(r['errors'])}"
        rows.append(
            [
                t,
                *three("streams_per_s"),
                *three("ttfc_p50_ms"),
                *three("ttfc_p99_ms"),
                fmt(r["stream_p50_ms"]),
                *cpu,
                f"{r['box_cores']:.2f}/{r['foreign_cores']:.2f}",
                bad,
            ]
        )
    return table(
        [
            "target",
            "streams/s",
            "÷direct",
            "÷nginx",
            "TTFC p50 ms",
            "÷direct",
            "÷nginx",
            "TTFC p99 ms",
            "÷direct",
            "÷nginx",
            "stream p50 ms",
            "proxy CPU µs/stream",
            "÷direct¹",
            "÷nginx",
            "box/foreign cores",
            "cut/non-2xx/errors",
        ],
        rows,
    )


def unloaded_table(med: dict[str, Any], order: list[str]) -> str:
    rows = []
    for t in order:
        if "plain_c1" not in med.get(t, {}):
            continue
        p, s = med[t]["plain_c1"], med[t]["stream_c1"]
        dp = get(med, "direct", "plain_c1", "p50_ms")
        ds = get(med, "direct", "stream_c1", "ttfc_p50_ms")
        np_ = get(med, "nginx", "plain_c1", "p50_ms")
        ns = get(med, "nginx", "stream_c1", "ttfc_p50_ms")
        rows.append(
            [
                t,
                fmt(p["rps"]),
                fmt(p["p50_ms"], 3),
                fmt(p["p50_ms"] - dp, 3) if dp is not None else "-",
                fmt(p["p50_ms"] - np_, 3) if np_ is not None else "-",
                fmt(p["p99_ms"], 3),
                fmt(s["ttfc_p50_ms"], 3),
                fmt(s["ttfc_p50_ms"] - ds, 3) if ds is not None else "-",
                fmt(s["ttfc_p50_ms"] - ns, 3) if ns is not None else "-",
                fmt(s["ttfc_p99_ms"], 3),
            ]
        )
    return table(
        [
            "target",
            "req/s",
            "p50 ms",
            "added vs direct",
            "vs nginx",
            "p99 ms",
            "TTFC p50 ms",
            "added vs direct",
            "vs nginx",
            "TTFC p99 ms",
        ],
        rows,
    )


def verdicts(
    med: dict[str, Any], many: list[dict[str, Any]], fronts: dict[str, Any] | None = None
) -> list[tuple[str, str, str]]:
    out: list[tuple[str, str, str]] = []

    def check(name: str, ok: bool | None, detail: str) -> None:
        out.append((name, "n/a" if ok is None else "PASS" if ok else "MISS", detail))

    gw_cpu = get(med, "gateway", "plain", "proxy_us")
    ng_cpu = get(med, "nginx", "plain", "proxy_us")
    if gw_cpu is not None and ng_cpu:
        check(
            f"gateway CPU per request <= {CPU_VS_NGINX:g}x nginx",
            gw_cpu <= CPU_VS_NGINX * ng_cpu,
            f"{gw_cpu:.1f} µs vs nginx {ng_cpu:.1f} µs = {gw_cpu / ng_cpu:.1f}x",
        )
    else:
        check(f"gateway CPU per request <= {CPU_VS_NGINX:g}x nginx", None, "needs both rows")
    for kind, label in (("plain", f"{_conns(med)} connections"), ("plain_c1", "1 connection")):
        gw, d = get(med, "gateway", kind, "p50_ms"), get(med, "direct", kind, "p50_ms")
        name = f"<= {ADDED_P50_MS:g} ms added at p50 ({label})"
        if gw is None or d is None:
            check(name, None, "needs the gateway and direct rows")
        else:
            check(name, gw - d <= ADDED_P50_MS, f"{gw:.3f} - {d:.3f} = {gw - d:+.3f} ms")
    ov, gw = get(med, "overlay", "plain", "rps"), get(med, "gateway", "plain", "rps")
    name = f"overlay >= {OVERLAY_SHARE:.0%} of the direct transport's req/s"
    if ov is None or not gw:
        check(name, None, "needs the overlay and gateway rows")
    else:
        check(name, ov >= OVERLAY_SHARE * gw, f"{ov:,.0f} / {gw:,.0f} = {ov / gw:.0%}")
    gt, nt = (
        get(med, "gateway", "stream", "ttfc_p50_ms"),
        get(med, "nginx", "stream", "ttfc_p50_ms"),
    )
    name = f"streaming TTFC p50 within {TTFC_VS_NGINX_MS:g} ms of nginx's"
    if gt is None or nt is None:
        check(name, None, "needs the gateway and nginx rows")
    else:
        check(name, gt - nt <= TTFC_VS_NGINX_MS, f"{gt:.2f} - {nt:.2f} = {gt - nt:+.2f} ms")
    gc, nc = get(med, "gateway", "stream", "proxy_us"), get(med, "nginx", "stream", "proxy_us")
    name = f"CPU per stream <= {STREAM_CPU_VS_NGINX:g}x nginx's"
    if gc is None or not nc:
        check(name, None, "needs the gateway and nginx rows")
    else:
        check(
            name,
            gc <= STREAM_CPU_VS_NGINX * nc,
            f"{gc:.0f} µs vs nginx {nc:.0f} µs = {gc / nc:.1f}x",
        )
    name = (
        f"TLS to nodes' fronts: gateway + fronts CPU per request <= {FRONT_TLS_CPU:g}x plain "
        "(median of the runs' ratios)"
    )
    if fronts is None or "cpu_ratio" not in fronts:
        check(name, None, "needs the gateway-front and gateway-front-tls rows")
    else:
        ratio_ = fronts["cpu_ratio"]
        check(
            name,
            ratio_ <= FRONT_TLS_CPU,
            f"{fronts['tls']['total_us']:.1f} vs {fronts['plain']['total_us']:.1f} µs/req "
            f"(medians); ratio {ratio_:.3f} ({100 * (ratio_ - 1):+.1f}%)",
        )
    name = f"one gateway process holding {MANY_STREAMS:,} open streams"
    if not many:
        check(name, None, "not run (--streams 10000)")
    for m in many:
        held = m["open"] == m["streams"] and m["failed"] == 0 and m["ended_early"] == 0
        full = m["streams"] >= MANY_STREAMS
        short = ""
        if m["streams"] < m["wanted"]:
            short = f"; only {m['streams']:,} fit under this machine's open-file limit"
        elif not full:
            short = f"; only {m['wanted']:,} asked for"
        testable = m["wanted"] >= MANY_STREAMS and m["streams"] >= m["wanted"]
        if m["streams"] < m["wanted"]:
            at_full = m["idle_rss_mb"] + m["rss_per_stream_kb"] * m["wanted"] / 1024
            short += f" (at {m['wanted']:,} by the same slope: about {at_full:.0f} MB)"
        check(
            f"{name} ({m['transport']} transport)",
            (held and full) if testable else None,
            f"{m['open']:,}/{m['streams']:,} open, RSS {m['open_rss_mb']:.0f} MB "
            f"({m['rss_per_stream_kb']:.1f} KB per stream){short}",
        )
    return out


def _conns(med: dict[str, Any]) -> int:
    return int(med.get("_connections", 64))


def print_report(result: dict[str, Any]) -> None:
    med, order = result["median"], result["order"]
    if order:
        print()
        print(
            f"## Non-streaming chat completions, {result['connections']} connections, "
            f"{result['seconds']:g} s ({result['loadgen']})"
        )
        print()
        print(plain_table(med, order, "plain"))
        print()
        print(
            "¹ ÷direct for CPU: the proxy's CPU per request over the upstream's own CPU per "
            "request when reached directly. proxy cores: the proxy's CPU use during the run; "
            "box/foreign: the whole machine's cores busy (of 2), and those used by processes "
            "not ours."
        )
        print()
        print(
            f"## Streaming: 20 SSE chunks 5 ms apart + [DONE], {result['connections']} "
            f"concurrent streams, {result['seconds']:g} s (Python client)"
        )
        print()
        print(stream_table(med, order, "stream"))
        if any("plain_c1" in med.get(t, {}) for t in order):
            print()
            print(
                f"## Unloaded: one connection, {result['unloaded_seconds']:g} s each "
                "(the hop cost without queueing)"
            )
            print()
            print(unloaded_table(med, order))
    for t in order:
        note = result["notes"].get(t)
        r = med.get(t, {})
        if t == "overlay" and "plain" in r:
            path_req = r["plain"]["proxy_us"] + r["plain"]["other_hops_us"]
            path_stream = r["stream"]["proxy_us"] + r["stream"]["other_hops_us"]
            print(
                f"\noverlay: gateway + nats-server + agent together {path_req:.1f} µs/req, "
                f"{path_stream:.0f} µs/stream (the gateway alone is the table's figure)"
            )
        if t in FRONT_ROWS and "plain" in r:
            path_req = r["plain"]["proxy_us"] + r["plain"]["other_hops_us"]
            path_stream = r["stream"]["proxy_us"] + r["stream"]["other_hops_us"]
            print(
                f"\n{t}: gateway + fronts together {path_req:.1f} µs/req, {path_stream:.0f} "
                "µs/stream (the gateway alone is the table's figure)"
            )
        if note:
            print(f"{t}: {note}")
    if result.get("front_tls"):
        print(
            "\n## Through nodes' fronts, plain HTTP against mutual TLS (issue 22), "
            f"{result['connections']} connections, non-streaming\n"
        )
        print(front_tls_report(result["front_tls"]))
    for reason in result["skipped"]:
        print(f"skipped {reason}")
    if result["many_streams"]:
        print("\n## Many open streams through one gateway process\n")
        for m in result["many_streams"]:
            print(
                f"{m['transport']}: {m['open']:,}/{m['streams']:,} streams open "
                f"({m['failed']} failed) in {m['open_s']:.1f} s, TTFC p50 "
                f"{m['ttfc_p50_ms']:.1f} ms / p99 {m['ttfc_p99_ms']:.1f} ms while opening; "
                f"gateway RSS {m['idle_rss_mb']:.0f} MB idle -> {m['open_rss_mb']:.0f} MB open "
                f"(peak {m['peak_rss_mb']:.0f}; {m['rss_per_stream_kb']:.1f} KB per stream) -> "
                f"{m['closed_rss_mb']:.0f} MB after closing; {m['open_fds']:,} fds open; "
                f"gateway CPU {m['open_cpu_us_per_stream']:.0f} µs per stream opened"
            )
            print(
                f"  during the {result['stream_hold']:g} s hold: {m['chunks_during_hold']:,} "
                f"chunks relayed (one per stream every {m['interval_s']:g} s), gateway "
                f"{m['hold_cpu_cores']:.2f} cores, {m['hold_cpu_us_per_chunk']:.0f} µs/chunk; "
                f"{m['ended_early']} streams ended early"
                + (f"; agent RSS {m['agent_rss_mb']:.0f} MB" if m["transport"] == "overlay" else "")
            )
            if m["note"]:
                print(f"  note: {m['note']}")
    dash = result.get("dashboard")
    if dash is not None:
        print(
            f"\ndashboard: {dash['pages']} page(s) on /ui/fleet during each gateway row, "
            f"{dash['nodes']} stand-in nodes heartbeating once a second"
        )
        for r in dash["runs"]:
            line = f"  {r['target']}: gateway {r['idle_gateway_cores']:.4f} cores with no requests"
            if "pages" in r:
                line += (
                    f"; during the run the browser used {r['browser_cores']:.2f} cores; "
                    f"{r['live_at_end']}/{r['pages']} still live at the end, rows {r['rows']}; "
                    f"console problems: {r['problems'] or 'none'}"
                )
            print(line)
            if r.get("alternated"):
                closed = statistics.median(p["closed"]["proxy_us"] for p in r["alternated"])
                opened = statistics.median(p["open"]["proxy_us"] for p in r["alternated"])
                changes = ", ".join(f"{100 * p['change']:+.1f}%" for p in r["alternated"])
                print(
                    f"  {r['target']}, {len(r['alternated'])} alternated pairs in one process: "
                    f"median {closed:.1f} µs/req closed, {opened:.1f} open "
                    f"({100 * (opened / closed - 1):+.1f}%); each pair {changes}"
                )
    print("\n## Targets\n")
    for name, verdict, detail in result["verdicts"]:
        print(f"{verdict:4} {name}: {detail}")


# -- main ------------------------------------------------------------------------------------


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _version(argv: list[str]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    text = (out.stdout + out.stderr).decode(errors="replace").strip().splitlines()
    return text[0] if text else "?"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0, help="per measurement")
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--runs", type=int, default=1, help="rounds over the targets; medians")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds before each row")
    parser.add_argument(
        "--unloaded-seconds", type=float, default=3.0, help="one-connection runs (0: skip)"
    )
    parser.add_argument(
        "--only",
        default=",".join(ALL_TARGETS),
        help=f"comma-separated rows (default all: {','.join(ALL_TARGETS)}); `none` for none",
    )
    parser.add_argument(
        "--peers-venv", metavar="DIR", help="a venv (or a folder of venvs) with vllm-router/litellm"
    )
    parser.add_argument(
        "--install-peers",
        action="store_true",
        help="pip install vllm-router and litellm[proxy] into --install-dir (kept for reuse)",
    )
    parser.add_argument("--install-dir", default="", metavar="DIR")
    parser.add_argument("--install-timeout", type=float, default=900.0)
    parser.add_argument(
        "--streams", type=int, default=0, help="the many-streams check: this many (e.g. 10000)"
    )
    parser.add_argument(
        "--streams-transport", default="direct,overlay", help="for --streams (default both)"
    )
    parser.add_argument(
        "--dashboard",
        type=int,
        metavar="N",
        help="N headless Chromium pages on /ui's fleet page (signed in, live) during each "
        "gateway row's measured run; 0: the same stand-in controller and admin key, no page",
    )
    parser.add_argument(
        "--dashboard-nodes",
        type=int,
        default=100,
        help="for --dashboard: the stand-in fleet's nodes, a heartbeat each a second",
    )
    parser.add_argument(
        "--dashboard-alternate",
        type=int,
        default=0,
        metavar="K",
        help="with --dashboard N>=1: K more pairs of non-streaming runs per gateway row, in its "
        "one process, pages open and closed in turn",
    )
    parser.add_argument("--serve-fleet", metavar="NATS_URL", help=argparse.SUPPRESS)
    parser.add_argument("--stream-interval", type=float, default=5.0, help="s between chunks")
    parser.add_argument("--stream-hold", type=float, default=20.0, help="s to hold them open")
    parser.add_argument(
        "--python-load", action="store_true", help="the Python generator even if wrk is there"
    )
    parser.add_argument(
        "--quiet",
        type=float,
        default=0.15,
        help="before each measurement, wait until other processes use under this many cores",
    )
    parser.add_argument("--quiet-timeout", type=float, default=600.0, metavar="S")
    parser.add_argument("--keep", metavar="DIR", help="keep logs and configs here")
    parser.add_argument("--json", action="store_true")
    add_quick(
        parser,
        " ".join(f"--{k.replace('_', '-')} {v:g}" for k, v in QUICK.items())
        + ", no wait for a quiet machine",
    )
    args = parser.parse_args()
    if args.serve_fleet:
        asyncio.run(serve_fleet(args.serve_fleet, args.dashboard_nodes))
        return 0
    apply_quick(parser, args, **QUICK)
    if args.dashboard is not None and args.dashboard < 0:
        parser.error("--dashboard: a number of pages, 0 or more")
    if args.dashboard_alternate and not args.dashboard:
        parser.error("--dashboard-alternate: needs --dashboard 1 or more (pages to open)")
    if args.install_peers and not args.install_dir:
        args.install_dir = str(Path(tempfile.gettempdir()) / "gpumesh-bench-peers")
    order = [] if args.only == "none" else [t.strip() for t in args.only.split(",") if t.strip()]
    unknown = set(order) - set(ALL_TARGETS)
    if unknown:
        parser.error(f"--only: unknown {sorted(unknown)}; choose from {ALL_TARGETS}")
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    signal.signal(signal.SIGTERM, _stop_on_sigterm)

    python = os.path.relpath(sys.executable) if sys.executable.startswith(str(ROOT)) else "python"
    command = shlex.join([python, *sys.argv])
    use_wrk = shutil.which("wrk") is not None and not args.python_load
    loadgen = (
        f"wrk {_version(['wrk', '-v']).split()[1].split('/')[-1]}, 1 thread"
        if use_wrk
        else "built-in Python closed loop (no wrk)"
    )
    load1 = os.getloadavg()[0]
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    header = [
        f"command: {command}",
        f"date: {started}, {os.cpu_count()} cores, load average {load1:.2f} at the start, "
        f"Python {sys.version.split()[0]}",
        f"non-streaming load: {loadgen}; streaming: Python aiohttp client (separate process)",
        f"upstreams: {UPSTREAMS} aiohttp processes on asyncio (direct uses one), 317-byte "
        "answer; SSE: 20 chunks 5 ms apart",
    ]
    if args.dashboard is not None:
        header.append(
            f"dashboard: {args.dashboard} Chromium page(s) on /ui/fleet during each gateway "
            f"row; stand-in controller with {args.dashboard_nodes} nodes, a heartbeat each a "
            "second"
        )
    announce(args, json_output=args.json)
    if not args.json:
        print("\n".join(header), flush=True)
    else:
        say("\n".join(header))

    workdir = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="gpumesh-bench-gw-"))
    workdir.mkdir(parents=True, exist_ok=True)
    procs = Procs(workdir)
    skipped: list[str] = []
    notes: dict[str, str] = {}
    runs: dict[str, list[dict[str, Any]]] = {}
    many: list[dict[str, Any]] = []
    peers: dict[str, Path] = {}
    dashboards: Dashboards | None = None
    dashboard_runs: list[dict[str, Any]] = []
    try:
        if "nginx" in order and shutil.which("nginx") is None:
            order.remove("nginx")
            skipped.append("nginx: not on PATH (apt-get install nginx-light)")
        for name, requirement, executable in (
            ("vllm-router", "vllm-router", "vllm-router"),
            ("litellm", "litellm[proxy]", "litellm"),
        ):
            if name not in order:
                continue
            found = find_peer(args, executable)
            why = ""
            if found is None and args.install_peers:
                why = install_peer(args, name, requirement, executable)
                found = None if why else find_peer(args, executable)
            if found is None:
                order.remove(name)
                skipped.append(
                    f"{name}: "
                    + (why or "not installed (give --peers-venv DIR or --install-peers)")
                )
            else:
                peers[name] = found
        say(f"starting upstreams, nats-server, routing feed and agent in {workdir}")
        stack = start_stack(procs, workdir, args)
        load = Load(workdir, procs, use_wrk)
        if args.dashboard:
            dashboards = Dashboards(args.dashboard)
            dashboards.start()
        all_upstreams = [c.pid for _, _, c in stack.upstreams]
        for run in range(args.runs):
            for name in list(order):
                say(f"run {run + 1}/{args.runs}: {name}")
                try:
                    target = _start_target(stack, name, peers)
                except StartFailed as exc:
                    order.remove(name)
                    skipped.append(f"{name}: did not start: {str(exc).splitlines()[0]}")
                    say(str(exc))
                    continue
                if target.note:
                    notes[name] = target.note
                upstream_pids = all_upstreams[:1] if name == "direct" else all_upstreams
                with_pages = dashboards is not None and name in GATEWAY_ROWS
                try:
                    dash: dict[str, Any] = {"target": name}
                    if with_pages:
                        assert dashboards is not None
                        say(f"  {name}: {args.dashboard} dashboard page(s) open on /ui/fleet")
                        dashboards.open(target.base, stack.admin_key)
                    if args.dashboard is not None and name in GATEWAY_ROWS:
                        # With no requests: what the pages (or none) cost the gateway alone.
                        cpu0, t0 = cpu_s(target.pids), time.monotonic()
                        time.sleep(DASHBOARD_IDLE_S)
                        idle = (cpu_s(target.pids) - cpu0) / (time.monotonic() - t0)
                        dash["idle_gateway_cores"] = idle
                        say(f"  {name}: idle, {args.dashboard} page(s): gateway {idle:.4f} cores")
                    t0 = time.monotonic()
                    browser0 = dashboards.cpu_s() if dashboards is not None else 0.0
                    data = run_target(load, target, upstream_pids, args)
                    if with_pages:
                        assert dashboards is not None
                        elapsed = time.monotonic() - t0
                        dash["browser_cores"] = (dashboards.cpu_s() - browser0) / elapsed
                        dash.update(dashboards.close_pages())
                    if with_pages and args.dashboard_alternate:
                        assert dashboards is not None
                        dash["alternated"] = alternate(
                            load, target, upstream_pids, args, dashboards, stack.admin_key
                        )
                    if args.dashboard is not None and name in GATEWAY_ROWS:
                        dashboard_runs.append(dash)
                finally:
                    for child in [*target.children, *target.aux]:
                        procs.stop(child)
                if target.front_stats:
                    data["fronts"] = {"tls_handshakes": front_handshakes(target.front_stats)}
                runs.setdefault(name, []).append(data)
        if args.streams:
            for transport in args.streams_transport.split(","):
                many.append(many_streams(stack, args, transport.strip()))
    except KeyboardInterrupt:
        say("interrupted: stopping every process started")
        procs.stop_all()
        return 130
    finally:
        if dashboards is not None:
            dashboards.stop()
        procs.stop_all()
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    med: dict[str, Any] = {name: median_of(r) for name, r in runs.items()}
    med["_connections"] = args.connections
    result = {
        "command": command,
        "date": started,
        "loadgen": loadgen,
        "connections": args.connections,
        "seconds": args.seconds,
        "runs": args.runs,
        "unloaded_seconds": args.unloaded_seconds,
        "stream_hold": args.stream_hold,
        "order": [t for t in order if t in runs],
        "median": med,
        "per_run": runs,
        "notes": notes,
        "skipped": skipped,
        "many_streams": many,
        "dashboard": None
        if args.dashboard is None
        else {"pages": args.dashboard, "nodes": args.dashboard_nodes, "runs": dashboard_runs},
    }
    result["front_tls"] = front_tls_summary(runs)
    result["verdicts"] = verdicts(med, many, result["front_tls"])
    mark(args, result)
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print_report(result)
    return 0


def _start_target(stack: Stack, name: str, peers: dict[str, Path]) -> Target:
    if name == "direct":
        uid, port, _child = stack.upstreams[0]
        return Target("direct", f"http://127.0.0.1:{port}", note=f"one upstream ({uid})")
    if name == "gateway":
        return start_gateway(stack, "gateway", "direct", access_log=False)
    if name == "gateway-log":
        return start_gateway(stack, "gateway-log", "direct", access_log=True)
    if name == "overlay":
        return start_gateway(stack, "overlay", "overlay", access_log=False)
    if name in FRONT_ROWS:
        return start_gateway_front(stack, name, tls=name == "gateway-front-tls")
    if name == "aiohttp-proxy":
        port = free_port()
        argv = [sys.executable, str(BENCH / "_upstream.py"), "proxy", "--port", str(port)]
        for _, p, _ in stack.upstreams:
            argv += ["--upstream", f"http://127.0.0.1:{p}"]
        child = stack.procs.start("aiohttp-proxy", argv, ready_line=True)
        return Target(
            "aiohttp-proxy",
            f"http://127.0.0.1:{port}",
            children=[child],
            note="a bare aiohttp reverse proxy (bench/_upstream.py proxy): the aiohttp floor",
        )
    if name == "nginx":
        return start_nginx(stack)
    if name == "vllm-router":
        return start_vllm_router(stack, peers[name])
    return start_litellm(stack, peers[name])


if __name__ == "__main__":
    sys.exit(main())
