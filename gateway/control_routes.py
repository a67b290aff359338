"""The control REST API, `/api/v1`: the CLI's verbs over HTTP, served through the control API.

    app.add_subapp("/api/v1", control_app(bus))

Every route is a client of the controller's request/reply API (`gpumesh.v1.api.<verb>`,
docs/subjects.md "Control API") through the Bus protocol, so the gateway holds no fleet state of
its own and works with any controller that answers on NATS.

    POST   /clusters              cluster.create   body: a ClusterSpec mapping     -> 201
    GET    /clusters              cluster.list                                     -> 200
    GET    /clusters/{name}       cluster.get                                      -> 200
    PUT    /clusters/{name}       cluster.apply    body: a ClusterSpec mapping     -> 200 (201: new)
    PATCH  /clusters/{name}       cluster.scale    body: {"replicas": N}           -> 200
    GET    /clusters/{name}/history  cluster.history                               -> 200
    POST   /clusters/{name}/rollback cluster.rollback body: {"to": REV} (optional) -> 200
    POST   /clusters/{name}/canary   cluster.canary   body: {"spec": S, "weight": W} -> 200
    POST   /clusters/{name}/promote  cluster.promote  body: {"reason": R} (optional) -> 200
    POST   /clusters/{name}/abort    cluster.abort    body: {"reason": R} (optional) -> 200
    DELETE /clusters/{name}       cluster.delete                                   -> 200
    GET    /nodes                 node.list                                        -> 200
    POST   /nodes/{id}/drain      node.drain                                       -> 200
    POST   /nodes/{id}/undrain    node.undrain     (409 if it is not drained)      -> 200
    DELETE /nodes/{id}            node.remove      (409 unless it is offline)      -> 200
    POST   /nodes/{id}/cordon     node.cordon      body: {"until": T, "reason": R} -> 200
    POST   /nodes/{id}/uncordon   node.uncordon    (409 if it is not cordoned)     -> 200
    GET    /events                events.list      ?after=&limit=&heartbeats=0|1   -> 200
    GET    /events/stream         Server-Sent Events: the log from `after`, then live

The stream sends `id: <position>`, `event: <type tag>`, `data: <Envelope JSON>` per event, in
position order, each once; heartbeats only with `heartbeats=1`, and then each node's latest at
most every `heartbeat_interval` seconds (HEARTBEAT_FLUSH_S): a heartbeat that a newer one of its
node replaced in the meantime is left out, and the held ones go out before any other event, so
ids only increase; `: keep-alive` after `keepalive` seconds of silence. `Last-Event-ID` (a
reconnect) wins over `after`; with neither it starts at the log's head. An error after the
response began is one `event: error` frame, then the end.

Errors are `{"error": {"message": "<one line>", "type": "<kind>", "field": "<where>"}}`, `field`
only when one input is to blame: a JSON path (`$.replicas`) for a body, the parameter's name
(`after`) for a query parameter or header. Status codes:

    400 invalid_request          the body or a query value is malformed, or the controller
                                 refused it (a spec problem: `replicas: must be 0..1000 ...`)
    404 not_found                an unknown cluster or node, or no such route
    405 method_not_allowed
    408 request_timeout          the body did not arrive within `body_timeout` (slow client)
    409 conflict                 the controller says it already exists, or the node or
                                 cluster is not in the state the verb needs (undrain,
                                 remove, uncordon; a second canary, promote or abort with
                                 none, delete while a canary runs)
    502 bad_reply                the controller's reply could not be decoded
    503 controller_unavailable   no controller subscribed (NoResponders; with Retry-After: 2),
                                 or the bus failed
    504 controller_timeout       the controller did not answer within `timeout`
    500 internal                 a bug here; logged, never a traceback to the client
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import math
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Final, TypeVar

import msgspec
import structlog
from aiohttp import web

from events.catalog import HEARTBEAT_TYPE
from events.contract import subjects
from events.contract.messages import ApiReply, parse_until
from events.contract.subjects import POSITION_HEADER
from runtime.env import Bus, BusError, Msg, NoResponders, RequestTimeout, Subscription
from runtime.real_env import LoopClock

from .auth import KeyRing, Need

log = structlog.get_logger("gpumesh.gateway.control")

RETRY_AFTER_S: Final = 2
MAX_EVENTS_LIMIT: Final = 1000  # the controller's bound on events.list `limit`
STREAM_PAGE: Final = 500  # events per events.list call while a stream catches up
# A stream with heartbeats=1 sends each node's latest heartbeat at most this often (seconds):
# a page shows a node's readings, not each heartbeat, and a hundred frames in one write cost
# the gateway and the page much less than a hundred writes (docs/performance.md, dashboard).
HEARTBEAT_FLUSH_S: Final = 1.0
LIVE_HELD_LIMIT: Final = 65_536  # live messages a stream holds untaken before it drops them

_JSON: Final = "application/json"
# What the controller says when a node is not in the state a verb needs (actors/control_api.py,
# actors/node_actor.py NotRemovable).
_B = TypeVar("_B", bound=msgspec.Struct)  # a request body

_STATE_CONFLICTS: Final = ("node ",)
# ... and when a cluster's canary is not in the state a verb needs (cluster.canary with one
# running, or its cluster's name taken; cluster.promote and cluster.abort with none; delete
# while one runs).
_CANARY_CONFLICTS: Final = ("has a canary", "has no canary", "exists already")
_STATUS_TYPES: Final = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
DEFAULT_BODY_TIMEOUT_S: Final = 30.0
# "gpu.count: must be 1..16" -> "gpu.count"; "unknown cluster 'x' (known: a)" does not match.
_LEADING_FIELD = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z0-9_]+|\[\d+\])*): ")
_AT_PATH = re.compile(r" - at `(\$[^`]*)`$")
_NAMED_FIELD = re.compile(r"(?:missing required|contains unknown) field `([^`]+)`")


# -- request and reply shapes -------------------------------------------------------------


class ScaleBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`PATCH /clusters/{name}`."""

    replicas: int


class RollbackBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /clusters/{name}/rollback`; an empty body rolls back to the previous revision."""

    to: Annotated[int, msgspec.Meta(ge=0)] = 0


class CanaryBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /clusters/{name}/canary`: the spec the canary serves (a ClusterSpec mapping; its
    `name`, if given, the path's) and its percent of the cluster's requests. The controller
    judges both (a weight outside 1..99 is its one-line 400)."""

    spec: dict[str, Any]
    weight: int = 10


class CanaryEndBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /clusters/{name}/promote` and `.../abort`; an empty body gives no reason."""

    reason: str = ""


class CordonBody(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`POST /nodes/{id}/cordon`; an empty body cordons until uncordoned. `until`: an ISO 8601
    time with Z or an offset, or a duration from now (`30m`, `2h`)."""

    until: str = ""
    reason: str = ""


class EventsQuery(msgspec.Struct, frozen=True):
    """`GET /events` and `GET /events/stream` query parameters (strings, converted)."""

    after: Annotated[int, msgspec.Meta(ge=0)] = 0
    limit: Annotated[int, msgspec.Meta(ge=1, le=MAX_EVENTS_LIMIT)] = 500
    heartbeats: bool = False


class EventHead(msgspec.Struct, frozen=True):
    """The two fields of an envelope the stream needs; the rest is passed on untouched."""

    position: int
    type: str


class EventsPage(msgspec.Struct, frozen=True):
    """`events.list` data, each envelope kept as the controller encoded it."""

    events: list[msgspec.Raw]
    next: int
    head: int


class _EventsReply(msgspec.Struct, frozen=True, kw_only=True):
    """An ApiReply whose data is an EventsPage (the `type` tag is ignored)."""

    ok: bool
    error: str = ""
    data: EventsPage | None = None


_head_decoder = msgspec.json.Decoder(EventHead)


# -- errors --------------------------------------------------------------------------------


class ControlError(Exception):
    """Becomes the JSON error response; raised by the helpers, caught by the middleware."""

    def __init__(
        self,
        status: int,
        kind: str,
        message: str,
        *,
        field: str = "",
        headers: dict[str, str] | None = None,
        close: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.message = " ".join(message.split())  # one line, whatever the source said
        self.field = field
        self.headers = headers or {}
        self.close = close  # the connection is spent (a body half read): close after answering

    def body(self) -> dict[str, Any]:
        error: dict[str, str] = {"message": self.message, "type": self.kind}
        if self.field:
            error["field"] = self.field
        return {"error": error}

    def response(self) -> web.Response:
        answer = web.Response(
            status=self.status,
            body=msgspec.json.encode(self.body()),
            content_type=_JSON,
            headers=self.headers,
        )
        if self.close:
            answer.force_close()
        return answer


def invalid(message: str, field: str = "") -> ControlError:
    return ControlError(400, "invalid_request", message, field=field)


def body_field(message: str) -> str:
    """The JSON path a one-line error blames, or '': `replicas: must be ...` -> `$.replicas`,
    `... - at `$.gpu.count`` -> `$.gpu.count`, `Object missing required field `x`` -> `$.x`."""
    if at := _AT_PATH.search(message):
        return at.group(1)
    if named := _NAMED_FIELD.search(message):
        return f"$.{named.group(1)}"
    if lead := _LEADING_FIELD.match(message):
        return f"$.{lead.group(1)}"
    return ""


def validation_error(exc: msgspec.ValidationError, *, query: bool = False) -> ControlError:
    """msgspec's reason, led by the field: `replicas: Expected `int`, got `str``."""
    text = str(exc)
    field = body_field(text)
    reason = _AT_PATH.sub("", text)
    if not field:
        return invalid(f"body: {reason}")
    name = field.removeprefix("$.")
    return invalid(f"{name}: {reason}", name if query else field)


def refused(error: str) -> ControlError:
    """An ApiReply with ok=false, as the status it deserves."""
    if error.startswith(("unknown cluster", "unknown node")):
        return ControlError(404, "not_found", error)
    if (
        "already exists" in error
        or error.startswith(_STATE_CONFLICTS)
        or any(conflict in error for conflict in _CANARY_CONFLICTS)
    ):
        return ControlError(409, "conflict", error)
    return invalid(error, body_field(error))


def unreachable(exc: BusError) -> ControlError:
    if isinstance(exc, NoResponders):
        return ControlError(
            503,
            "controller_unavailable",
            f"controller not reachable (no responder on {exc.subject})",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, RequestTimeout):
        return ControlError(
            504,
            "controller_timeout",
            f"controller did not answer on {exc.subject} within {exc.timeout:g} s",
        )
    return ControlError(
        503,
        "controller_unavailable",
        f"controller not reachable: {exc}",
        headers={"Retry-After": str(RETRY_AFTER_S)},
    )


@web.middleware
async def json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Every failure as the JSON error shape: ours, aiohttp's (404, 405, 413) and bugs."""
    try:
        return await handler(request)
    except ControlError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        kind = _STATUS_TYPES.get(exc.status, "invalid_request" if exc.status < 500 else "internal")
        error = ControlError(exc.status, kind, exc.reason)
        error.headers = {k: v for k, v in exc.headers.items() if k == "Allow"}
        return error.response()
    except Exception:
        log.exception("control_api_bug", method=request.method, path=request.path)
        return ControlError(500, "internal", "internal error (logged by the gateway)").response()


# -- who may call what -----------------------------------------------------------------------

ROUTE_NEEDS: Final[dict[tuple[str, str], Need]] = {
    ("GET", "/clusters"): "read",
    ("GET", "/clusters/{name}"): "read",
    ("GET", "/clusters/{name}/history"): "read",
    ("GET", "/nodes"): "read",
    ("GET", "/events"): "read",
    ("GET", "/events/stream"): "read",
    ("PUT", "/clusters/{name}"): "cluster",
    ("PATCH", "/clusters/{name}"): "cluster",
    ("POST", "/clusters/{name}/rollback"): "cluster",
    ("POST", "/clusters/{name}/canary"): "cluster",
    ("POST", "/clusters/{name}/promote"): "cluster",
    ("POST", "/clusters/{name}/abort"): "cluster",
    ("DELETE", "/clusters/{name}"): "cluster",
    ("POST", "/clusters"): "all",
    ("POST", "/nodes/{node_id}/drain"): "all",
    ("POST", "/nodes/{node_id}/undrain"): "all",
    ("DELETE", "/nodes/{node_id}"): "all",
    ("POST", "/nodes/{node_id}/cordon"): "all",
    ("POST", "/nodes/{node_id}/uncordon"): "all",
}
"""What each route needs of an admin key's scope (gateway/auth.py AdminScope.allows): `read`
for any admin key, `cluster` for one that may change the cluster in the path, `all` for one
that may do everything. HEAD is GET."""


def route_need(method: str, path: str) -> Need | None:
    """The need of a route (`method`, its path pattern under /api/v1); None for no route."""
    return ROUTE_NEEDS.get(("GET" if method == "HEAD" else method, path))


def authorize(
    keys: KeyRing, needs: dict[web.AbstractRoute, Need | None]
) -> Callable[..., Awaitable[web.StreamResponse]]:
    """The middleware: 401 without an admin key, 403 with one whose scope does not allow the
    route, in the JSON error shape, before anything of the request is read or asked. `needs`:
    each route's need (filled by control_app once its routes are in); an unknown route (a 404
    or 405 to come) needs an admin key of any scope."""

    @web.middleware
    async def check(request: web.Request, handler: Handler) -> web.StreamResponse:
        header = request.headers.get("Authorization")
        need = needs.get(request.match_info.route)
        cluster = request.match_info.get("name", "") if need == "cluster" else ""
        access = keys.access(header, need, cluster)
        if access == "no_key":
            raise ControlError(401, "admin_key_required", _no_key_message(keys), headers=_CHALLENGE)
        if access == "forbidden":
            raise ControlError(403, "forbidden", _forbidden_message(keys, header, need, cluster))
        return await handler(request)

    return check


_CHALLENGE: Final = {"WWW-Authenticate": "Bearer"}


def _no_key_message(keys: KeyRing) -> str:
    if not keys.has_admin_keys:
        where = f" ({keys.path} has none)" if keys.path else ""
        return (
            f"the control API is closed: this gateway has no admin key{where}; give it a key "
            "file with admin keys (--keys FILE), or --insecure-api for a local stack"
        )
    return "the control API needs an admin key (Authorization: Bearer <admin key>)"


def _forbidden_message(keys: KeyRing, header: str | None, need: Need | None, cluster: str) -> str:
    scope = keys.admin(header)
    assert scope is not None
    if scope.scope == "read":
        allowed = "only reads (GET)"
    else:
        allowed = f"reads, and changes to clusters {', '.join(sorted(scope.clusters))}"
    wanted = f"changes to cluster {cluster!r}" if need == "cluster" else "every verb"
    return (
        f"this admin key ({scope.name}, scope {scope.scope}) allows {allowed}; this needs {wanted}"
    )


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# -- the app ---------------------------------------------------------------------------------


def control_app(
    bus: Bus,
    *,
    timeout: float = 10.0,
    events_poll: float = 5.0,
    keepalive: float = 15.0,
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S,
    keys: KeyRing | None = None,
    heartbeat_interval: float = HEARTBEAT_FLUSH_S,
) -> web.Application:
    """The `/api/v1` sub-application. `keys`: who may call which route (ROUTE_NEEDS); None:
    no check here (the caller has made its own). `timeout`: seconds to wait for each
    controller reply.
    `body_timeout`: seconds a client has to deliver a whole request body (then 408).
    `events_poll`: while the live events subject is quiet for this long, a stream asks
    `events.list` whether it missed anything (a live message lost in a reconnect, or no outbox
    running); also the retry delay when the controller does not answer a stream's catch-up.
    `keepalive`: seconds of silence before a stream sends a `: keep-alive` comment.
    `heartbeat_interval`: a stream with heartbeats sends them at most this often, each node's
    latest."""
    api = _ControlApi(
        bus,
        timeout=timeout,
        events_poll=events_poll,
        keepalive=keepalive,
        body_timeout=body_timeout,
        heartbeat_interval=heartbeat_interval,
    )
    app = web.Application(middlewares=[json_errors])
    needs: dict[web.AbstractRoute, Need | None] = {}
    if keys is not None:
        app.middlewares.append(authorize(keys, needs))
    app.router.add_post("/clusters", api.create_cluster, name="clusters")
    app.router.add_get("/clusters", api.list_clusters)
    app.router.add_get("/clusters/{name}", api.get_cluster, name="cluster")
    app.router.add_put("/clusters/{name}", api.apply_cluster)
    app.router.add_patch("/clusters/{name}", api.scale_cluster)
    app.router.add_get("/clusters/{name}/history", api.cluster_history)
    app.router.add_post("/clusters/{name}/rollback", api.rollback_cluster)
    app.router.add_post("/clusters/{name}/canary", api.canary_cluster)
    app.router.add_post("/clusters/{name}/promote", api.promote_canary)
    app.router.add_post("/clusters/{name}/abort", api.abort_canary)
    app.router.add_delete("/clusters/{name}", api.delete_cluster)
    app.router.add_get("/nodes", api.list_nodes)
    app.router.add_post("/nodes/{node_id}/drain", api.drain_node)
    app.router.add_post("/nodes/{node_id}/undrain", api.undrain_node)
    app.router.add_delete("/nodes/{node_id}", api.remove_node)
    app.router.add_post("/nodes/{node_id}/cordon", api.cordon_node)
    app.router.add_post("/nodes/{node_id}/uncordon", api.uncordon_node)
    app.router.add_get("/events", api.list_events)
    app.router.add_get("/events/stream", api.stream_events)
    for route in app.router.routes():  # before add_subapp prefixes their paths
        needs[route] = route_need(route.method, route.resource.canonical if route.resource else "")
    return app


def _ok(data: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(
        status=status, body=msgspec.json.encode(data), content_type=_JSON, headers=headers
    )


async def read_body(request: web.Request, limit: float) -> bytes:
    """The whole body, or a 408 once `limit` seconds passed: a body trickled in a byte at a
    time (slow loris) would otherwise hold a connection and a handler forever."""
    try:
        async with asyncio.timeout(limit):
            return await request.read()
    except TimeoutError:
        raise ControlError(
            408,
            "request_timeout",
            f"the request body did not arrive within {limit:g} s",
            close=True,
        ) from None


def _json_object(raw: bytes) -> bytes:
    """The raw body, once it is known to be one JSON object."""
    try:
        msgspec.json.decode(raw, type=dict[str, Any])
    except msgspec.ValidationError as exc:  # before DecodeError: it is one
        raise invalid(f"body: {exc}", "$") from None
    except msgspec.DecodeError as exc:
        raise invalid(f"body: not valid JSON ({exc})", "$") from None
    return raw


def events_query(request: web.Request) -> EventsQuery:
    try:
        return msgspec.convert(dict(request.query), EventsQuery, strict=False)
    except msgspec.ValidationError as exc:
        raise validation_error(exc, query=True) from None


def last_event_id(request: web.Request) -> int | None:
    raw = request.headers.get("Last-Event-ID")
    if raw is None or not raw.strip():
        return None
    try:
        value = int(raw.strip())
    except ValueError:
        value = -1
    if value < 0:
        raise invalid(f"Last-Event-ID: must be an event position, got {raw!r}", "Last-Event-ID")
    return value


class _ControlApi:
    def __init__(
        self,
        bus: Bus,
        *,
        timeout: float,
        events_poll: float,
        keepalive: float,
        body_timeout: float,
        heartbeat_interval: float,
    ) -> None:
        self.bus = bus
        self.timeout = timeout
        self.body_timeout = body_timeout
        self.events_poll = events_poll
        self.keepalive = keepalive
        self.heartbeat_interval = heartbeat_interval
        self._takes_handler: bool | None = None

    async def _request(self, verb: str, body: bytes) -> bytes:
        try:
            msg = await self.bus.request(subjects.api(verb), body, timeout=self.timeout)
        except BusError as exc:
            raise unreachable(exc) from None
        return msg.data

    async def _body(self, request: web.Request, kind: type[_B], *, empty: bytes = b"") -> _B:
        """The request's JSON body as `kind` (`empty` when it sent none): 400 naming the
        field at fault, or saying the JSON is not JSON."""
        raw = await read_body(request, self.body_timeout)
        try:
            return msgspec.json.decode(raw or empty, type=kind)
        except msgspec.ValidationError as exc:  # before DecodeError: it is one
            raise validation_error(exc) from None
        except msgspec.DecodeError as exc:
            raise invalid(f"body: not valid JSON ({exc})", "$") from None

    async def call(self, verb: str, body: object = None) -> Any:
        """The verb's `data`, or the ControlError its failure maps to."""
        raw = await self._request(verb, body if isinstance(body, bytes) else _encode(body))
        try:
            reply = msgspec.json.decode(raw, type=ApiReply)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ControlError(502, "bad_reply", f"unreadable reply to {verb}: {exc}") from None
        if not reply.ok:
            raise refused(reply.error)
        return reply.data

    async def events(self, after: int, limit: int, heartbeats: bool) -> EventsPage:
        request = {"after": after, "limit": limit, "heartbeats": heartbeats}
        raw = await self._request("events.list", msgspec.json.encode(request))
        try:
            reply = msgspec.json.decode(raw, type=_EventsReply)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise ControlError(
                502, "bad_reply", f"unreadable reply to events.list: {exc}"
            ) from None
        if not reply.ok or reply.data is None:
            raise refused(reply.error or "events.list answered no data")
        return reply.data

    # -- clusters and nodes -------------------------------------------------------------

    async def create_cluster(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.body_timeout)
        cluster = await self.call("cluster.create", _json_object(raw))
        headers = {}
        if isinstance(cluster, dict) and isinstance(cluster.get("name"), str):
            url = request.app.router["cluster"].url_for(name=cluster["name"])
            headers["Location"] = str(url)
        return _ok(cluster, 201, headers)

    async def list_clusters(self, request: web.Request) -> web.Response:
        return _ok(await self.call("cluster.list", {}))

    async def get_cluster(self, request: web.Request) -> web.Response:
        return _ok(await self.call("cluster.get", {"name": request.match_info["name"]}))

    async def scale_cluster(self, request: web.Request) -> web.Response:
        body = await self._body(request, ScaleBody)
        name = request.match_info["name"]
        return _ok(await self.call("cluster.scale", {"name": name, "replicas": body.replicas}))

    async def apply_cluster(self, request: web.Request) -> web.Response:
        raw = await read_body(request, self.body_timeout)
        name = request.match_info["name"]
        try:
            body = msgspec.json.decode(raw, type=dict[str, Any])
        except msgspec.ValidationError as exc:  # before DecodeError: it is one
            raise invalid(f"body: {exc}", "$") from None
        except msgspec.DecodeError as exc:
            raise invalid(f"body: not valid JSON ({exc})", "$") from None
        named = body.setdefault("name", name)
        if named != name:
            raise invalid(f"name: the body names {named!r}, the path {name!r}", "$.name")
        cluster = await self.call("cluster.apply", body)
        created = isinstance(cluster, dict) and cluster.get("revision") == 1 and cluster["changed"]
        return _ok(cluster, 201 if created else 200)

    async def cluster_history(self, request: web.Request) -> web.Response:
        return _ok(await self.call("cluster.history", {"name": request.match_info["name"]}))

    async def rollback_cluster(self, request: web.Request) -> web.Response:
        body = await self._body(request, RollbackBody, empty=b"{}")
        request_body = {"name": request.match_info["name"], "to": body.to}
        try:
            return _ok(await self.call("cluster.rollback", request_body))
        except ControlError as exc:
            if exc.status == 400 and not exc.field:
                exc.field = "$.to"  # an unknown revision, or the current one
            raise

    async def canary_cluster(self, request: web.Request) -> web.Response:
        body = await self._body(request, CanaryBody)
        request_body = {
            "name": request.match_info["name"],
            "spec": body.spec,
            "weight": body.weight,
        }
        try:
            return _ok(await self.call("cluster.canary", request_body))
        except ControlError as exc:
            # The controller names a spec's fields from the spec (`gpu.count: ...`); in this
            # body they are under `spec`.
            if exc.field and exc.field != "$.weight" and not exc.field.startswith("$.spec"):
                exc.field = "$.spec" + exc.field.removeprefix("$")
            raise

    async def promote_canary(self, request: web.Request) -> web.Response:
        return await self._end_canary(request, "cluster.promote")

    async def abort_canary(self, request: web.Request) -> web.Response:
        return await self._end_canary(request, "cluster.abort")

    async def _end_canary(self, request: web.Request, verb: str) -> web.Response:
        body = await self._body(request, CanaryEndBody, empty=b"{}")
        request_body = {"name": request.match_info["name"], "reason": body.reason}
        return _ok(await self.call(verb, request_body))

    async def delete_cluster(self, request: web.Request) -> web.Response:
        return _ok(await self.call("cluster.delete", {"name": request.match_info["name"]}))

    async def list_nodes(self, request: web.Request) -> web.Response:
        return _ok(await self.call("node.list", {}))

    async def drain_node(self, request: web.Request) -> web.Response:
        return _ok(await self.call("node.drain", {"node_id": request.match_info["node_id"]}))

    async def undrain_node(self, request: web.Request) -> web.Response:
        return _ok(await self.call("node.undrain", {"node_id": request.match_info["node_id"]}))

    async def remove_node(self, request: web.Request) -> web.Response:
        return _ok(await self.call("node.remove", {"node_id": request.match_info["node_id"]}))

    async def cordon_node(self, request: web.Request) -> web.Response:
        body = await self._body(request, CordonBody, empty=b"{}")
        until_ns = 0
        if body.until:
            try:
                # A duration counts from the gateway's wall clock; whether the end is still to
                # come is the controller's to judge, on its own.
                until_ns = parse_until(body.until, LoopClock().wall_ns())
            except ValueError as exc:
                raise invalid(str(exc), "$.until") from None
        request_body = {
            "node_id": request.match_info["node_id"],
            "until_ns": until_ns,
            "reason": body.reason,
        }
        return _ok(await self.call("node.cordon", request_body))

    async def uncordon_node(self, request: web.Request) -> web.Response:
        return _ok(await self.call("node.uncordon", {"node_id": request.match_info["node_id"]}))

    # -- events ---------------------------------------------------------------------------

    async def list_events(self, request: web.Request) -> web.Response:
        query = events_query(request)
        page = await self.events(query.after, query.limit, query.heartbeats)
        return _ok({"events": page.events, "next": page.next, "head": page.head})

    async def stream_events(self, request: web.Request) -> web.StreamResponse:
        """Server-Sent Events from `after` (or Last-Event-ID; without either, from the log's
        head: only what is committed from now on), then live, gapless and without duplicates.

        The live subject is subscribed to first and held while the log is paged through
        `events.list`; live events at or below what was sent are then skipped. A live event
        that is not the next position (one lost in a reconnect, or dropped by a slow
        subscription) sends the stream back to `events.list` to fill the hole first. With
        `heartbeats=1`, heartbeats are sent as _EventStream says: each node's latest, at most
        every `heartbeat_interval` seconds.
        """
        query = events_query(request)
        resume = last_event_id(request)
        after = resume if resume is not None else query.after if "after" in request.query else None
        live = _Live()
        try:
            sub = await self._subscribe_live(live)
        except BusError as exc:
            raise unreachable(exc) from None
        stream: _EventStream | None = None
        try:
            async with live.reading(sub):
                # Asked before the response starts, so an absent controller is a plain 503.
                limit = 1 if after is None else STREAM_PAGE
                first = await self.events(after or 0, limit, query.heartbeats)
                stream = _EventStream(self, request, live, heartbeats=query.heartbeats)
                await stream.start()
                if after is None:
                    stream.cursor = first.head
                else:
                    stream.cursor = after
                    await stream.emit_page(first)
                    await stream.catch_up(target=first.head)
                await stream.follow()
        except _Gone:
            log.debug("control_stream_client_gone", path=request.path)
        except ControlError as exc:
            if stream is None:
                raise
            # The response has begun: say why in-band and end; the client resumes from its
            # Last-Event-ID.
            log.warning("control_stream_failed", error=exc.message)
            with contextlib.suppress(_Gone):
                await stream.write_error(exc)
        except Exception:
            if stream is None:
                raise
            log.exception("control_stream_bug", path=request.path)
            with contextlib.suppress(_Gone):
                await stream.write_error(ControlError(500, "internal", "internal error"))
        finally:
            with contextlib.suppress(BusError):
                await sub.unsubscribe()
        assert stream is not None  # _Gone comes only from writes, after the stream began
        return stream.response

    async def _subscribe_live(self, live: _Live) -> Subscription:
        # Through a handler, a message costs the stream no task wake-up: a heartbeat only joins
        # the held ones. A Bus that takes no handler (a test double) is iterated instead.
        if self._takes_handler is None:
            self._takes_handler = takes_handler(self.bus)
        if self._takes_handler:
            return await self.bus.subscribe(subjects.EVENTS_ALL, handler=live.receive)
        return await self.bus.subscribe(subjects.EVENTS_ALL)


def takes_handler(bus: Bus) -> bool:
    """Whether `bus.subscribe` takes the Bus protocol's `handler` argument."""
    try:
        parameters = inspect.signature(bus.subscribe).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.name == "handler" or p.kind is p.VAR_KEYWORD for p in parameters)


class _Gone(Exception):
    """The stream's client disconnected."""


class _LiveHead(msgspec.Struct, frozen=True):
    """What the stream reads of a live envelope: where it goes, whether it is a heartbeat, and
    whose (its `stream`, `heartbeat/<node_id>`); the rest is passed on untouched."""

    position: int
    type: str
    stream: str = ""


_live_head_decoder = msgspec.json.Decoder(_LiveHead)

# A live message as held for the stream: its position, its head (None: unreadable) and itself.
_Held = tuple[int, _LiveHead | None, Msg]


class _Live:
    """The live subscription's messages, held until the stream's task takes them in a batch.

    The bus hands each to `receive` (or, for a bus without handlers, one reader task does).
    While `lazy`, a heartbeat does not wake the stream's task: it waits in `held` for the
    task's next flush or check. Anything else wakes it at once, and so does the
    subscription's end. Past `limit` held messages the rest are dropped, as a slow
    subscription's are: the stream finds the hole and reads it from the log."""

    def __init__(self, limit: int = LIVE_HELD_LIMIT) -> None:
        self.limit = limit
        self.held: list[_Held] = []
        self.lazy = False
        self.ended = False
        self.failure: BaseException | None = None
        self._signalled = False
        self._waiter: asyncio.Future[None] | None = None
        self._loop = asyncio.get_running_loop()

    def receive(self, msg: Msg) -> None:
        """The subscription's handler (it must not raise)."""
        if len(self.held) >= self.limit:
            self._signal()
            return
        try:
            head: _LiveHead | None = _live_head_decoder.decode(msg.data)
        except (msgspec.DecodeError, msgspec.ValidationError):
            head = None
        position = _header_position(msg)
        if position is None:
            if head is None:
                return  # nowhere in the log: nothing to send or skip
            position = head.position
        self.held.append((position, head, msg))
        if head is None or head.type != HEARTBEAT_TYPE or not self.lazy:
            self._signal()

    def take(self) -> list[_Held]:
        held, self.held = self.held, []
        self._signalled = False
        return held

    async def wait(self, timeout: float) -> None:
        """Until a message that wakes the stream is held, the subscription ends, or `timeout`
        seconds pass."""
        if self._signalled or self.ended:
            return
        waiter = self._waiter = self._loop.create_future()
        timer = self._loop.call_later(max(timeout, 0.0), _resolve, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    def _signal(self) -> None:
        self._signalled = True
        if self._waiter is not None:
            _resolve(self._waiter)

    @contextlib.asynccontextmanager
    async def reading(self, sub: Subscription) -> AsyncIterator[_Live]:
        """Follows `sub`'s end (and, without a handler, its messages) while in the block."""
        reader = asyncio.create_task(self._read(sub), name="control-stream-live")
        try:
            yield self
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise asyncio.CancelledError()

    async def _read(self, sub: Subscription) -> None:
        try:
            async for msg in sub:  # with a handler: nothing, until the subscription ends
                self.receive(msg)
        except Exception as exc:
            self.failure = exc
        self.ended = True
        self._signal()


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class _EventStream:
    """One SSE response: `cursor` is the last log position accounted for (sent, held to be
    sent, or skipped); every event written has a position above every one written before it.

    Frames are gathered and written together: one write per page of the log, per batch of
    live messages, per release of heartbeats.

    With heartbeats, each heartbeat stream's (each node's) latest heartbeat is held, and the
    held ones are sent together, in position order, at most every `heartbeat_interval`
    seconds (at once if none were sent for that long); a heartbeat replaced by a newer one of
    its node in the meantime is never sent. Any other event is sent at once, the held
    heartbeats (all older than it) just before it: so the ids only increase, and a client
    that resumes from its Last-Event-ID is sent again from the log what was held for it."""

    def __init__(
        self, api: _ControlApi, request: web.Request, live: _Live, *, heartbeats: bool
    ) -> None:
        self.api = api
        self.request = request
        self.live = live
        self.heartbeats = heartbeats
        self.cursor = 0
        self.response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # a buffering proxy in front would stall the tail
            }
        )
        self._loop = asyncio.get_running_loop()
        self._last_write = self._loop.time()
        self._out: list[bytes] = []
        # heartbeat stream (or, lacking one, the position) -> (position, envelope), in
        # position order: a newer heartbeat of a stream is moved to the end.
        self._held: dict[str | int, tuple[int, bytes]] = {}
        self._released_at = -math.inf  # loop time heartbeats were last sent

    async def start(self) -> None:
        try:
            await self.response.prepare(self.request)
        except ConnectionResetError:
            raise _Gone() from None
        await self._write(f"retry: {RETRY_AFTER_S * 1000}\n\n".encode())

    async def write_error(self, error: ControlError) -> None:
        """An `error` event (no id: it is not a log position) before the stream ends, after
        the events gathered so far."""
        body = msgspec.json.encode(error.body())
        self._out.append(b"event: error\ndata: %s\n\n" % body)
        await self._write_out()

    async def _write(self, chunk: bytes) -> None:
        if self._gone():
            raise _Gone()
        try:
            await self.response.write(chunk)
        except ConnectionResetError:
            raise _Gone() from None
        self._last_write = self._loop.time()

    async def _write_out(self) -> None:
        if self._out:
            chunk = b"".join(self._out)
            self._out.clear()
            await self._write(chunk)

    def _gone(self) -> bool:
        transport = self.request.transport
        return transport is None or transport.is_closing()

    def send(self, position: int, type_: str, stream: str, data: bytes) -> None:
        """Gathers an event to be written (or holds it, a heartbeat), unless already past."""
        if position <= self.cursor:
            return
        self.cursor = position
        if type_ == HEARTBEAT_TYPE:
            if self.heartbeats:
                key = stream or position
                self._held.pop(key, None)
                self._held[key] = (position, data)
            return
        if self._held:
            self._release()
        self._out.append(sse_frame(position, type_, data))

    def _release(self) -> None:
        self._out.extend(_HEARTBEAT_FRAME % held for held in self._held.values())
        self._held.clear()
        self._released_at = self._loop.time()

    def _release_due(self) -> None:
        if self._held and self._loop.time() - self._released_at >= self.api.heartbeat_interval:
            self._release()

    async def emit_page(self, page: EventsPage) -> None:
        for raw in page.events:
            try:
                head = _live_head_decoder.decode(raw)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                error = f"unreadable event in events.list: {exc}"
                raise ControlError(502, "bad_reply", error) from None
            self.send(head.position, head.type, head.stream, bytes(raw))
        self.cursor = max(self.cursor, page.next)
        self._release_due()
        await self._write_out()

    async def catch_up(self, target: int | None = None) -> None:
        """Page `events.list` from the cursor until it reaches `target` (default: the head the
        first reply reports) or stops moving."""
        while target is None or self.cursor < target:
            before = self.cursor
            page = await self.api.events(before, STREAM_PAGE, self.heartbeats)
            await self.emit_page(page)
            if target is None:
                target = page.head
            if self.cursor >= target or self.cursor == before:
                return

    async def follow(self) -> None:
        """Live until the client goes (raises _Gone) or the subscription ends (returns)."""
        quiet_since = self._loop.time()
        while True:
            await self._tick()
            # Held heartbeats wait for their release anyway; without heartbeats, one only
            # moves the cursor, which can wait for the next event or check.
            self.live.lazy = not self.heartbeats or bool(self._held)
            await self.live.wait(self._wait_s())
            batch = self.live.take()
            if batch:
                quiet_since = self._loop.time()
                await self._send_live(batch)
            if self.live.failure is not None:
                raise self.live.failure
            if self.live.ended and not self.live.held:
                if self._held:
                    self._release()
                await self._write_out()
                log.info("control_stream_live_ended", path=self.request.path)
                return
            self._release_due()
            await self._write_out()
            if not batch and self._loop.time() - quiet_since >= self.api.events_poll:
                # Quiet: ask the log whether a live message went missing (or no outbox).
                quiet_since = self._loop.time()
                await self._catch_up_or_log()

    async def _send_live(self, batch: list[_Held]) -> None:
        for position, head, msg in batch:
            if position <= self.cursor:
                continue
            if position > self.cursor + 1:
                # A hole before this event: fill it from the log first, however long the
                # controller takes to answer (meanwhile live messages wait in `live`).
                while not await self._catch_up_or_log(target=position - 1):
                    await self._pause(self.api.events_poll)
            if head is None:
                log.warning("control_stream_garbage", subject=msg.subject, position=position)
                self.cursor = max(self.cursor, position)
                continue
            self.send(position, head.type, head.stream, msg.data)

    @property
    def _check(self) -> float:
        """How often a quiet stream looks at its client and its keep-alive."""
        return min(1.0, self.api.events_poll, self.api.keepalive)

    def _wait_s(self) -> float:
        if not self._held:
            return self._check
        due = self._released_at + self.api.heartbeat_interval - self._loop.time()
        return min(self._check, due)

    async def _tick(self) -> None:
        if self._gone():
            raise _Gone()
        if self._loop.time() - self._last_write >= self.api.keepalive:
            await self._write(b": keep-alive\n\n")

    async def _pause(self, seconds: float) -> None:
        until = self._loop.time() + seconds
        while (left := until - self._loop.time()) > 0:
            await asyncio.sleep(min(left, self._check))
            await self._tick()

    async def _catch_up_or_log(self, target: int | None = None) -> bool:
        """False when the controller is unreachable (try again later); other errors end the
        stream."""
        try:
            await self.catch_up(target)
        except ControlError as exc:
            if exc.status not in (503, 504):
                raise
            log.warning("control_stream_catch_up_failed", cursor=self.cursor, error=exc.message)
            return False
        return True


def _header_position(msg: Msg) -> int | None:
    header = (msg.headers or {}).get(POSITION_HEADER)
    if header is not None:
        with contextlib.suppress(ValueError):
            return int(header)
    return None


def live_position(msg: Msg) -> int | None:
    """A live event's log position: the outbox's header, else the envelope's own field."""
    position = _header_position(msg)
    if position is not None:
        return position
    try:
        return _head_decoder.decode(msg.data).position
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def sse_frame(position: int, type_: str, data: bytes) -> bytes:
    """One SSE event. `data` is compact JSON (no raw newlines); the tag is kept to one line."""
    tag = " ".join(type_.split())
    return b"id: %d\nevent: %s\ndata: %s\n\n" % (position, tag.encode(), data)


_HEARTBEAT_FRAME: Final = b"id: %d\nevent: " + HEARTBEAT_TYPE.encode() + b"\ndata: %s\n\n"


def _encode(body: object) -> bytes:
    return msgspec.json.encode(body)
