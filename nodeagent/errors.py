"""The root of what the node agent raises; each error keeps `reason`, the one line its log, its
heartbeat or the CLI carries."""

from __future__ import annotations


class AgentError(Exception):
    """Root of what nodeagent/ raises."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)
