"""Errors of wire/: reaching NATS, a workload over HTTP/1.1, or a running stack."""

from __future__ import annotations


class WireError(Exception):
    """Root of what wire/ raises."""


class CommandFailed(WireError):
    """A one-line, user-facing failure; the CLI prints it and exits non-zero."""
