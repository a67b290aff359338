"""The access log's fast JSON path writes the line structlog's JSON renderer would, in batches."""

from __future__ import annotations

import asyncio
import io
import json
import re

import structlog

from gateway.access_log import JsonAccessLog, StructlogAccessLog, access_log_for
from gpumesh.logconfig import configure_logging

FIELDS = {
    "request_id": "gw-1-a",
    "method": "POST",
    "path": "/v1/chat/completions",
    "cluster": "echo",
    "replica": "echo-1",
    "status": 200,
    "attempts": 1,
    "duration_ms": 2.23,
}


async def test_the_line_is_structlog_s_json_line_key_for_key() -> None:
    text = io.StringIO()
    configure_logging(level="info", json=True, stream=text)
    try:
        StructlogAccessLog(structlog.get_logger("gpumesh.gateway").bind(gateway="gw-1")).request(
            FIELDS
        )
    finally:
        configure_logging(level="warning", json=False)
    reference = json.loads(text.getvalue().splitlines()[-1])

    out = io.BytesIO()
    fast = JsonAccessLog(out, {"gateway": "gw-1"})
    fast.request(FIELDS)
    fast.flush()
    line = json.loads(out.getvalue())
    assert list(line) == list(reference)
    assert {k: v for k, v in line.items() if k != "timestamp"} == {
        k: v for k, v in reference.items() if k != "timestamp"
    }
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", line["timestamp"])
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", reference["timestamp"])


async def test_lines_go_out_in_batches_within_a_tenth_of_a_second() -> None:
    out = io.BytesIO()
    log = JsonAccessLog(out, {"gateway": "gw-1"})
    for _ in range(3):
        log.request(FIELDS)
    assert out.getvalue() == b""  # held, for one write
    await asyncio.sleep(0.15)
    assert len(out.getvalue().splitlines()) == 3
    for _ in range(2000):  # past 64 KiB: written at once
        log.request(FIELDS)
    assert len(out.getvalue().splitlines()) > 1000
    log.flush()
    assert len(out.getvalue().splitlines()) == 2003


def test_json_output_takes_the_fast_path_and_a_terminal_or_warning_level_does_not() -> None:
    log = structlog.get_logger("gpumesh.gateway")
    assert isinstance(access_log_for("json", "info", log, {}), JsonAccessLog)
    assert isinstance(access_log_for("console", "info", log, {}), StructlogAccessLog)
    assert isinstance(access_log_for("json", "warning", log, {}), StructlogAccessLog)
