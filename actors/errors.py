"""The root of what the controller raises; each error keeps `reason`, the one line a reply, a
log or the CLI prints."""

from __future__ import annotations


class ControllerError(Exception):
    """Root of what actors/ raises."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)
