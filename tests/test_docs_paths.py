"""Every source path the docs name exists: a moved or renamed module must take its docs along."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
PATH = re.compile(r"(?<![\w./-])((?:[a-z_]+/)+[a-z_]+\.(?:py|toml|sh))\b")


def named_paths(text: str) -> set[str]:
    return {match for match in PATH.findall(text) if not match.startswith(("tmp/", "usr/"))}


def test_every_path_the_docs_name_exists() -> None:
    missing = [
        f"{doc.relative_to(ROOT)}: {path}"
        for doc in DOCS
        for path in sorted(named_paths(doc.read_text()))
        if not (ROOT / path).exists()
    ]
    assert missing == []


def test_the_pattern_finds_paths_and_only_paths() -> None:
    text = "see `gateway/proxy.py`, sim/scenarios/fleet-100.toml and actors/gone.py; not a.b.py"
    assert named_paths(text) == {"gateway/proxy.py", "actors/gone.py"}
