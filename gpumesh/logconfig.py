"""structlog, configured once at the entry point.

JSON lines when stderr is not a terminal (production, CI, log shippers); a readable console
format when it is. nats-py's and aiohttp's stdlib loggers go through the same processors.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, TextIO

import structlog
from structlog.typing import Processor


def configure_logging(
    *,
    level: str = "info",
    json: bool | None = None,
    stream: TextIO | None = None,
    timestamper: Processor | None = None,
) -> None:
    """Configure structlog and stdlib logging. `json=None` picks JSON unless `stream` is a TTY.

    The simulator passes its own `timestamper` so log lines carry virtual time.
    """
    out = stream if stream is not None else sys.stderr
    use_json = json if json is not None else not out.isatty()
    stamp = timestamper or structlog.processors.TimeStamper(fmt="iso", utc=True)
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        stamp,
        structlog.processors.StackInfoRenderer(),
    ]
    renderer: Processor
    if use_json:
        shared.append(structlog.processors.format_exc_info)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=out.isatty())
    numeric = logging.getLevelNamesMapping().get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[*shared, structlog.stdlib.ProcessorFormatter.wrap_for_formatter],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=shared,
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    asyncio_log = logging.getLogger("asyncio")
    if not any(isinstance(f, _SslEofNoise) for f in asyncio_log.filters):
        asyncio_log.addFilter(_SslEofNoise())


class _SslEofNoise(logging.Filter):
    """nats-py's protocol answers True to eof_received(), which asyncio's TLS transport ignores
    and warns about on every closed TLS connection to NATS: harmless, and it would drown the
    warnings that matter."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "eof_received() has no effect when using ssl" not in record.getMessage()


def get_logger(name: str = "gpumesh", **context: Any) -> Any:
    return structlog.get_logger(name).bind(**context)
