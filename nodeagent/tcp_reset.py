"""Closing a TCP connection with a reset (RST) instead of an orderly end of file (FIN).

A tunnel that loses a byte of what it carries must not let the reader take the end of the
connection for the end of the data: an engine that frames its messages by the connection's
end would read a truncated message as a whole one. SO_LINGER with a zero timeout makes close()
send RST, which the reader sees as ECONNRESET.

Its own module, imported only when a real socket is reset: the simulator, which runs the
agent's code, never opens one, and this is the only part of the stage link that needs the
socket module (tests/test_architecture.py keeps the modules the simulator runs free of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket  # noqa: TID251 -- a real adapter: nothing here runs in the simulator
import struct
from typing import Final

_LINGER_ZERO: Final = struct.pack("ii", 1, 0)


def reset(transport: asyncio.WriteTransport) -> None:
    """Abort `transport`, with RST when it is a TCP socket (else as abort() does)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_ZERO)
    transport.abort()
