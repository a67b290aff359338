"""The echo workload: OpenAI-compatible answers, SSE streaming, pacing and request ids."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from nodeagent.workload import echo

PROMPT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture
async def server() -> AsyncIterator[echo.EchoServer]:
    srv = await echo.start(0, model="echo-1")
    try:
        yield srv
    finally:
        await srv.close()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


async def sse_events(response: aiohttp.ClientResponse) -> list[Any]:
    """Every `data:` payload, JSON-decoded, with the final `[DONE]` kept as a string."""
    assert response.headers["Content-Type"].startswith("text/event-stream")
    events: list[Any] = []
    async for raw in response.content:
        line = raw.decode().strip()
        if not line:
            continue
        assert line.startswith("data: ")
        data = line.removeprefix("data: ")
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


async def test_health_and_models(server: echo.EchoServer, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{server.url}/health") as response:
        assert response.status == 200
    async with http.get(f"{server.url}/v1/models") as response:
        body = await response.json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["echo-1"]


async def test_chat_completion_echoes_the_last_user_message(
    server: echo.EchoServer, http: aiohttp.ClientSession
) -> None:
    request = {
        "model": "echo-1",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": PROMPT},
        ],
    }
    async with http.post(f"{server.url}/v1/chat/completions", json=request) as response:
        assert response.status == 200
        body = await response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == "echo-1"
    (choice,) = body["choices"]
    assert choice["message"] == {"role": "assistant", "content": PROMPT}
    assert choice["finish_reason"] == "stop"
    assert body["usage"] == {"prompt_tokens": 9, "completion_tokens": 9, "total_tokens": 18}


async def test_max_tokens_caps_the_answer(
    server: echo.EchoServer, http: aiohttp.ClientSession
) -> None:
    request = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": 3}
    async with http.post(f"{server.url}/v1/chat/completions", json=request) as response:
        body = await response.json()
    assert body["choices"][0]["message"]["content"] == "the quick brown"
    assert body["choices"][0]["finish_reason"] == "length"


async def test_completion_defaults_to_sixteen_tokens_like_openai(
    server: echo.EchoServer, http: aiohttp.ClientSession
) -> None:
    words = [f"w{i}" for i in range(20)]
    async with http.post(
        f"{server.url}/v1/completions", json={"prompt": " ".join(words)}
    ) as response:
        body = await response.json()
    assert body["object"] == "text_completion"
    assert body["choices"][0]["text"] == " ".join(words[:16])
    assert body["choices"][0]["finish_reason"] == "length"


async def test_chat_streams_openai_chunks_ending_with_done(
    server: echo.EchoServer, http: aiohttp.ClientSession
) -> None:
    request = {
        "messages": [{"role": "user", "content": PROMPT}],
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with http.post(f"{server.url}/v1/chat/completions", json=request) as response:
        assert response.status == 200
        events = await sse_events(response)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == PROMPT
    finish = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finish] == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 9


async def test_completions_stream_is_deterministic(
    server: echo.EchoServer, http: aiohttp.ClientSession
) -> None:
    async def once() -> list[str]:
        request = {"prompt": PROMPT, "stream": True, "max_tokens": 4}
        async with http.post(f"{server.url}/v1/completions", json=request) as response:
            events = await sse_events(response)
        assert events[-1] == "[DONE]"
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        return [e["choices"][0]["text"] for e in events[:-1]]

    first = await once()
    assert first == ["the", " quick", " brown", " fox", ""]
    assert await once() == first


async def test_an_empty_prompt_still_streams_a_well_formed_answer(
    server: echo.EchoServer, http: aiohttp.ClientSession
) -> None:
    request = {"messages": [{"role": "user", "content": ""}], "stream": True}
    async with http.post(f"{server.url}/v1/chat/completions", json=request) as response:
        events = await sse_events(response)
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert events[-1] == "[DONE]"


async def test_x_request_id_is_echoed_on_plain_and_streamed_answers(
    server: echo.EchoServer, http: aiohttp.ClientSession
) -> None:
    headers = {"X-Request-Id": "req-42"}
    request = {"messages": [{"role": "user", "content": "hi"}]}
    url = f"{server.url}/v1/chat/completions"
    async with http.post(url, json=request, headers=headers) as response:
        assert response.headers["X-Request-Id"] == "req-42"
        assert (await response.json())["id"] == "chatcmpl-req-42"
    async with http.post(url, json={**request, "stream": True}, headers=headers) as response:
        assert response.headers["X-Request-Id"] == "req-42"
        await sse_events(response)
    async with http.get(f"{server.url}/health", headers=headers) as response:
        assert response.headers["X-Request-Id"] == "req-42"
    async with http.get(f"{server.url}/health") as response:
        assert "X-Request-Id" not in response.headers


@pytest.mark.parametrize(
    ("path", "body", "status", "code"),
    [
        ("/v1/chat/completions", b"{not json", 400, "invalid_request"),
        ("/v1/chat/completions", b"[1, 2]", 400, "invalid_request"),
        ("/v1/chat/completions", b'{"messages": []}', 400, "invalid_request"),
        ("/v1/chat/completions", b'{"model": "gpt-4", "messages": [{}]}', 404, "model_not_found"),
        ("/v1/completions", b'{"prompt": "x", "max_tokens": -1}', 400, "invalid_request"),
        ("/v1/completions", b'{"prompt": {"a": 1}}', 400, "invalid_request"),
    ],
)
async def test_bad_requests_get_openai_style_errors(
    server: echo.EchoServer,
    http: aiohttp.ClientSession,
    path: str,
    body: bytes,
    status: int,
    code: str,
) -> None:
    async with http.post(f"{server.url}{path}", data=body) as response:
        assert response.status == status
        error = (await response.json())["error"]
    assert error["code"] == code
    assert error["message"]


async def test_time_to_first_token_and_token_rate_are_honoured(
    http: aiohttp.ClientSession,
) -> None:
    srv = await echo.start(0, ttft_ms=200, tokens_per_s=50)
    try:
        loop = asyncio.get_running_loop()
        request = {"prompt": "a b c d e f", "stream": True}
        began = loop.time()
        first_token_at = None
        async with http.post(f"{srv.url}/v1/completions", json=request) as response:
            async for raw in response.content:
                if raw.startswith(b"data: {") and first_token_at is None:
                    first_token_at = loop.time()
        ended = loop.time()
        assert first_token_at is not None
        assert first_token_at - began >= 0.18
        assert ended - first_token_at >= 5 / 50 * 0.9  # five more tokens at 50 per second
        # Non-streaming answers take as long as the stream would.
        began = loop.time()
        async with http.post(f"{srv.url}/v1/completions", json={"prompt": "a b c"}) as r:
            assert (await r.json())["choices"][0]["text"] == "a b c"
        assert loop.time() - began >= 0.18 + 2 / 50 * 0.9
    finally:
        await srv.close()
