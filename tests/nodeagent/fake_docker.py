"""A stand-in for the docker CLI, for DockerDriver's tests on machines without an engine.

It understands the commands DockerDriver issues (info, image inspect, pull, rm, run, wait,
logs, stop, kill, and ps with one label filter) for one container, "c1", which is the echo
workload run directly on the published host port. State lives in $FAKE_DOCKER_STATE: run.json
(the run argv), c1.pid, c1.exit once it ended, images.txt (the images pulled) and pulls.txt.
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
WITH_VALUE = {"--name", "--label", "--gpus", "-p", "-e", "--ipc", "--shm-size", "-v", "--pull"}
IMAGES = STATE / "images.txt"  # the images "on the node", one a line
PULLS = STATE / "pulls.txt"  # each `docker pull`, one a line


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


def images() -> list[str]:
    return IMAGES.read_text().split() if IMAGES.exists() else []


def inspect(image: str) -> int:
    if image in images():
        print("sha256:" + "0" * 64)
        return 0
    print(f"Error: No such image: {image}", file=sys.stderr)
    return 1


def pull(image: str) -> int:
    """Two layers, as docker writes them when its output is not a terminal; an image whose name
    has `no-such` in it is refused as a registry refuses an unknown repository."""
    with PULLS.open("a") as f:
        f.write(image + "\n")
    if "no-such" in image:
        print(
            f"Error response from daemon: pull access denied for {image}, repository does not "
            "exist or may require 'docker login'",
            file=sys.stderr,
        )
        return 1
    for line in (
        "Using default tag: latest", "a1b2: Pulling fs layer", "c3d4: Pulling fs layer",
        "c3d4: Already exists", "a1b2: Downloading", "a1b2: Download complete",
        "a1b2: Pull complete", f"Status: Downloaded newer image for {image}", image,
    ):  # fmt: skip
        print(line, flush=True)
    with IMAGES.open("a") as f:
        f.write(image + "\n")
    return 0


def main() -> int:
    command, *args = sys.argv[1:]
    if command == "info":
        print("28.2.2")
    elif command == "image" and args[:1] == ["inspect"]:
        return inspect(args[-1])
    elif command == "image" and args[:1] == ["ls"]:
        print("\n".join([*images(), "<none>:<none>"]))
    elif command == "pull":
        return pull(args[-1])
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
