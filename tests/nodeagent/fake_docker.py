"""A stand-in for the docker CLI, for DockerDriver's tests on machines without an engine.

It understands the commands DockerDriver issues (info, rm, run, wait, logs, stop, kill, and ps
with one label filter) for one container, "c1", which is the echo workload run directly on the
published host port. State lives in $FAKE_DOCKER_STATE: run.json (the run argv), c1.pid, and
c1.exit once it ended.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ["FAKE_DOCKER_STATE"])
EXIT = STATE / "c1.exit"
WITH_VALUE = {"--name", "--label", "--gpus", "-p", "-e"}


def running_pid() -> int:
    return int((STATE / "c1.pid").read_text())


def wait_for_exit() -> str:
    while not EXIT.exists():
        time.sleep(0.02)
    return EXIT.read_text()


def alive(pid: int) -> bool:
    """A zombie (killed, not yet reaped by init) counts as ended."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def end(sig: signal.Signals, code: str) -> None:
    pid = running_pid()
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
    while alive(pid):
        time.sleep(0.02)
    if not EXIT.exists():
        EXIT.write_text(code)


def run(args: list[str]) -> None:
    (STATE / "run.json").write_text(json.dumps(args))
    i, published = 0, ""
    while args[i].startswith("-"):
        if args[i] == "-p":
            published = args[i + 1]
        i += 2 if args[i] in WITH_VALUE else 1
    host_port = published.split(":")[1]
    echo = [sys.executable, "-m", "nodeagent.workload.echo", "--port", host_port]
    proc = subprocess.Popen(
        echo, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    (STATE / "c1.pid").write_text(str(proc.pid))
    print("c1")


def running() -> bool:
    return (STATE / "c1.pid").exists() and not EXIT.exists() and alive(running_pid())


def ps(args: list[str]) -> None:
    """`ps -aq --filter label=K=V`: c1 if it runs and its run carried that label."""
    wanted = args[args.index("--filter") + 1].removeprefix("label=")
    run_args = json.loads((STATE / "run.json").read_text()) if running() else []
    labels = [run_args[i + 1] for i, a in enumerate(run_args[:-1]) if a == "--label"]
    if wanted in labels:
        print("c1")


def main() -> int:
    command, *args = sys.argv[1:]
    if command == "info":
        print("28.2.2")
    elif command == "run":
        run(args)
    elif command == "wait":
        print(wait_for_exit())
    elif command == "logs":
        print("fake container log line", flush=True)
        wait_for_exit()
    elif command == "stop":
        end(signal.SIGTERM, "0")  # echo exits cleanly on SIGTERM
    elif command == "kill":
        end(signal.SIGKILL, "137")
    elif command == "ps":
        ps(args)
    elif command == "rm" and args[-1] == "c1" and running():
        end(signal.SIGKILL, "137")
    return 0  # rm of nothing running, and anything else: nothing to do


if __name__ == "__main__":
    sys.exit(main())
