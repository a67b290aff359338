"""Runs one process that `gpumesh chaos` started again, for as long as the stack it joined lives.

    python -m gpumesh.keeper OWNER_PID OWNER_START -- gpumesh agent --node-id node-1 ...

An agent killed by `gpumesh chaos` (a power loss) is started again by chaos, not by the process
that started it first (`gpumesh up`, a test harness), which therefore cannot stop it. The keeper
closes that gap: it detaches (forks, so chaos does not keep it as a child), runs the command as its
own child in the same process group, forwards SIGTERM/SIGINT to it, and when OWNER_PID is gone
(its start time, field 22 of /proc/PID/stat, tells a reused pid apart) it stops the command the
way `gpumesh up` stops its agents: SIGTERM, then SIGKILL after GRACE_S. OWNER_PID 0: no owner,
the command runs until it exits. Only the standard library is imported: it starts fast.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from types import FrameType

GRACE_S = 15.0  # like `gpumesh up`'s stop: the agent stops its workloads in this time
POLL_S = 0.5


def start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (clock ticks after boot), "" when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return ""
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[:1] == [b"Z"]:
        return ""
    return fields[19].decode()


def main(argv: Sequence[str]) -> int:
    if len(argv) < 4 or argv[2] != "--":
        print(
            "usage: python -m gpumesh.keeper OWNER_PID OWNER_START -- COMMAND...", file=sys.stderr
        )
        return 2
    owner, owner_start, command = int(argv[0]), argv[1], list(argv[3:])
    if os.fork():  # the caller reaps this one at once; the keeper lives on, reparented
        os._exit(0)
    child = subprocess.Popen(command, stdin=subprocess.DEVNULL)

    def forward(signum: int, frame: FrameType | None) -> None:
        child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if owner and start_time(owner) != owner_start:
            break
    child.terminate()
    try:
        return child.wait(timeout=GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
