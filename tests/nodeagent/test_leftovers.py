"""Workloads never outlive their agent unseen (nodeagent/workload/leftovers.py), with real
processes: the first process dies with the agent, and what it forked is stopped by the agent's
next run from its record, but only if the process group is still that workload."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nodeagent.workload.leftovers import Records, members, start_time, stop_leftovers

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs /proc (Linux)")

# A model server's shape: a first process that forks a worker, both sleeping.
FORKING = textwrap.dedent(
    """
    import os, sys, time
    if os.fork() == 0:
        time.sleep(300)
        os._exit(0)
    print(os.getpid(), flush=True)
    time.sleep(300)
    """
)


def launch(replica: str, epoch: int) -> subprocess.Popen[bytes]:
    env = {**os.environ, "GPUMESH_REPLICA_ID": replica, "GPUMESH_EPOCH": str(epoch)}
    return subprocess.Popen(
        [sys.executable, "-c", FORKING], env=env, start_new_session=True, stdout=subprocess.PIPE
    )


async def group_of_two(proc: subprocess.Popen[bytes]) -> list[int]:
    assert proc.stdout is not None
    await asyncio.to_thread(proc.stdout.readline)
    for _ in range(200):
        found = members(proc.pid)
        if len(found) == 2:
            return found
        await asyncio.sleep(0.01)
    raise AssertionError(f"the group of {proc.pid} never had two members")


async def test_the_next_run_stops_a_group_left_running_and_forgets_its_record(
    tmp_path: Path,
) -> None:
    records = Records(tmp_path / "workloads")
    proc = launch("r1", 3)
    try:
        await group_of_two(proc)
        records.write("r1", 3, proc.pid, 8000)
        assert start_time(proc.pid) > 0
        stopped = await stop_leftovers(records, grace_s=2.0)
        assert [(r.replica_id, r.epoch, r.pgid) for r in stopped] == [("r1", 3, proc.pid)]
        assert members(proc.pid) == []  # the worker it forked as well
        assert records.all() == []
    finally:
        proc.kill()
        proc.wait()
        assert proc.stdout is not None
        proc.stdout.close()


async def test_a_group_whose_ids_now_belong_to_something_else_is_left_alone(
    tmp_path: Path,
) -> None:
    records = Records(tmp_path / "workloads")
    other = launch("r9", 1)  # not the workload the record names
    try:
        await group_of_two(other)
        records.write("r1", 3, other.pid, 8000)
        assert await stop_leftovers(records, grace_s=1.0) == []
        assert len(members(other.pid)) == 2
        assert records.all() == []  # the record is gone all the same
    finally:
        os.killpg(other.pid, signal.SIGKILL)
        other.wait()
        assert other.stdout is not None
        other.stdout.close()


async def test_an_unreadable_record_is_removed(tmp_path: Path) -> None:
    records = Records(tmp_path / "workloads")
    records.root.mkdir(parents=True)
    (records.root / "junk.json").write_text("{not json")
    assert await stop_leftovers(records) == []
    assert records.all() == []


async def test_the_first_process_dies_with_its_agent(tmp_path: Path) -> None:
    """The agent, a real process running the ProcessDriver, is SIGKILLed: the kernel kills the
    workload it launched (PR_SET_PDEATHSIG)."""
    agent = textwrap.dedent(
        f"""
        import asyncio, sys
        from pathlib import Path
        from events.cluster import ClusterSpec
        from nodeagent.workload.process import ProcessDriver

        async def main():
            driver = ProcessDriver(Path({str(tmp_path)!r}))
            sleeper = " -c 'import time; time.sleep(300)'"
            spec = ClusterSpec(name="c", command={sys.executable!r} + sleeper)
            workload = await driver.start("r1", 1, spec, [], 9)
            print("PID", workload.pid, flush=True)
            await asyncio.sleep(300)

        asyncio.run(main())
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", agent], stdout=subprocess.PIPE)  # noqa: ASYNC220
    assert proc.stdout is not None
    line = b""
    while not line.startswith(b"PID "):  # the driver logs to stdout too
        line = await asyncio.to_thread(proc.stdout.readline)
        assert line, "the agent exited"
    workload = int(line.split()[1])
    try:
        assert members(workload) == [workload]
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 10
        # Not our child: nothing announces its end but its absence.
        while members(workload) and time.monotonic() < deadline:  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        assert members(workload) == [], "the workload outlived its agent"
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()
        if members(workload):
            os.killpg(workload, signal.SIGKILL)
