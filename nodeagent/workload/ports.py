"""Picking a free TCP port for a workload that did not ask for one."""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port the OS considers free right now. Another process may take it before the workload
    binds it; the readiness probe then fails and the replica restarts, on the same port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port
