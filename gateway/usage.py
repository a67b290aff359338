"""The tokens an answer used, for a tenant's token budget (gateway/auth.py TenantQuota).

What a workload reports is what counts: `usage` in a JSON answer (chat, completions,
embeddings), or in an event stream's last data event (OpenAI's `stream_options:
{"include_usage": true}`; llama.cpp and vLLM send it when asked), `total_tokens`, else
prompt plus completion. An answer that reports none is estimated: an event stream at one token
per data event (what a streaming server sends per token; the prompt goes uncounted), any other
body at one token per BYTES_PER_TOKEN bytes. Only tenants with a budget pay for the look:
their streams are passed on chunk by chunk through `StreamUsage.feed` instead of the
zero-copy relay.
"""

from __future__ import annotations

from typing import Final

import msgspec

BYTES_PER_TOKEN: Final = 4  # English text, roughly: the usual rule of thumb
_LINE_LIMIT: Final = 1 << 20  # a data line longer than this is not read for its usage


class _Counts(msgspec.Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _WithUsage(msgspec.Struct):
    usage: _Counts | None = None


_decoder = msgspec.json.Decoder(_WithUsage)


def _reported(payload: bytes) -> int | None:
    try:
        usage = _decoder.decode(payload).usage
    except msgspec.DecodeError:
        return None
    if usage is None:
        return None
    return max(0, usage.total_tokens or usage.prompt_tokens + usage.completion_tokens)


def body_tokens(body: bytes) -> int:
    """The tokens a whole (non-streamed) answer used: its `usage`, else estimated."""
    reported = _reported(body) if b'"usage"' in body else None
    return reported if reported is not None else len(body) // BYTES_PER_TOKEN


class StreamUsage:
    """Fed an answer's chunks as they pass (`feed`); `tokens` once it has ended."""

    __slots__ = ("_event_stream", "_partial", "bytes", "events", "reported")

    def __init__(self, *, event_stream: bool) -> None:
        self._event_stream = event_stream
        self._partial = b""
        self.bytes = 0
        self.events = 0  # data events other than [DONE]
        self.reported: int | None = None  # the last usage a data event carried

    def feed(self, chunk: bytes) -> None:
        self.bytes += len(chunk)
        if not self._event_stream:
            return
        data = self._partial + chunk if self._partial else chunk
        lines = data.split(b"\n")
        partial = lines.pop()
        self._partial = partial if len(partial) <= _LINE_LIMIT else b""
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if not payload or payload == b"[DONE]":
                continue
            self.events += 1
            if b'"usage"' in payload:
                reported = _reported(payload)
                if reported is not None:
                    self.reported = reported

    @property
    def tokens(self) -> int:
        if self.reported is not None:
            return self.reported
        return self.events if self._event_stream else self.bytes // BYTES_PER_TOKEN
