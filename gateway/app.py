"""The gateway's aiohttp application: which URL goes where, and who may call it.

/v1/chat/completions, /v1/completions, /v1/embeddings   routed by `model` (gateway/proxy.py)
/v1/models                                             the clusters, as models
/c/<cluster>/<path>                                    any other HTTP API of a cluster
/api/v1/...                                            the control API, admin key only
/metrics, /healthz, /readyz                            for Prometheus and orchestrators
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from actors.env import Bus

from .auth import KeyRing
from .control_routes import control_app
from .metrics import CONTENT_TYPE, Registry
from .proxy import Proxy, openai_error

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def build_app(
    proxy: Proxy,
    bus: Bus,
    keys: KeyRing,
    registry: Registry,
    *,
    ready: Callable[[], bool],
    max_body_bytes: int,
) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[_too_large])
    app.router.add_post("/v1/chat/completions", proxy.openai)
    app.router.add_post("/v1/completions", proxy.openai)
    app.router.add_post("/v1/embeddings", proxy.openai)
    app.router.add_get("/v1/models", proxy.models)
    app.router.add_route("*", "/c/{cluster}/{tail:.*}", proxy.passthrough)
    app.router.add_route("*", "/c/{cluster}", proxy.passthrough)

    async def metrics(request: web.Request) -> web.Response:
        return web.Response(body=registry.render(), headers={"Content-Type": CONTENT_TYPE})

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
    control = control_app(bus, timeout=35.0)
    control.middlewares.append(_admin_only(keys))
    app.add_subapp("/api/v1", control)
    return app


@web.middleware
async def _too_large(request: web.Request, handler: Handler) -> web.StreamResponse:
    # aiohttp answers an oversized body with a plain-text 413; clients expect OpenAI's shape.
    try:
        return await handler(request)
    except web.HTTPRequestEntityTooLarge as exc:
        return openai_error(413, f"the body is larger than {exc.text or 'the limit'}", "too_large")


def _admin_only(keys: KeyRing) -> Callable[..., Awaitable[web.StreamResponse]]:
    @web.middleware
    async def admin(request: web.Request, handler: Handler) -> web.StreamResponse:
        if not keys.is_admin(request.headers.get("Authorization")):
            return openai_error(
                401 if keys.enabled else 403,
                "the control API needs an admin key (Authorization: Bearer <admin key>)",
                "admin_key_required",
            )
        return await handler(request)

    return admin
