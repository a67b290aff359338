"""The gateway's HTTP surface, fed malformed requests over a raw socket, with auth off and on:
every one gets an answer within a bounded time, never an internal error, and every error the
gateway itself gives is JSON with a one-line message; a well-formed request is served after."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings, strategies as st

from gateway.auth import KeyRing
from tests.security.rig import error_message, memory_gateway, status_of
from tests.security.test_decoders_fuzz import payloads

KEYS = {"admin_keys": ["adm-key"], "tenants": {"t": {"keys": ["t-key"], "rate_per_s": 0}}}
METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD", "G\x00T", "POST /x"]
PATHS = [
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/embeddings",
    "/v1/models",
    "/c/llama/v1/chat/completions",
    "/c/nope/x",
    "/c/../../etc/passwd",
    "/api/v1/clusters",
    "/api/v1/events/stream?after=-1",
    "/metrics",
    "/healthz",
    "/readyz",
    "/%00%ff",
    "*",
]
HEADERS = [
    ("Content-Type", "application/json"),
    ("Content-Length", "-1"),
    ("Content-Length", "99999999999999999999"),
    ("Content-Length", "abc"),
    ("Transfer-Encoding", "chunked"),
    ("Transfer-Encoding", "gzip, chunked"),
    ("Authorization", "Bearer " + "k" * 500),
    ("Authorization", "Basic \x00\x01"),
    ("Authorization", "Bearer t-key"),
    ("Authorization", "Bearer adm-key"),
    ("X-Request-Id", "\u2603" * 10),
    ("Host", ""),
    ("Expect", "100-continue"),
]
requests = st.builds(
    lambda method, path, headers, body, chunked: (method, path, headers, body, chunked),
    st.sampled_from(METHODS) | st.text(min_size=1, max_size=8),
    st.sampled_from(PATHS) | st.text(min_size=1, max_size=30).map(lambda p: "/" + p),
    st.lists(st.sampled_from(HEADERS), max_size=4),
    payloads,
    st.booleans(),
)


def _raw(method: str, path: str, headers: list[tuple[str, str]], body: bytes, chunk: bool) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: 127.0.0.1"]
    lines += [f"{name}: {value}" for name, value in headers]
    names = {name.lower() for name, _ in headers}
    if chunk and "transfer-encoding" not in names:
        lines.append("Transfer-Encoding: chunked")
        body = f"{len(body) + 3:x}\r\n".encode() + body + b"\r\nzz\r\n"  # a lying chunk size
    elif "content-length" not in names and "transfer-encoding" not in names:
        lines.append(f"Content-Length: {len(body)}")
    lines.append("Connection: close")
    return "\r\n".join(lines).encode("utf-8", "surrogateescape") + b"\r\n\r\n" + body


@settings(max_examples=30)
@given(st.lists(requests, min_size=1, max_size=6), st.booleans())
def test_malformed_requests_get_answers_not_internal_errors(
    batch: list[tuple[str, str, list[tuple[str, str]], bytes, bool]], auth: bool
) -> None:
    async def main() -> None:
        keys = KeyRing.from_mapping(KEYS) if auth else None
        # A request that waits for more body is answered by the body timeout (2 s here).
        limits = {"header_timeout_s": 2.0, "request_body_timeout_s": 2.0}
        async with memory_gateway(keys, **limits) as rig:
            for method, path, headers, body, chunk in batch:
                answer = await rig.exchange(_raw(method, path, headers, body, chunk))
                status = status_of(answer)
                assert status and status != 500, answer[:300]
                # The upstream's own answers pass through as they are; HEAD answers have no body.
                came_from_upstream = b"\r\nX-Upstream:" in answer.partition(b"\r\n\r\n")[0]
                if status >= 400 and not came_from_upstream and method != "HEAD":
                    error_message(answer)
            good = _raw("GET", "/v1/models", [("Authorization", "Bearer t-key")], b"", False)
            assert status_of(await rig.exchange(good)) == 200

    asyncio.run(main())
