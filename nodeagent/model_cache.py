"""What a node's model cache holds, as the controller's placement reads it.

An operator names the node's cache directory (`gpumesh agent --model-cache DIR`); the agent
lists it at registration and again whenever the listing changes (checked every
CACHE_SCAN_S), and the controller prefers, among nodes otherwise equal up to the region rule,
one that holds a spec's `model_files` (actors/scheduler.py, docs/workloads.md).

Names, so that a spec can say what its engine will load:
- a Hugging Face hub cache (HF_HOME, or HF_HOME/hub): `models--ORG--NAME` is `ORG/NAME`;
- anything else directly in the directory is its own name: `Llama-3.2-3B-Q4_K_M.gguf`, a
  directory of weights.
Hidden entries are skipped. At most MAX_LISTED names are reported (sorted), so a huge cache
cannot make a registration too big to send.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Final

CACHE_SCAN_S: Final = 30.0
MAX_LISTED: Final = 256
_HUB_PREFIX: Final = "models--"


def _entries(directory: Path) -> list[str]:
    try:
        return [e.name for e in os.scandir(directory) if not e.name.startswith(".")]
    except OSError:
        return []


def cached_models(cache: str) -> tuple[str, ...]:
    """The names of what `cache` holds (module docstring); () when it cannot be read."""
    if not cache:
        return ()
    root = Path(cache)
    names: set[str] = set()
    for directory in (root, root / "hub"):
        for name in _entries(directory):
            if name.startswith(_HUB_PREFIX):
                org_and_name = name.removeprefix(_HUB_PREFIX).split("--", 1)
                names.add("/".join(org_and_name))
            elif directory == root and name != "hub":
                names.add(name)
    return tuple(sorted(names)[:MAX_LISTED])
