"""Skip marks for the tests that serve a real model: they need the optional packages (the
`[demo]` extra and SmolLM2's weights), which .ci/run installs; without them they skip, naming
the command that installs what is missing."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from nodeagent.workload.extras import EMBEDDINGS_RUNTIME, LLM_RUNTIME, SMOLLM2_WEIGHTS, missing


def _skip_unless(*needs: object) -> pytest.MarkDecorator:
    lacking = missing(*needs)  # type: ignore[arg-type]
    reason = "; ".join(f"{n.what} is not installed: `{n.install}`" for n in lacking)
    return pytest.mark.skipif(bool(lacking), reason=reason or "installed")


needs_smollm2 = _skip_unless(LLM_RUNTIME, SMOLLM2_WEIGHTS)
needs_embeddings = _skip_unless(EMBEDDINGS_RUNTIME)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def spawn_workload(kind: str, port: int, log: Path, *extra: str) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", f"nodeagent.workload.{kind}", "--port", str(port), *extra],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def health(port: int) -> int:
    """/health's status; 0 when nothing listens."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
            return int(r.status)
    except urllib.error.HTTPError as exc:
        exc.close()  # it holds the response's socket: unclosed, a ResourceWarning at GC
        return exc.code
    except OSError:
        return 0


def wait_healthy(port: int, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> float:
    """Seconds until /health answered 200."""
    started = time.monotonic()
    while health(port) != 200:
        assert proc.poll() is None, f"the workload exited {proc.returncode}"
        assert time.monotonic() - started < timeout, "not healthy in time"
        time.sleep(0.05)
    return time.monotonic() - started


def stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)
