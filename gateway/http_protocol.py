"""The gateway's HTTP connections: what a request that is not HTTP at all gets back.

aiohttp answers a request it cannot parse (a bad method, a bad Content-Length, a lying chunk
size, a header line over 8 KiB) before any application code runs: in plain text, several lines
with a caret under the offending byte, and it logs a traceback for each at ERROR. A client of an
OpenAI-compatible endpoint expects `{"error": {...}}`, and a stream of garbage from the internet
must not become a stream of tracebacks. `GatewayRunner` is `web.AppRunner` with connections
that answer such requests with the gateway's JSON error shape, on one line, and log one line.
"""

from __future__ import annotations

from http import HTTPStatus

import structlog
from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from .proxy import openai_error

log = structlog.get_logger("gpumesh.gateway.http")

_CODES = {400: "bad_request", 504: "timeout"}
_MESSAGE_CHARS = 300


def one_line(message: str | None, status: int) -> str:
    """aiohttp's parser message, without its caret drawing: `Invalid method encountered:
    b'G\\x00T / HTTP/1.1'` (the offending bytes are already escaped by repr)."""
    lines = [line.strip() for line in (message or "").splitlines()]
    text = " ".join(line for line in lines if line and set(line) != {"^"})
    return text[:_MESSAGE_CHARS] or HTTPStatus(status).phrase


class _JsonErrorHandler(RequestHandler):
    __slots__ = ()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if request.writer.output_size > 0 or (status >= 500 and exc is not None):
            # Half an answer sent (aiohttp raises to drop the connection), or a bug in a
            # handler: keep aiohttp's traceback, which is what a bug needs.
            return super().handle_error(request, status, exc, message)
        text = one_line(message, status) if status < 500 else HTTPStatus(status).phrase
        log.info("bad_http_request", status=status, error=text, client=request.remote)
        code = _CODES.get(status, "bad_request" if status < 500 else "internal")
        answer = openai_error(status, text, code)
        answer.force_close()  # the parser lost its place in the stream: nothing after is trusted
        return answer


class _JsonErrorServer(web.Server):
    def __call__(self) -> RequestHandler:
        return _JsonErrorHandler(self, loop=self._loop, **self._kwargs)


class GatewayRunner(web.AppRunner):
    """`web.AppRunner` whose connections answer unparseable requests in JSON (see above)."""

    __slots__ = ()

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # The app's own server, with every setting aiohttp gave it; only which handler class a
        # new connection gets differs, and aiohttp offers no argument for that.
        server.__class__ = _JsonErrorServer
        return server
