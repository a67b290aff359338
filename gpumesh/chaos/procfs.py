"""The stack's processes as /proc shows them (Linux), the signals chaos sends them, and how it
starts one again.

A process is read whole (`Proc`: command line, environment, directory, log file, parent and
group) so that one chaos killed can be started again the same way (`spawn_again`). The stack's
own processes are told apart from anybody else's by their --nats URL or their data directory
(`scan`), the way the CLI itself resolves them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

OWNER_ENV = "GPUMESH_CHAOS_OWNER"  # "pid:start" of the process a restarted one lives with
_VALUED = {"--data-dir", "--log-level", "--log-format"}  # common options before a subcommand


@dataclass(frozen=True)
class Proc:
    """A process as /proc shows it: enough to signal it, and to start it again the same way."""

    pid: int
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict, compare=False)
    cwd: str = ""
    stdout: str = ""  # the regular file its stdout goes to, "" if none
    ppid: int = 0
    pgid: int = 0

    @property
    def args(self) -> list[str]:
        """The arguments after `gpumesh` (or after `-m gpumesh`)."""
        return gpumesh_args(self.argv) or []


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours
        return b""


def _stat(pid: int) -> list[bytes]:
    """The fields of /proc/PID/stat after the command name: [state, ppid, pgrp, ...]."""
    raw = _read(f"/proc/{pid}/stat")
    return raw[raw.rindex(b")") + 2 :].split() if raw else []


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    fields = _stat(pid)
    return bool(fields) and fields[0] != b"Z"


def start_time(pid: int) -> str:
    fields = _stat(pid)
    return fields[19].decode() if len(fields) > 19 else ""


def cmdline(pid: int) -> list[str]:
    raw = _read(f"/proc/{pid}/cmdline")
    return [a.decode(errors="replace") for a in raw.split(b"\0")[:-1]] if raw else []


def environ(pid: int) -> dict[str, str]:
    out = {}
    for item in _read(f"/proc/{pid}/environ").split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep:
            out[key.decode(errors="replace")] = value.decode(errors="replace")
    return out


def read_proc(pid: int) -> Proc | None:
    argv = cmdline(pid)
    fields = _stat(pid)
    if not argv or not fields or fields[0] == b"Z":
        return None
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd")
    except OSError:
        cwd = ""
    try:
        out = os.readlink(f"/proc/{pid}/fd/1")
    except OSError:
        out = ""
    if not (out.startswith("/") and os.path.isfile(out)):
        out = ""
    return Proc(
        pid=pid,
        argv=tuple(argv),
        env=environ(pid),
        cwd=cwd,
        stdout=out,
        ppid=int(fields[1]),
        pgid=int(fields[2]),
    )


def pids() -> list[int]:
    return sorted(int(name) for name in os.listdir("/proc") if name.isdigit())


def gpumesh_args(argv: Sequence[str]) -> list[str] | None:
    """`python -m gpumesh ARGS...` or `.../gpumesh ARGS...` -> ARGS; else None."""
    for i, arg in enumerate(argv[:4]):
        if arg == "-m" and i + 1 < len(argv):
            return list(argv[i + 2 :]) if argv[i + 1] == "gpumesh" else None
        if os.path.basename(arg) == "gpumesh":
            return list(argv[i + 1 :])
    return None


def subcommand(args: Sequence[str]) -> str:
    """The first word that is neither an option nor a common option's value."""
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg in _VALUED:
            skip = True
        elif not arg.startswith("-"):
            return arg
    return ""


def flag(args: Sequence[str], name: str) -> str | None:
    """The value of `--name V` or `--name=V` (the last one given), else None."""
    found = None
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args):
            found = args[i + 1]
        elif arg.startswith(name + "="):
            found = arg[len(name) + 1 :]
    return found


def with_flag(argv: Sequence[str], name: str, value: str) -> list[str]:
    """`argv` with the value of `--name` replaced (it must be there)."""
    out = list(argv)
    for i, arg in enumerate(out):
        if arg == name and i + 1 < len(out):
            out[i + 1] = value
        elif arg.startswith(name + "="):
            out[i] = f"{name}={value}"
    return out


def data_dir_of(proc: Proc) -> Path:
    """The data directory a gpumesh process uses: --data-dir, else the CLI's defaults as its
    own environment resolves them (gpumesh.cli.default_data_dir)."""
    given = flag(proc.args, "--data-dir")
    if given is not None:
        return resolve(Path(proc.cwd or "/") / given)
    env = proc.env
    if env.get("GPUMESH_DATA_DIR"):
        return resolve(Path(proc.cwd or "/") / env["GPUMESH_DATA_DIR"])
    xdg = env.get("XDG_DATA_HOME")
    base = Path(xdg) if xdg else Path(env.get("HOME", "/")) / ".local" / "share"
    return resolve(base / "gpumesh")


def resolve(path: Path) -> Path:
    with contextlib.suppress(OSError):
        return path.resolve()
    return path


@dataclass
class Found:
    """The processes of one stack on this machine."""

    agents: dict[str, Proc] = field(default_factory=dict)  # node id -> agent
    controller: Proc | None = None
    up: Proc | None = None
    nats: Proc | None = None


def scan(data_dir: Path, nats_url: str) -> Found:
    """Find the stack's processes: gpumesh agents, controller and up whose --nats is `nats_url`
    (or, with no --nats, whose data directory is `data_dir`), and its nats-server (its -sd is
    `data_dir`/nats, or its -p is the URL's port)."""
    found = Found()
    here = resolve(data_dir)
    port = nats_url.rsplit(":", 1)[-1].strip("/")
    me = os.getpid()
    for pid in pids():
        if pid == me:
            continue
        argv = cmdline(pid)
        if not argv:
            continue
        if os.path.basename(argv[0]).startswith("nats-server"):
            store = flag(argv, "-sd")
            if (store and resolve(Path(store)) == here / "nats") or flag(argv, "-p") == port:
                found.nats = read_proc(pid)
            continue
        args = gpumesh_args(argv)
        command = subcommand(args) if args else ""
        if command not in ("agent", "controller", "up"):
            continue
        proc = read_proc(pid)
        if proc is None or not ours(proc, here, nats_url):
            continue
        if command == "agent":
            node_id = flag(proc.args, "--node-id")
            if node_id and (node_id not in found.agents or pid > found.agents[node_id].pid):
                found.agents[node_id] = proc
        elif command == "controller":
            found.controller = proc
        else:
            found.up = proc
    return found


def ours(proc: Proc, data_dir: Path, nats_url: str) -> bool:
    url = flag(proc.args, "--nats")
    if url is not None:
        return url.rstrip("/") == nats_url.rstrip("/")
    return data_dir_of(proc) == data_dir


def workloads_of(agent_pid: int) -> list[int]:
    """The agent's workload processes: its children that carry GPUMESH_REPLICA_ID."""
    found = []
    for pid in pids():
        fields = _stat(pid)
        ours = len(fields) > 1 and fields[0] != b"Z" and int(fields[1]) == agent_pid
        if ours and b"GPUMESH_REPLICA_ID=" in _read(f"/proc/{pid}/environ"):
            found.append(pid)
    return found


def machine_group(proc: Proc) -> int | None:
    """The process group that is this agent's machine: its own (it was started in a new
    session, as `gpumesh up` and the test stack do) or its keeper's. None when it shares
    someone else's group (a shell job): then only the process itself is signalled."""
    if proc.pgid in (0, os.getpgrp()):
        return None
    if proc.pgid == proc.pid:
        return proc.pgid
    parent = cmdline(proc.ppid)
    if "gpumesh.keeper" in parent and _stat(proc.ppid)[2:3] == [str(proc.pgid).encode()]:
        return proc.pgid
    return None


def send_signal(pid: int, sig: signal.Signals, *, group: int | None = None) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if group is not None:
            os.killpg(group, sig)
        else:
            os.kill(pid, sig)


def kill_workload(pid: int) -> None:
    """Workloads lead their own session (nodeagent/workload/process.py): the whole group."""
    group = pid if _stat(pid)[2:3] == [str(pid).encode()] else None
    send_signal(pid, signal.SIGKILL, group=group)


def find_agent(node_id: str, data_dir: Path, nats_url: str) -> Proc | None:
    """The live agent process of `node_id` in this stack (it may have been started again)."""
    here = resolve(data_dir)
    for pid in pids():
        argv = cmdline(pid)
        args = gpumesh_args(argv) if argv else None
        if not args or subcommand(args) != "agent" or flag(args, "--node-id") != node_id:
            continue
        proc = read_proc(pid)
        if proc is not None and ours(proc, here, nats_url):
            return proc
    return None


def spawn_again(proc: Proc, log_path: Path, fallback_cwd: Path) -> None:
    """Start `proc`'s command again, with its environment, directory and log file, under a
    keeper (gpumesh/keeper.py) that stops it when the process that started the original
    (gpumesh up, a test harness) is gone. Blocks while the keeper detaches: run it in a thread."""
    env = dict(proc.env)
    owner = env.get(OWNER_ENV, "")
    if not owner:
        owner = f"{proc.ppid}:{start_time(proc.ppid)}" if proc.ppid > 1 else "0:"
        env[OWNER_ENV] = owner
    owner_pid, _, owner_start = owner.partition(":")
    argv = [sys.executable, "-m", "gpumesh.keeper", owner_pid, owner_start, "--", *proc.argv]
    cwd = proc.cwd if proc.cwd and os.path.isdir(proc.cwd) else str(fallback_cwd)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        keeper = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=log,
            env=env,
            cwd=cwd,
            start_new_session=True,  # its own group: a later power loss takes it all
        )
    keeper.wait(timeout=30)  # it forks and exits at once
