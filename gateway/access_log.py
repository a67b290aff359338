"""The access log: one line per routed request.

Through structlog's stdlib chain (processors, a LogRecord, a formatter, a handler's lock, a
write per line) a line cost the gateway 138 µs, more than the request it describes
(docs/performance.md, Gateway). In production the log is JSON lines, so `JsonAccessLog`
writes the very line structlog would, key for key, encoded by msgspec into a buffer that goes
out every 100 ms or 64 KiB in one write. A terminal (the console format) gets structlog's
readable line, as before.
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import sys
from typing import Any, BinaryIO, Protocol

import msgspec

LOGGER = "gpumesh.gateway"
_FLUSH_AFTER_S = 0.1
_FLUSH_BYTES = 64 * 1024


class AccessLog(Protocol):
    def request(self, fields: dict[str, Any]) -> None: ...

    def flush(self) -> None: ...


class StructlogAccessLog:
    """Each line through structlog, formatted like every other log line."""

    def __init__(self, log: Any) -> None:
        self._log = log

    def request(self, fields: dict[str, Any]) -> None:
        self._log.info("request", **fields)

    def flush(self) -> None:
        pass


class JsonAccessLog:
    """JSON lines, in the shape structlog's JSON renderer gives them, written in batches."""

    def __init__(self, stream: BinaryIO, context: dict[str, Any]) -> None:
        self._stream = stream
        self._context = context
        self._encoder = msgspec.json.Encoder()
        self._buffer = bytearray()
        self._timer: asyncio.TimerHandle | None = None

    def request(self, fields: dict[str, Any]) -> None:
        now = datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds")
        line = {
            **self._context,
            **fields,
            "event": "request",
            "level": "info",
            "logger": LOGGER,
            "timestamp": now[:-6] + "Z",  # structlog's TimeStamper(fmt="iso", utc=True)
        }
        self._encoder.encode_into(line, self._buffer, -1)
        self._buffer += b"\n"
        if len(self._buffer) >= _FLUSH_BYTES:
            self.flush()
        elif self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(_FLUSH_AFTER_S, self.flush)

    def flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._buffer:
            try:
                self._stream.write(self._buffer)
                self._stream.flush()
            except OSError:
                pass  # a full disk or a closed pipe must not take requests down with it
            self._buffer.clear()


def access_log_for(log_format: str, log_level: str, log: Any, context: dict[str, Any]) -> AccessLog:
    """What `gpumesh gateway` and `gpumesh up` log requests with, from their log flags: the rule
    gpumesh/logconfig.py applies (JSON unless stderr is a terminal), for stderr."""
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    level = logging.getLevelNamesMapping().get(log_level.upper(), logging.INFO)
    if use_json and level <= logging.INFO:
        return JsonAccessLog(sys.stderr.buffer, context)
    return StructlogAccessLog(log)
