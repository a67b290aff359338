"""A `gpumesh gateway` process in front of a tests/integration/stack.py Stack, for benches that
kill and restart it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
from typing import Any

from tests.integration.gateway_kit import free_port


class GatewayProcess:
    def __init__(self, stack: Any, *extra: str, name: str = "gateway") -> None:
        self.stack = stack
        self.extra = extra
        self.name = name  # its log file, <name>.log, and its gateway id
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None and self.proc.poll() is None else None

    def start(self) -> None:
        log = (self.stack.logs / f"{self.name}.log").open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gpumesh", "gateway", "--nats", self.stack.url,
             "--listen", f"127.0.0.1:{self.port}", "--log-format", "json",
             "--gateway-id", self.name, "--data-dir", str(self.stack.root), *self.extra],
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        log.close()

    async def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            await asyncio.to_thread(self.proc.wait, 10)
