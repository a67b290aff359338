from __future__ import annotations

import io
import json
import logging

import structlog

from gpumesh.logconfig import configure_logging


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_json_lines_when_not_a_terminal_with_bound_context() -> None:
    out = io.StringIO()
    configure_logging(stream=out)
    with structlog.contextvars.bound_contextvars(node="gpu-1", cluster="llama"):
        structlog.get_logger("test").info("node_suspected", missed=2)
    record = json.loads(out.getvalue().strip().splitlines()[-1])
    assert record["event"] == "node_suspected"
    assert record["node"] == "gpu-1"
    assert record["cluster"] == "llama"
    assert record["missed"] == 2
    assert record["level"] == "info"
    assert "timestamp" in record


def test_readable_console_on_a_terminal() -> None:
    out = _Tty()
    configure_logging(stream=out)
    structlog.get_logger("test").warning("disk_low", free_mib=12)
    line = out.getvalue()
    assert "disk_low" in line and "free_mib" in line
    assert not line.lstrip().startswith("{")


def test_stdlib_loggers_share_the_format() -> None:
    out = io.StringIO()
    configure_logging(stream=out, json=True)
    logging.getLogger("nats.aio.client").warning("reconnecting to %s", "nats://127.0.0.1:4222")
    record = json.loads(out.getvalue().strip().splitlines()[-1])
    assert record["event"] == "reconnecting to nats://127.0.0.1:4222"
    assert record["logger"] == "nats.aio.client"


def test_level_filters() -> None:
    out = io.StringIO()
    configure_logging(stream=out, json=True, level="warning")
    structlog.get_logger("test").info("chatty")
    structlog.get_logger("test").error("important")
    text = out.getvalue()
    assert "chatty" not in text and "important" in text
