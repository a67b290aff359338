"""The tokens an answer used: its reported usage, else an estimate."""

from __future__ import annotations

import msgspec
from hypothesis import given, strategies as st

from gateway.usage import BYTES_PER_TOKEN, StreamUsage, body_tokens


def sse(payload: object) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def test_a_json_answer_counts_its_usage_total_or_its_parts() -> None:
    assert body_tokens(b'{"choices": [], "usage": {"total_tokens": 42}}') == 42
    assert body_tokens(b'{"usage": {"prompt_tokens": 5, "completion_tokens": 7}}') == 12
    assert body_tokens(b'{"data": [], "usage": null}') == len(b'{"data": [], "usage": null}') // 4
    assert body_tokens(b"x" * 40) == 40 // BYTES_PER_TOKEN  # no usage, not even JSON


def test_a_stream_counts_its_usage_chunk_else_one_token_per_event() -> None:
    chunks = [sse({"choices": [{"delta": {"content": w}}]}) for w in ("a", "b", "c")]
    plain = StreamUsage(event_stream=True)
    for chunk in [*chunks, b"data: [DONE]\n\n"]:
        plain.feed(chunk)
    assert plain.tokens == 3
    usage = StreamUsage(event_stream=True)
    for chunk in [
        *chunks,
        sse({"choices": [], "usage": {"total_tokens": 19}}),
        b"data: [DONE]\n\n",
    ]:
        usage.feed(chunk)
    assert usage.tokens == 19


@given(st.lists(st.integers(min_value=1, max_value=30), min_size=1, max_size=20))
def test_chunk_boundaries_anywhere_give_the_same_count(cuts: list[int]) -> None:
    body = b"".join(
        [sse({"choices": [{"delta": {"content": "w"}}]}) for _ in range(5)]
        + [sse({"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 5}})]
        + [b"data: [DONE]\n\n"]
    )
    usage = StreamUsage(event_stream=True)
    at = 0
    for cut in cuts:
        usage.feed(body[at : at + cut])
        at += cut
    usage.feed(body[at:])
    assert (usage.tokens, usage.events) == (8, 6)


def test_a_body_that_is_not_an_event_stream_is_estimated_from_its_size() -> None:
    usage = StreamUsage(event_stream=False)
    usage.feed(b"x" * 100)
    usage.feed(b'data: {"usage": {"total_tokens": 1}}\n')
    assert usage.tokens == (100 + 38) // BYTES_PER_TOKEN
