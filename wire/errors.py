"""The root of what wire/ raises: reaching NATS, a workload over HTTP/1.1, or a running stack.

Each error keeps `reason`, the one line a log or the CLI prints; subclasses add what a caller
may act on (an address, a deadline). The subclasses live beside the code that raises them.
"""

from __future__ import annotations


class WireError(Exception):
    """Root of what wire/ raises."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class CommandFailed(WireError):
    """A one-line, user-facing failure; the CLI prints it and exits non-zero."""
