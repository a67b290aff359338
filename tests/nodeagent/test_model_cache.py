"""A node's model cache: what the agent lists for placement, and its registration again when
the listing changes."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeagent import model_cache
from nodeagent.config import AgentConfig
from nodeagent.model_cache import cached_models
from sim import run_simulation

from .harness import NODE, Harness, wait_until


def test_hub_repos_files_and_directories_are_listed_by_the_names_a_spec_gives(
    tmp_path: Path,
) -> None:
    (tmp_path / "models--meta-llama--Llama-3.1-8B-Instruct" / "snapshots").mkdir(parents=True)
    (tmp_path / "hub" / "models--Qwen--Qwen2.5-7B-Instruct").mkdir(parents=True)
    (tmp_path / "Llama-3.2-3B-Instruct-Q4_K_M.gguf").write_bytes(b"GGUF")
    (tmp_path / "my-finetune").mkdir()
    (tmp_path / ".locks").mkdir()
    assert cached_models(str(tmp_path)) == (
        "Llama-3.2-3B-Instruct-Q4_K_M.gguf",
        "Qwen/Qwen2.5-7B-Instruct",
        "meta-llama/Llama-3.1-8B-Instruct",
        "my-finetune",
    )


def test_no_cache_or_an_unreadable_one_lists_nothing(tmp_path: Path) -> None:
    assert cached_models("") == ()
    assert cached_models(str(tmp_path / "not-there")) == ()


def test_the_listing_is_capped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(model_cache, "MAX_LISTED", 3)
    for i in range(5):
        (tmp_path / f"m{i}.gguf").write_bytes(b"")
    assert cached_models(str(tmp_path)) == ("m0.gguf", "m1.gguf", "m2.gguf")


def test_the_agent_registers_its_cache_and_again_when_a_model_arrives(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("nodeagent.agent.CACHE_SCAN_S", 5.0)
    (tmp_path / "a.gguf").write_bytes(b"")

    async def scenario() -> None:
        h = Harness(config=AgentConfig(node_id=NODE, model_cache=str(tmp_path)))

        async def listing(cache: str) -> tuple[str, ...]:
            return cached_models(cache)  # inline: the simulator has no threads

        h.agent._list_cache = listing
        async with h.running():
            await wait_until(lambda: len(h.registrations) == 1)
            first = h.registrations[0][1]
            assert first.model_cache == str(tmp_path)
            assert first.cached_models == ("a.gguf",)
            (tmp_path / "models--org--new").mkdir()
            await wait_until(lambda: len(h.registrations) == 2)
            assert h.registrations[1][1].cached_models == ("a.gguf", "org/new")

    run_simulation(scenario())
