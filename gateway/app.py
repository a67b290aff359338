"""The gateway's aiohttp application: which URL goes where, and who may call it.

/v1/chat/completions, /v1/completions, /v1/embeddings   routed by `model` (gateway/proxy.py)
/v1/models                                             the clusters, as models
/c/<cluster>/<path>                                    any other HTTP API of a cluster
/api/v1/...                                            the control API, admin keys by scope
/ui/...                                                the dashboard (gateway/ui), admin keys
/metrics, /healthz, /readyz                            for Prometheus and orchestrators
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry

from runtime.env import Bus

from .auth import KeyRing
from .control_routes import control_app
from .metrics import CONTENT_TYPE, render
from .proxy import OPENAI_PATHS, Proxy, openai_error
from .ui import mount as mount_ui

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    proxy: Proxy,
    bus: Bus,
    keys: KeyRing,
    registry: CollectorRegistry,
    *,
    ready: Callable[[], bool],
    max_body_bytes: int,
    request_body_timeout_s: float = 30.0,
) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_errors(max_body_bytes)])
    for path in OPENAI_PATHS:
        app.router.add_post(path, proxy.openai)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_route("*", "/c/{cluster}/{tail:.*}", proxy.passthrough)
    app.router.add_route("*", "/c/{cluster}", proxy.passthrough)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=render(registry), headers={"Content-Type": CONTENT_TYPE})

    async def healthz(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok"})

    async def readyz(request: web.Request) -> web.Response:
        if ready():
            return web.json_response({"status": "ready"})
        return web.json_response({"status": "waiting for the routing table"}, status=503)

    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)

    # Longer than the controller's own 30 s wait on create/scale/drain, so that a slow success
    # is not reported as a 504.
    control = control_app(bus, timeout=35.0, body_timeout=request_body_timeout_s, keys=keys)
    app.add_subapp("/api/v1", control)
    mount_ui(app, bus, keys, registry=registry)
    return app


def _errors(max_body_bytes: int) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
        # A declared length over the limit is refused before a byte of the body is read:
        # otherwise the client would wait, sending, for a 413 (or a 408) it was sure to get.
        length = request.content_length
        if length is not None and length > max_body_bytes:
            return _too_large(max_body_bytes)
        try:
            return await handler(request)
        except web.HTTPRequestEntityTooLarge:
            return _too_large(max_body_bytes)
        except web.HTTPException as exc:
            # aiohttp's own 404 and 405 are plain text; every answer here is OpenAI's shape.
            if exc.status < 400:
                raise
            allow = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else {}
            return openai_error(
                exc.status,
                _reason(request, exc),
                _CODES.get(exc.status, "invalid_request"),
                **allow,
            )

    return errors


_CODES = {404: "not_found", 405: "method_not_allowed"}


def _reason(request: web.Request, exc: web.HTTPException) -> str:
    if exc.status == 404:
        return f"no route for {request.path[:200]!r} (see /v1/models, /c/<cluster>/..., /api/v1)"
    if exc.status == 405:
        return (
            f"{request.method[:20]} is not allowed here (allowed: {exc.headers.get('Allow', '')})"
        )
    return exc.reason


def _too_large(limit: int) -> web.Response:
    return openai_error(413, f"the request body is over the {limit}-byte limit", "too_large")
