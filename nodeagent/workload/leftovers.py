"""Workloads an agent left behind: a record per running process group, and the sweep that
stops what a previous run of the agent left.

A workload must not outlive its agent unseen: it would keep its port and its GPU memory, and a
restarted agent would start a replacement beside it. Two things see to it:

- the workload's first process gets the parent-death signal (Linux `PR_SET_PDEATHSIG`,
  SIGKILL): when the agent dies, even by SIGKILL, the kernel kills it;
- the processes it forked are not covered by that, so each launch writes a record
  (`<records>/<replica>-<epoch>.json`: the process group, and the start time of its first
  process) that a clean stop removes. An agent starting on the same data directory stops every
  group a record still names, once it has checked that the group is still that workload (a
  member carries its `GPUMESH_REPLICA_ID` and `GPUMESH_EPOCH`), and says so in its log: the
  lease of that run is gone, and the controller places what should run.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ctypes.util
import json
import os
import signal
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import structlog

_log = structlog.get_logger("gpumesh.nodeagent.leftovers")

_PR_SET_PDEATHSIG = 1
_POLL_S = 0.05


def die_with_parent() -> None:
    """For `preexec_fn`, in the child between fork and exec: ask the kernel for SIGKILL when
    the parent dies. Linux only; elsewhere the records below are the only cover."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


@dataclass(frozen=True, slots=True)
class Record:
    replica_id: str
    epoch: int
    pgid: int
    started: int  # the first process's start time (clock ticks after boot), 0 if unknown
    port: int


class Records:
    """One JSON file per running workload under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def _path(self, replica_id: str, epoch: int) -> Path:
        return self.root / f"{replica_id}-{epoch}.json"

    def write(self, replica_id: str, epoch: int, pid: int, port: int) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        record = Record(replica_id, epoch, pid, start_time(pid), port)
        path = self._path(replica_id, epoch)
        partial = path.with_suffix(".tmp")
        partial.write_text(json.dumps(asdict(record)))
        partial.replace(path)

    def remove(self, replica_id: str, epoch: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(replica_id, epoch).unlink()

    def all(self) -> list[tuple[Path, Record | None]]:
        """Every record, in name order; None for a file that is not one (it is removed)."""
        if not self.root.is_dir():
            return []
        found: list[tuple[Path, Record | None]] = []
        for path in sorted(self.root.glob("*.json")):
            try:
                found.append((path, Record(**json.loads(path.read_text()))))
            except (OSError, ValueError, TypeError):
                found.append((path, None))
        return found


def start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat; 0 where there is no /proc or no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    # The command name (field 2) may hold spaces and parentheses: count from the last ')'.
    fields = stat[stat.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return 0


def members(pgid: int) -> list[int]:
    """The live processes of a process group (from /proc; empty where there is none)."""
    found = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else []:
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and fields[2] == str(pgid) and fields[0] != "Z":
            found.append(int(entry.name))
    return found


def _is_the_workload(pid: int, record: Record) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
    return (
        f"GPUMESH_REPLICA_ID={record.replica_id}".encode() in environ
        and f"GPUMESH_EPOCH={record.epoch}".encode() in environ
    )


def still_running(record: Record) -> list[int]:
    """The members of the record's group that are its workload; empty when the group is gone
    or the ids were reused by something else."""
    pids = members(record.pgid)
    leader_reused = (
        record.pgid in pids and record.started and start_time(record.pgid) != record.started
    )
    if leader_reused:
        return []
    return [pid for pid in pids if _is_the_workload(pid, record)]


async def stop_leftovers(records: Records, *, grace_s: float = 5.0) -> list[Record]:
    """Stop every workload a previous run left running (SIGTERM to its group, SIGKILL after
    `grace_s`), remove every record; returns the records whose workload was stopped."""
    stopped = []
    for path, record in await asyncio.to_thread(records.all):
        if record is None:
            _log.warning("workload_record_unreadable", path=str(path))
        elif await asyncio.to_thread(still_running, record):
            await _stop_group(record, grace_s)
            stopped.append(record)
            _log.warning(
                "orphan_workload_stopped",
                replica=record.replica_id,
                epoch=record.epoch,
                pgid=record.pgid,
                port=record.port,
                reason="left running by this agent's previous run, whose lease is gone; the "
                "controller places what should run",
            )
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return stopped


async def _stop_group(record: Record, grace_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + grace_s
    for sig in (signal.SIGTERM, signal.SIGKILL):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pgid, sig)
        # Not our children: nothing announces their end but their absence.
        while await asyncio.to_thread(still_running, record):
            if sig == signal.SIGTERM and loop.time() >= deadline:
                break
            if sig == signal.SIGKILL and loop.time() >= deadline + 5.0:
                return
            await asyncio.sleep(_POLL_S)
        else:
            return
