"""The dashboard's aiohttp sub-application, mounted at /ui by gateway/app.py.

    GET  /ui/                      -> /ui/fleet
    GET  /ui/fleet                 every node: health, region, GPUs, its replicas
    GET  /ui/clusters              every cluster: revision, replicas with epochs, states, nodes
    GET  /ui/events                the log, filtered by type, node, cluster, replica; live tail
    GET  /ui/incidents?before=     each node loss that moved replicas, as a timeline: those that
                                   began in the last windows of the log (live), or before
                                   position `before` (an older page, not live)
    GET  /ui/login, POST /ui/login the admin key, exchanged for a session cookie
    POST /ui/logout
    GET  /ui/static/<name>         the scripts and the style sheet (gateway/ui/static)
    GET  /ui/data/fleet            {"head", "nodes", "clusters"}  (what the fleet page embeds)
    GET  /ui/data/clusters         {"head", "clusters"}
    GET  /ui/data/events?to=&limit=  {"head", "start", "events"}: the last events up to `to`
    GET  /ui/data/incidents?before=  {"head", "before", "older", "count", "from_ns", "to_ns",
                                   "html"}: the incidents, drawn (timeline.py); `older` is the
                                   `before` of the next older page (0: none)
    GET  /ui/data/metrics          {"interval_s", "samples"}: this gateway's last 15 minutes per
                                   cluster (history.py), for the clusters page's charts
    GET  /ui/data/metrics/stream   the same, then each new sample (SSE)
    GET  /ui/api/...               the read routes of /api/v1 (gateway/control_routes.py),
                                   /ui/api/events/stream above all: the pages' live feed (SSE)

A page is HTML rendered here with its first data inside it (one request, then the stream), and
a small script that draws the rows, filters and sorts them, and applies each event of
`/ui/api/events/stream` as it comes: nothing in the browser asks again on a timer.

Who may see it: with `--insecure-api` everyone, as /api/v1. Otherwise a request needs an admin
key of any scope (everything here is a read), either as `Authorization: Bearer` (scripts) or
through the session cookie the login form sets (a browser's EventSource cannot send a header):
gateway/ui/session.py. Without it a page is sent to the login form, and a data route answers 401.
"""

from __future__ import annotations

import asyncio
import contextlib
import html
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Final
from urllib.parse import parse_qs, quote, urlsplit

import msgspec
from aiohttp import web
from prometheus_client import CollectorRegistry

from events import Envelope
from events.catalog import event_type_names
from events.codec import decode_envelope
from gateway.auth import KeyRing
from gateway.control_routes import ControlError, control_app, invalid, read_body
from runtime.env import Bus
from runtime.real_env import LoopClock

from . import incidents as incident_model
from .assets import Assets, template
from .data import DEFAULT_EVENTS, MAX_EVENTS, ControllerClient
from .history import MetricsHistory
from .incidents import Incident, WindowScan, window_of, with_heartbeat
from .session import COOKIE, Sessions
from .timeline import Bin, incident_html

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

PREFIX: Final = "/ui"
PAGES: Final = (
    ("fleet", "Fleet"),
    ("clusters", "Clusters"),
    ("events", "Events"),
    ("incidents", "Incidents"),
)
MAX_INCIDENTS: Final = 50  # the newest, on the page
# Windows of the log (incidents.WINDOW positions each) whose incidents the first page shows:
# its newest one may have only begun.
FIRST_WINDOWS: Final = 2
# Windows an older page looks back through for one that holds an incident, at most: each is
# read with the two before it and the one after, one events.list page at a time.
OLDER_WINDOWS: Final = 32
HEARTBEATS_KEPT: Final = 512  # (node, position) -> its last heartbeat before: never changes
MAX_LOGIN_BYTES: Final = 8192
LOGIN_BODY_TIMEOUT_S: Final = 10.0
# The pages run only their own scripts, from here; they talk to nothing but this gateway.
CSP: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
_SECURITY_HEADERS: Final = {
    "X-Content-Type-Options": "nosniff",
    # Not no-referrer: with it a browser sends `Origin: null` on the sign-in form's POST, which
    # _same_origin must refuse (a sandboxed frame sends the same).
    "Referrer-Policy": "same-origin",
    "X-Frame-Options": "DENY",
}
_NO_STORE: Final = {"Cache-Control": "no-store"}


class _EventsData(msgspec.Struct, frozen=True):
    """`GET /ui/data/events` query parameters."""

    to: int | None = None
    limit: int = DEFAULT_EVENTS


class _IncidentsQuery(msgspec.Struct, frozen=True):
    """`GET /ui/incidents` and `/ui/data/incidents` query parameters."""

    before: int | None = None


@dataclass(frozen=True, slots=True)
class _Incidents:
    """One page of incidents, newest first: those that began before `before` (None: the first
    page, the newest windows), back to `older` (the next page's `before`; 0: the log's start).
    `from_ns`, `to_ns`: when the first and the last event of that stretch were recorded."""

    head: int
    before: int | None
    older: int
    found: list[Incident]
    from_ns: int = 0
    to_ns: int = 0

    def summary(self) -> bytes:
        return msgspec.json.encode(
            {
                "head": self.head,
                "before": self.before,
                "older": self.older,
                "count": len(self.found),
                "from_ns": self.from_ns,
                "to_ns": self.to_ns,
            }
        )


def mount(
    app: web.Application,
    bus: Bus,
    keys: KeyRing,
    *,
    timeout: float = 10.0,
    registry: CollectorRegistry | None = None,
) -> None:
    """The dashboard at /ui of the gateway's application (and /ui itself, which a sub-app
    cannot answer, sent to /ui/fleet). `registry`: the gateway's metrics, sampled for the
    clusters page's charts (none: no charts)."""

    async def bare(request: web.Request) -> web.StreamResponse:
        raise web.HTTPSeeOther(f"{PREFIX}/fleet")

    history = MetricsHistory(registry, LoopClock()) if registry is not None else None
    app.router.add_get(PREFIX, bare)
    app.add_subapp(PREFIX, ui_app(bus, keys, timeout=timeout, history=history))


def ui_app(
    bus: Bus,
    keys: KeyRing,
    *,
    timeout: float = 10.0,
    events_poll: float = 5.0,
    keepalive: float = 15.0,
    sessions: Sessions | None = None,
    history: MetricsHistory | None = None,
) -> web.Application:
    """The /ui sub-application. `timeout`: seconds for each controller reply; `events_poll`
    and `keepalive`: the event stream's (gateway/control_routes.py control_app); `history`:
    sampled while the app runs (a task of its own, cancelled by the app's cleanup)."""
    ui = _Dashboard(
        bus, keys, timeout=timeout, sessions=sessions or Sessions(keys), history=history
    )
    app = web.Application(middlewares=[ui.gate])
    if history is not None:
        app.cleanup_ctx.append(_sampling(history))

        async def close_streams(app: web.Application) -> None:
            history.close()

        app.on_shutdown.append(close_streams)
    app.on_response_prepare.append(_security_headers)
    app.router.add_get("/", ui.index)
    for page, _ in PAGES:
        app.router.add_get(f"/{page}", ui.page)
    login = app.router.add_get("/login", ui.login_form)
    login_post = app.router.add_post("/login", ui.login)
    app.router.add_post("/logout", ui.logout)
    static = app.router.add_get("/static/{name}", ui.assets.serve)
    app.router.add_get("/data/fleet", ui.fleet_data)
    app.router.add_get("/data/clusters", ui.clusters_data)
    app.router.add_get("/data/events", ui.events_data)
    app.router.add_get("/data/incidents", ui.incidents_data)
    app.router.add_get("/data/metrics", ui.metrics_data)
    app.router.add_get("/data/metrics/stream", ui.metrics_stream)
    ui.public = {login, login_post, static}
    # The read verbs of /api/v1, behind this app's own check (keys=None: none of its own).
    api = control_app(bus, timeout=timeout, events_poll=events_poll, keepalive=keepalive)
    app.add_subapp("/api", api)
    return app


def _sampling(
    history: MetricsHistory,
) -> Callable[[web.Application], AbstractAsyncContextManager[None]]:
    @contextlib.asynccontextmanager
    async def sampling(app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(history.run(), name="ui-metrics-history")
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    return sampling


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in _SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)
    if response.content_type == "text/html":
        response.headers.setdefault("Content-Security-Policy", CSP)


class _Dashboard:
    def __init__(
        self,
        bus: Bus,
        keys: KeyRing,
        *,
        timeout: float,
        sessions: Sessions,
        history: MetricsHistory | None,
    ) -> None:
        self.keys = keys
        self.history = history
        self.sessions = sessions
        self.controller = ControllerClient(bus, timeout=timeout)
        self.assets = Assets()
        self.public: set[web.AbstractRoute] = set()
        self._layout = template("layout.html")
        self._login = template("login.html")
        self._bodies = {page: template(f"{page}.html") for page, _ in PAGES}
        self._types = event_type_names()
        # (node, incident position) -> its last heartbeat before (None: not found): the
        # incidents page is drawn again after each burst of events, and this never changes.
        self._heartbeats: OrderedDict[tuple[str, int], Envelope | None] = OrderedDict()

    # -- who may see it -----------------------------------------------------------------

    def allowed(self, request: web.Request) -> bool:
        if self.keys.api_open:
            return True
        header = request.headers.get("Authorization")
        if header is not None and self.keys.admin(header) is not None:
            return True
        return self.sessions.scope(request.cookies.get(COOKIE)) is not None

    @web.middleware
    async def gate(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.match_info.route in self.public:
            try:
                return await handler(request)
            except ControlError as exc:
                return exc.response()
        data = request.path.startswith((f"{PREFIX}/api/", f"{PREFIX}/data/"))
        if not self.allowed(request):
            if data or request.method not in ("GET", "HEAD"):
                message = "the dashboard needs an admin key: sign in at /ui/login"
                error = ControlError(401, "admin_key_required", message)
                error.headers = {"WWW-Authenticate": "Bearer"}
                return error.response()
            target = request.path_qs if request.path != f"{PREFIX}/" else f"{PREFIX}/fleet"
            raise web.HTTPSeeOther(f"{PREFIX}/login?next={quote(target, safe='/?=&')}")
        if data and request.method not in ("GET", "HEAD"):
            # Only reads: a cookie must not carry a change (/api/v1 takes those, by header).
            message = f"{request.method[:20]} is not allowed here: the dashboard only reads"
            error = ControlError(405, "method_not_allowed", message)
            error.headers = {"Allow": "GET, HEAD"}
            return error.response()
        try:
            return await handler(request)
        except ControlError as exc:
            return exc.response()

    async def login_form(self, request: web.Request) -> web.StreamResponse:
        target = _local_target(request.query.get("next", ""))
        if self.allowed(request):
            raise web.HTTPSeeOther(target)
        return self._login_page(target, "", status=200)

    def _login_page(self, target: str, problem: str, *, status: int) -> web.Response:
        if not self.keys.has_admin_keys:
            where = f" ({self.keys.path} has none)" if self.keys.path else ""
            message = (
                f"The dashboard is closed: this gateway has no admin key{where}. Give it a key "
                "file with admin keys (--keys FILE), or --insecure-api for a local stack."
            )
            kind = "error"
        elif problem:
            message, kind = problem, "error"
        else:
            message, kind = "Sign in with an admin key to see the fleet.", "muted"
        text = self._login.substitute(
            css=self.assets.url("dashboard.css"),
            message=html.escape(message),
            message_class=kind,
            next=html.escape(target),
        )
        return web.Response(text=text, content_type="text/html", status=status, headers=_NO_STORE)

    async def login(self, request: web.Request) -> web.StreamResponse:
        _same_origin(request)
        if (request.content_length or 0) > MAX_LOGIN_BYTES:
            raise ControlError(413, "request_too_large", "the sign-in form is too large")
        raw = await read_body(request, LOGIN_BODY_TIMEOUT_S)
        if len(raw) > MAX_LOGIN_BYTES:
            raise ControlError(413, "request_too_large", "the sign-in form is too large")
        form = parse_qs(raw.decode("utf-8", errors="replace"), max_num_fields=4)
        key = form.get("key", [""])[0]
        target = _local_target(form.get("next", [""])[0])
        if self.keys.api_open:
            raise web.HTTPSeeOther(target)
        token = self.sessions.login(key)
        if token is None:
            return self._login_page(target, "That is not an admin key of this gateway.", status=401)
        answer = web.HTTPSeeOther(target)
        answer.set_cookie(
            COOKIE,
            token,
            path=PREFIX,
            max_age=int(self.sessions.ttl_s),
            httponly=True,
            samesite="Strict",
            secure=request.secure,
        )
        raise answer

    async def logout(self, request: web.Request) -> web.StreamResponse:
        _same_origin(request)
        self.sessions.logout(request.cookies.get(COOKIE))
        answer = web.HTTPSeeOther(f"{PREFIX}/login")
        answer.del_cookie(COOKIE, path=PREFIX)
        raise answer

    # -- pages ------------------------------------------------------------------------------

    async def index(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPSeeOther(f"{PREFIX}/fleet")

    async def page(self, request: web.Request) -> web.StreamResponse:
        page = request.path.rsplit("/", 1)[1]
        title = dict(PAGES)[page]
        data = await self._page_data(page)
        body = self._bodies[page].template
        if page == "incidents":
            drawn, data = await self._incidents_page(_before(request))
            body = self._bodies[page].substitute(incidents=drawn)
        nav = "".join(
            f'<a href="{PREFIX}/{name}"{" aria-current=page" if name == page else ""}>{label}</a>'
            for name, label in PAGES
        )
        signout = (
            ""
            if self.keys.api_open
            else f'<form method="post" action="{PREFIX}/logout" class="signout">'
            '<button type="submit">Sign out</button></form>'
        )
        config = msgspec.json.encode({"page": page, "types": self._types})
        embedded = b'{"config":%s,"data":%s}' % (config, data)
        text = self._layout.substitute(
            title=title,
            page=page,
            nav=nav,
            signout=signout,
            body=body,
            css=self.assets.url("dashboard.css"),
            common=self.assets.url("common.js"),
            script=self.assets.url(f"{page}.js"),
            # Inside <script type="application/json">: no `<` may close the element early.
            data=embedded.replace(b"<", b"\\u003c").decode(),
        )
        response = web.Response(text=text, content_type="text/html", headers=_NO_STORE)
        response.enable_compression()
        return response

    async def _page_data(self, page: str) -> bytes:
        """The page's first data; when the controller does not answer, why, and the page
        says so and takes its data from the stream once the controller is back."""
        try:
            if page == "fleet":
                return await self.controller.fleet()
            if page == "clusters":
                return await self.controller.clusters()
            if page == "incidents":
                return b"{}"  # drawn in the page itself (_incidents_page)
            # The clusters say on which node each current replica runs, for the node filter.
            backfill, clusters = await asyncio.gather(
                self.controller.recent_events(None, DEFAULT_EVENTS),
                self.controller.raw("cluster.list", {}),
            )
            return msgspec.json.encode(backfill)[:-1] + b',"clusters":%s}' % clusters
        except ControlError as exc:
            return msgspec.json.encode({"error": exc.message})

    # -- data -------------------------------------------------------------------------------

    async def fleet_data(self, request: web.Request) -> web.Response:
        return _json(await self.controller.fleet())

    async def clusters_data(self, request: web.Request) -> web.Response:
        return _json(await self.controller.clusters())

    async def metrics_data(self, request: web.Request) -> web.Response:
        return _json(msgspec.json.encode(self._metrics()))

    def _metrics(self) -> dict[str, object]:
        if self.history is None:
            return {"interval_s": 0, "keep_s": 0, "samples": []}
        return self.history.snapshot()

    async def metrics_stream(self, request: web.Request) -> web.StreamResponse:
        """`snapshot` (every sample kept) first, then `sample` as each is taken."""
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",
            }
        )
        await response.prepare(request)
        snapshot = msgspec.json.encode(self._metrics())
        await response.write(b"retry: 5000\nevent: snapshot\ndata: %s\n\n" % snapshot)
        if self.history is None:
            return response
        quiet = 0.0
        try:
            async for sample in self.history.follow():
                transport = request.transport
                if transport is None or transport.is_closing():
                    break
                if sample is None:
                    quiet += 1.0
                    if quiet >= 15.0:  # a proxy in between must not close it as idle
                        await response.write(b": keep-alive\n\n")
                        quiet = 0.0
                    continue
                quiet = 0.0
                frame = b"event: sample\ndata: %s\n\n" % msgspec.json.encode(sample)
                await response.write(frame)
        except ConnectionResetError:
            pass  # the page went away
        return response

    async def incidents_data(self, request: web.Request) -> web.Response:
        page = await self._incidents(_before(request))
        drawn = msgspec.json.encode(self._drawn(page))
        return _json(page.summary()[:-1] + b',"html":%s}' % drawn)

    async def _incidents_page(self, before: int | None) -> tuple[str, bytes]:
        try:
            page = await self._incidents(before)
        except ControlError as exc:
            return "", msgspec.json.encode({"error": exc.message, "before": before})
        return self._drawn(page), page.summary()

    def _drawn(self, page: _Incidents) -> str:
        return "".join(self._draw(i) for i in page.found)

    async def _incidents(self, before: int | None) -> _Incidents:
        """The incidents that began before position `before` (gateway/ui/incidents.py has the
        rule: each is shown with the window of the log it began in, whole), each given its
        node's last heartbeat before it (the log is read without heartbeats), newest first.

        The first page is the incidents of the last FIRST_WINDOWS windows; an older one looks
        back from `before` through windows twice as many each time until it finds one, or
        through OLDER_WINDOWS; either shows MAX_INCIDENTS at most, the newest."""
        size = incident_model.WINDOW
        head = await self.controller.head()
        top = head if before is None else min(before - 1, head)
        found: list[Incident] = []
        older = 0
        span = [0, 0]
        last = window_of(top, size) if top > 0 else -1
        count = FIRST_WINDOWS
        looked = 0
        while last >= 0:
            first = max(0, last - count + 1)
            windows = WindowScan(first, last, size=size)
            await self._read(windows, min(head, windows.limit), (first * size, top), span)
            found = [i for i in windows.incidents() if i.position <= top] + found
            looked += last - first + 1
            older = first * size + 1 if first > 0 else 0
            if before is None or found or looked >= OLDER_WINDOWS:
                break
            last = first - 1
            count = min(2 * count, OLDER_WINDOWS - looked)
        if len(found) > MAX_INCIDENTS:
            found = found[-MAX_INCIDENTS:]
            older = found[0].position  # the next page: those that began before it
            span[0] = found[0].start_ns
        beats = [await self._last_heartbeat(i.node_id, i.position) for i in found]
        found = [
            i if b is None else with_heartbeat(i, b) for i, b in zip(found, beats, strict=True)
        ]
        return _Incidents(head, before, older, found[::-1], span[0], span[1])

    async def _read(
        self, windows: WindowScan, upto: int, shown: tuple[int, int], span: list[int]
    ) -> None:
        """Feeds `windows` the log from its start to `upto` (or as far as it wants), and keeps
        in `span` when the first and last events in (shown[0], shown[1]] were recorded."""
        lo, hi = shown
        async with contextlib.aclosing(self.controller.scan(windows.start, upto)) as events:
            async for position, raw in events:
                try:
                    envelope = decode_envelope(raw)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    continue  # an event this gateway cannot read: not drawn, never fatal
                windows.feed(envelope)
                if lo < position <= hi:
                    if not span[0] or envelope.recorded_at < span[0]:
                        span[0] = envelope.recorded_at
                    span[1] = max(span[1], envelope.recorded_at)
                if not windows.wanted():
                    break

    def _draw(self, incident: Incident) -> str:
        """With this gateway's requests to the clusters it moved, while it lasted (what the
        metrics history still holds: 15 minutes), under its timeline."""
        if self.history is None:
            return incident_html(incident)
        clusters = {m.cluster for m in incident.moves}
        bins = []
        for s in self.history.window(incident.begin_ns, incident.end_ns, clusters):
            rates = s.clusters.values()
            answered = sum(r.rps for r in rates) * s.seconds
            failed = sum(r.errors for r in rates) * s.seconds
            retried = sum(r.retries for r in rates) * s.seconds
            start = s.at_ns - round(s.seconds * 1e9)
            bins.append(Bin(start, round(answered - failed), round(failed), round(retried)))
        if not any(b.ok or b.failed or b.retried for b in bins):
            return incident_html(incident)
        width = round(self.history.interval_s * 1e9)
        return incident_html(incident, requests=bins, bin_ns=width)

    async def _last_heartbeat(self, node_id: str, position: int) -> Envelope | None:
        key = (node_id, position)
        if key in self._heartbeats:
            self._heartbeats.move_to_end(key)
            return self._heartbeats[key]
        raw = await self.controller.last_heartbeat(node_id, position)
        beat = None
        if raw is not None:
            try:
                beat = decode_envelope(raw)
            except (msgspec.DecodeError, msgspec.ValidationError):
                beat = None
        self._heartbeats[key] = beat
        if len(self._heartbeats) > HEARTBEATS_KEPT:
            self._heartbeats.popitem(last=False)
        return beat

    async def events_data(self, request: web.Request) -> web.Response:
        try:
            query = msgspec.convert(dict(request.query), _EventsData, strict=False)
        except msgspec.ValidationError as exc:
            raise invalid(f"query: {exc}") from None
        if query.to is not None and query.to < 0:
            raise invalid(f"to: must be >= 0, got {query.to}", "to")
        if not 1 <= query.limit <= MAX_EVENTS:
            raise invalid(f"limit: must be 1..{MAX_EVENTS}, got {query.limit}", "limit")
        backfill = await self.controller.recent_events(query.to, query.limit)
        return _json(msgspec.json.encode(backfill))


def _before(request: web.Request) -> int | None:
    try:
        query = msgspec.convert(dict(request.query), _IncidentsQuery, strict=False)
    except msgspec.ValidationError as exc:
        raise invalid(f"query: {exc}") from None
    if query.before is not None and query.before < 1:
        raise invalid(f"before: must be >= 1, got {query.before}", "before")
    return query.before


def _json(body: bytes) -> web.Response:
    response = web.Response(body=body, content_type="application/json", headers=_NO_STORE)
    response.enable_compression()
    return response


def _local_target(target: str) -> str:
    """Where to go after signing in: a path of the dashboard, nothing else (no open redirect)."""
    parts = urlsplit(target)
    if (
        parts.scheme
        or parts.netloc
        or "\\" in target
        or not (parts.path == PREFIX or parts.path.startswith(f"{PREFIX}/"))
        or parts.path.startswith(f"{PREFIX}/login")
    ):
        return f"{PREFIX}/fleet"
    return target


def _same_origin(request: web.Request) -> None:
    """A form posted from another site is refused (with SameSite=Strict, the second guard)."""
    origin = request.headers.get("Origin")
    if origin is not None and urlsplit(origin).netloc != request.host:
        raise ControlError(403, "forbidden", "a sign-in form must come from this gateway's page")


__all__ = ["PREFIX", "mount", "ui_app"]
