"""For any two roles, what one may reach the other may not, unless the role table says so (issue
22, part 5).

NATS: docs/security.md publishes the matrix of what each role may publish and subscribe to,
subject by subject. This test reads that table, not the code's, and holds to it both the
permissions gpumesh/security/roles.py gives an identity and a real nats-server running the
`nats.conf` rendered from them. A wrong entry in roles.py, or in the doc, fails here.

HTTP: what each kind of key may call on a running gateway (the control API, inference, the
dashboard), stated here from what each key is for, against real requests on loopback.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, cast

import aiohttp
import msgspec
import pytest
from hypothesis import given, strategies as st

from events.contract import subjects
from events.contract.messages import ApiReply
from gateway.auth import KeyRing
from gateway.control_routes import ROUTE_NEEDS, control_app
from gpumesh.security import identities
from gpumesh.security.roles import permissions
from nodeagent.fencing_front import DirectFront, FrontTLS, front_path
from runtime.env import Bus, Msg, MsgHandler
from sim.bus import MemoryBus, MemorySubscription, subject_matches
from tests.integration.gateway_kit import RoutingSource, Upstream, route, running_gateway
from wire.nats_access import ROLES, Role, SecurityLayout, load_credentials
from wire.nats_bus import NatsBus, cancel_and_wait
from wire.nats_server import EmbeddedNats, find_nats_server

ROOT = Path(__file__).resolve().parents[2]
Op = Literal["pub", "sub"]
OPS: tuple[Op, ...] = ("pub", "sub")

# -- the documented matrix ------------------------------------------------------------------

NATS_MARK = "<!-- role matrix: NATS"
_TICKED = re.compile(r"`([^`]+)`")
_PLACEHOLDER = re.compile(r"<[a-z ]+>")


@dataclass(frozen=True)
class Row:
    """One row of the doc's NATS matrix: its subjects (none: every other subject) and what
    each role may do on them."""

    templates: tuple[str, ...]
    cells: dict[Role, frozenset[Op]]
    line: str

    @property
    def catch_all(self) -> bool:
        return not self.templates


def _doc() -> str:
    return (ROOT / "docs" / "security.md").read_text()


def _cell(text: str) -> frozenset[Op]:
    words = {w.strip() for w in text.split(",")} - {"—", ""}
    assert words <= set(OPS), f"a matrix cell says {text!r}: expected pub, sub, or —"
    return cast(frozenset[Op], frozenset(words))


@functools.cache
def nats_matrix() -> tuple[Row, ...]:
    lines = _doc().split(NATS_MARK, 1)[1].splitlines()[1:]
    header = [c.strip().strip("`") for c in lines[0].strip("|").split("|")]
    assert header[0] == "Subject" and sorted(header[1:]) == sorted(ROLES), header
    rows = []
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        first = cells[0].split("(")[0]  # what follows in parentheses is prose
        templates = tuple(_TICKED.findall(first))
        roles = cast(list[Role], header[1:])
        by_role = {role: _cell(text) for role, text in zip(roles, cells[1:], strict=True)}
        rows.append(Row(templates, by_role, line))
    assert rows and rows[-1].catch_all and not any(r.catch_all for r in rows[:-1])
    return tuple(rows)


@functools.cache
def read_verbs() -> tuple[str, ...]:
    """The doc's `<read verb>` legend."""
    legend = next(line for line in _doc().splitlines() if line.startswith("- `<read verb>`:"))
    verbs = tuple(_TICKED.findall(legend.split(":", 1)[1]))
    assert verbs and set(verbs) <= set(subjects.API_VERBS), legend
    return verbs


def other_verbs() -> tuple[str, ...]:
    return tuple(v for v in subjects.API_VERBS if v not in read_verbs())


@dataclass(frozen=True)
class Identity:
    role: Role
    name: str


def _token_regex(placeholder: str, who: Identity) -> str:
    if placeholder == "<own>":
        return re.escape(who.name)
    if placeholder == "<role>":
        return re.escape(who.role)
    if placeholder == "<other>":
        return f"(?!{re.escape(who.name)}(?:$|\\.))[^.]+"
    if placeholder == "<x>":
        return r"[^.]+"
    if placeholder == "<tail>":
        return r"[^.]+(?:\.[^.]+)*"
    if placeholder == "<read verb>":
        return "(?:" + "|".join(map(re.escape, read_verbs())) + ")"
    if placeholder == "<other verb>":
        return "(?:" + "|".join(map(re.escape, other_verbs())) + ")"
    raise AssertionError(f"the matrix uses {placeholder}, which this test does not know")


@functools.cache
def _compiled(template: str, who: Identity) -> re.Pattern[str]:
    parts, last = [], 0
    for found in _PLACEHOLDER.finditer(template):
        parts.append(re.escape(template[last : found.start()]))
        parts.append(_token_regex(found.group(), who))
        last = found.end()
    parts.append(re.escape(template[last:]))
    return re.compile("".join(parts))


def row_for(subject: str, who: Identity) -> Row:
    """The first row of the doc's matrix that `subject` falls in, for `who`."""
    for row in nats_matrix():
        if row.catch_all or any(_compiled(t, who).fullmatch(subject) for t in row.templates):
            return row
    raise AssertionError("unreachable: the last row matches everything")


def documented(who: Identity, op: Op, subject: str) -> bool:
    return op in row_for(subject, who).cells[who.role]


def granted(who: Identity, op: Op, subject: str) -> bool:
    """What roles.py's permissions let `who` do (None: everything)."""
    allowed = permissions(who.role, who.name)
    if allowed is None:
        return True
    patterns = allowed.publish if op == "pub" else allowed.subscribe
    return any(subject_matches(p, subject) for p in patterns)


# -- drawing identities and subjects -------------------------------------------------------------

_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=8)
_STREAMS = (
    subjects.EVENTS_STREAM,
    subjects.COMMANDS_STREAM,
    subjects.ROUTING_STREAM,
    subjects.LEADER_STREAM,
    "GPUMESH_CONTROLLERS",
    "GPUMESH_LOG",
    "KV_GPUMESH_SECRETS",
    "GPUMESH_SECRETS",
)


@functools.cache
def vocabulary() -> tuple[str, ...]:
    """Every literal token of the matrix and the contract, for subjects that look real."""
    words = set(_STREAMS) | {"MSG", "GET", "DELETE", "PURGE", "UPDATE", "DIRECT", "*", ">"}
    for row in nats_matrix():
        for template in row.templates:
            words |= set(_PLACEHOLDER.sub("", template).split("."))
    for verb in subjects.API_VERBS:
        words |= set(verb.split("."))
    return tuple(sorted(w for w in words if w and w not in ("*", ">")))


@st.composite
def two_identities(draw: st.DrawFn) -> tuple[Identity, Identity]:
    a, b = draw(st.lists(_names, min_size=2, max_size=2, unique=True))
    return Identity(draw(st.sampled_from(ROLES)), a), Identity(draw(st.sampled_from(ROLES)), b)


@st.composite
def subjects_for(draw: st.DrawFn, names: tuple[str, ...]) -> list[str]:
    """Every template of the matrix, filled with each of `names` where it names one, with
    each verb where it names one, and with drawn tokens where it takes any; and a few subjects
    made of tokens that occur in real ones."""
    token = st.sampled_from(vocabulary()) | _names | st.sampled_from(names)
    node_token = st.sampled_from(names).map(lambda n: f"node-{n}")
    anything = st.lists(token | node_token, min_size=1, max_size=4).map(".".join)
    found = draw(st.lists(anything, max_size=5))
    verbs = {"<read verb>": read_verbs(), "<other verb>": other_verbs()}
    tokens = {"<x>": draw(token), "<tail>": draw(anything)}
    for row in nats_matrix():
        for template in row.templates:
            for own, other, role in itertools.product(names, names, ROLES):
                for verb in next((verbs[v] for v in verbs if v in template), ("",)):
                    fill = {"<own>": own, "<other>": other, "<role>": role, **tokens}
                    fill |= dict.fromkeys(verbs, verb)
                    found.append(_PLACEHOLDER.sub(lambda m, f=fill: f[m.group()], template))
    return sorted(set(found))


# -- NATS: the code's table against the doc's --------------------------------------------------


@given(two_identities(), _names, st.data())
def test_for_any_two_identities_each_reaches_a_subject_only_as_the_matrix_says(
    pair: tuple[Identity, Identity], third: str, data: st.DataObject
) -> None:
    a, b = pair
    for subject in data.draw(subjects_for((a.name, b.name, third))):
        for op in OPS:
            code = (granted(a, op, subject), granted(b, op, subject))
            doc = (documented(a, op, subject), documented(b, op, subject))
            assert code == doc, (
                f"{op} {subject}: roles.py lets {a} {code[0]} and {b} {code[1]}; "
                f"docs/security.md says {doc[0]} ({row_for(subject, a).line[:70]}...) and "
                f"{doc[1]} ({row_for(subject, b).line[:70]}...)"
            )


def _filled(template: str, who: Identity, other: str) -> Iterator[str]:
    """The template for `who`, `<other>` being `other`; once for each verb it may name."""
    verbs = {"<read verb>": read_verbs(), "<other verb>": other_verbs()}
    for verb in next((verbs[v] for v in verbs if v in template), ("",)):
        fill = {"<own>": who.name, "<other>": other, "<role>": who.role, "<x>": "x1"}
        fill |= {"<tail>": "x1.x2", **dict.fromkeys(verbs, verb)}
        yield _PLACEHOLDER.sub(lambda m, f=fill: f[m.group()], template)


def every_case(identity_names: dict[Role, str]) -> Iterator[tuple[Identity, Op, str, bool]]:
    """Every row's subjects, filled for each identity (its own name, another's), with what the
    matrix says of each identity on each: the cases the real server is asked."""
    who = [Identity(role, name) for role, name in identity_names.items()]
    concrete = {"gpumesh.v1.nothing.here", "$JS.API.STREAM.DELETE.GPUMESH_EVENTS"}
    for row in nats_matrix():
        for template in row.templates:
            for one in who:
                for other in who:
                    if other != one:
                        concrete.update(_filled(template, one, other.name))
    for subject in sorted(concrete):
        for one in who:
            for op in OPS:
                yield one, op, subject, documented(one, op, subject)


def test_every_row_every_role_and_op_as_the_matrix_says() -> None:
    """The same property without drawing: each row, filled for each of five identities."""
    names: dict[Role, str] = {
        "node": "gpu-1",
        "gateway": "gw-1",
        "integrator": "analytics",
        "controller": "controller",
        "admin": "admin",
    }
    wrong = [
        f"{who.role} {op} {subject}: roles.py {not expected}, the doc {expected}"
        for who, op, subject, expected in every_case(names)
        if granted(who, op, subject) != expected
    ]
    assert not wrong, "\n".join(wrong)


def _contract_subjects(node: str) -> list[str]:
    """Every subject docs/subjects.md names, for one node id."""
    per_node = [subjects.register, subjects.heartbeat, subjects.report, subjects.leaving]
    per_node += [subjects.command, subjects.fault, subjects.tunnel, subjects.links]
    found = [make(node) for make in per_node]
    found += [subjects.event(f"node/{node}"), subjects.event("cluster/llama")]
    found += [subjects.ROUTING, subjects.LEADER, subjects.SUSPECT, subjects.LOAD]
    found += [subjects.CRL, subjects.CRL_GET]
    found += [
        subjects.stagelink_to_stage(node, "gpu-2", "s1"),
        subjects.stagelink_to_head(node, "gpu-2", "s1"),
        subjects.stagelink_to_stage("gpu-2", node, "s1"),
        subjects.stagelink_to_head("gpu-2", node, "s1"),
    ]
    found += [subjects.api(verb) for verb in subjects.API_VERBS]
    return found


@pytest.mark.parametrize("role", ROLES)
def test_every_contract_subject_has_a_row_of_its_own(role: Role) -> None:
    """No subject of the contract is left to the matrix's last row ("any other subject")."""
    for own in (True, False):
        who = Identity(role, "gpu-1" if own else "someone")
        for subject in _contract_subjects("gpu-1"):
            assert not row_for(subject, who).catch_all, (who, subject)


# -- NATS: a real server, with the nats.conf rendered from roles.py -----------------------------


@pytest.mark.integration
async def test_a_real_server_enforces_the_matrix(tmp_path: Path) -> None:
    """Every row of the matrix, for one identity of each role, on a real nats-server: each
    publish is watched by the controller (it may read everything), each subscription is fed
    by it; one flush per side, then whatever was going to arrive has arrived."""
    layout = SecurityLayout(tmp_path / "data")
    identities.init(layout)  # controller, admin and gateway
    identities.issue(layout, "gpu-1", "node")
    identities.issue(layout, "analytics", "integrator")
    names: dict[Role, str] = {
        "node": "gpu-1",
        "gateway": "gateway",
        "integrator": "analytics",
        "admin": "admin",
        "controller": "controller",
    }
    cases = list(every_case(names))
    async with EmbeddedNats(
        tmp_path / "nats", binary=find_nats_server(), config_file=layout.server_config
    ) as server:
        buses: dict[str, NatsBus] = {}
        try:
            for name in names.values():
                creds = load_credentials(layout.creds(name))
                buses[name] = await NatsBus.connect(server.url, name=name, credentials=creds)
            seen = await _observe(buses, cases)
        finally:
            for bus in buses.values():
                await bus.close()
    wrong = [
        f"{who.role} {op} {subject}: the server {not expected}, the doc {expected}"
        for who, op, subject, expected in cases
        if ((who.name, op, subject) in seen) != expected
    ]
    assert not wrong, "\n".join(wrong)


async def _observe(
    buses: dict[str, NatsBus], cases: list[tuple[Identity, Op, str, bool]]
) -> set[tuple[str, Op, str]]:
    """(name, op, subject) for each publish the controller received and each subscription that
    received the controller's message."""
    seen: set[tuple[str, Op, str]] = set()
    want = {(who.name, op, subject) for who, op, subject, allowed in cases if allowed}
    complete = asyncio.Event()  # every allowed case seen; the handlers run in the buses' tasks

    def note(name: str, op: Op, subject: str) -> None:
        seen.add((name, op, subject))
        if want <= seen:
            complete.set()

    watcher = buses["controller"]
    tag = b"role-matrix:"

    def published(msg: Msg) -> None:
        if msg.data.startswith(tag):
            note(msg.data[len(tag) :].decode(), "pub", msg.subject)

    await watcher.subscribe(">", handler=published)
    await watcher.flush()
    for who, op, subject, _ in cases:
        if op == "pub":
            await buses[who.name].publish(subject, tag + who.name.encode())

    def received(name: str, subject: str) -> MsgHandler:
        return lambda msg: note(name, "sub", subject)

    subscribed = {(who.name, subject) for who, op, subject, _ in cases if op == "sub"}
    for name, subject in sorted(subscribed):
        await buses[name].subscribe(subject, handler=received(name, subject))
    for bus in buses.values():
        await bus.flush()
    for subject in sorted({subject for _, subject in subscribed}):
        await watcher.publish(subject, b"from the controller")
    await watcher.flush()
    for bus in buses.values():
        await bus.flush()
    with contextlib.suppress(TimeoutError):  # what is missing is the test's to report
        async with asyncio.timeout(10):
            await complete.wait()
    await asyncio.sleep(0.1)  # what was let through wrongly came with the rest
    return seen


# -- HTTP: what each key may call on a gateway ---------------------------------------------------

KEY_FILE = """
admin_keys = ["gm-root"]

[admins.ro]
keys = ["gm-ro"]
scope = "read"

[admins.llama-team]
keys = ["gm-llama"]
scope = "operate"
clusters = ["llama"]

[admins.both]
keys = ["gm-both"]
scope = "read"

[tenants.acme]
keys = ["gm-acme"]
rate_per_s = 0
clusters = ["llama"]

[tenants.beta]
keys = ["gm-beta"]
rate_per_s = 0

[tenants.both]
keys = ["gm-both"]
rate_per_s = 0
clusters = ["mistral"]
"""
CLUSTERS = ("llama", "mistral")
Scope = Literal["read", "operate", "all"]


@dataclass(frozen=True)
class Caller:
    """A key, and what it is for in the key file above: the clusters it sends inference to
    (None: it is no tenant's key), and its admin scope (None: no admin key)."""

    key: str
    tenant: frozenset[str] | None = None
    scope: Scope | None = None
    operates: frozenset[str] = frozenset()


CALLERS = (
    Caller(""),
    Caller("gm-stranger"),
    Caller("gm-acme", tenant=frozenset({"llama"})),
    Caller("gm-beta", tenant=frozenset(CLUSTERS)),
    Caller("gm-ro", scope="read"),
    Caller("gm-llama", scope="operate", operates=frozenset({"llama"})),
    Caller("gm-root", scope="all"),
    Caller("gm-both", tenant=frozenset({"mistral"}), scope="read"),
)

Ring = Literal["key file", "up", "no keys", "insecure api"]
RINGS: tuple[Ring, ...] = ("key file", "up", "no keys", "insecure api")


def reach(caller: Caller, ring: Ring) -> Caller:
    """What a caller is under each way of starting a gateway (docs/gateway.md): with a key
    file, what the file says; `gpumesh up`'s one admin key (tenant auth off: inference is
    everyone's); no keys (the control API closed to all, inference everyone's);
    `--insecure-api` (everything everyone's)."""
    everything = frozenset(CLUSTERS)
    if ring == "key file":
        return caller
    if ring == "up":
        scope: Scope | None = "all" if caller.key == "gm-root" else None
        return Caller(caller.key, tenant=everything, scope=scope)
    if ring == "no keys":
        return Caller(caller.key, tenant=everything)
    return Caller(caller.key, tenant=everything, scope="all")


@dataclass(frozen=True)
class Call:
    surface: Literal["control", "dashboard", "inference", "models", "ops"]
    method: str
    path: str
    body: bytes | None = None
    cluster: str = ""  # the cluster the path or the body names


_BODIES = {  # a body each control route takes, so that an allowed call reaches the controller
    ("POST", "/clusters"): b'{"name": "llama"}',
    ("PUT", "/clusters/{name}"): b'{"replicas": 1}',
    ("PATCH", "/clusters/{name}"): b'{"replicas": 1}',
    ("POST", "/clusters/{name}/canary"): b'{"spec": {}, "weight": 10}',
}


def control_calls() -> list[Call]:
    """Every route of the control app as its router has it (not as its scope table says),
    for each cluster and one node; and the same reads through the dashboard."""
    app = control_app(cast(Bus, None))
    calls = []
    for one in app.router.routes():
        if one.method == "HEAD" or one.resource is None:
            continue
        pattern = one.resource.canonical
        body = _BODIES.get((one.method, pattern), b"{}" if one.method != "GET" else None)
        for cluster in CLUSTERS if "{name}" in pattern else ("",):
            path = pattern.replace("{name}", cluster).replace("{node_id}", "gpu-1")
            calls.append(Call("control", one.method, f"/api/v1{path}", body, cluster))
            calls.append(Call("dashboard", one.method, f"/ui/api{path}", body, cluster))
    return calls


CHAT = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}]}'
CALLS: tuple[Call, ...] = (
    *control_calls(),
    *(Call("inference", "POST", "/v1/chat/completions", CHAT % c.encode(), c) for c in CLUSTERS),
    *(
        Call("inference", "POST", f"/c/{c}/v1/chat/completions", CHAT % c.encode(), c)
        for c in CLUSTERS
    ),
    Call("models", "GET", "/v1/models"),
    Call("ops", "GET", "/healthz"),
    Call("ops", "GET", "/metrics"),
)


def expected(caller: Caller, call: Call) -> str:
    """What the call should come to, from what the caller is for: `served`, or the status it
    is refused with. `/v1/models` lists the clusters the caller's inference reaches."""
    if call.surface == "ops":
        return "served"  # orchestrators and Prometheus carry no key
    if call.surface in ("inference", "models"):
        if caller.tenant is None:
            return "401"
        if call.surface == "models":
            return "served: " + ",".join(sorted(caller.tenant))
        return "served" if call.cluster in caller.tenant else "404"
    if caller.scope is None:
        return "401"
    if call.surface == "dashboard":
        return "served" if call.method == "GET" else "405"  # a dashboard only reads
    if call.method == "GET" or caller.scope == "all":
        return "served"
    changes_its_cluster = call.path.startswith(f"/api/v1/clusters/{call.cluster}")
    if caller.scope == "operate" and call.cluster and changes_its_cluster:
        return "served" if call.cluster in caller.operates else "403"
    return "403"


class YesController:
    """The controller's API on the in-memory bus: says yes to every verb, with an empty events
    page (which every route decodes), and counts what it was asked."""

    def __init__(self, bus: MemoryBus) -> None:
        self.bus = bus
        self.asked = 0

    async def serve(self, sub: MemorySubscription) -> None:
        page = {"events": [], "next": 0, "head": 0}
        reply = msgspec.json.encode(ApiReply(ok=True, data=page))
        async for msg in sub:
            self.asked += 1
            await self.bus.publish(msg.reply, reply)


class LiveGateways:
    """One gateway per way of starting it, each on its own in-memory bus with a controller that
    says yes, all serving one upstream on loopback. They run on an event loop of their own, in
    a thread, so that each hypothesis example is two requests, not four gateways started."""

    def __init__(self, keys_dir: Path) -> None:
        self._keys_dir = keys_dir
        self._ready = threading.Event()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="role-matrix-gateways")
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._gateways: dict[Ring, tuple[str, YesController]] = {}
        self._http: aiohttp.ClientSession | None = None

    def __enter__(self) -> LiveGateways:
        self._thread.start()
        if not self._ready.wait(60) or self._failed is not None:
            self.__exit__()
            raise RuntimeError("the gateways did not start") from self._failed
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(60)

    def outcome(self, ring: Ring, key: str, call: Call) -> str:
        assert self._loop is not None
        future = asyncio.run_coroutine_threadsafe(self._outcome(ring, key, call), self._loop)
        return future.result(30)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._failed = exc
        finally:
            self._ready.set()

    def _ring(self, ring: Ring) -> KeyRing:
        if ring == "key file":
            path = self._keys_dir / "keys.toml"
            path.write_text(KEY_FILE)
            return KeyRing.load(path)
        if ring == "up":
            path = self._keys_dir / "admin-key"
            path.write_text("gm-root\n")
            return KeyRing.load_admin_key(path)
        return KeyRing.open(insecure_api=ring == "insecure api")

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with contextlib.AsyncExitStack() as stack:
            upstream = await Upstream("upstream").start()
            stack.push_async_callback(upstream.stop)
            self._http = await stack.enter_async_context(aiohttp.ClientSession())
            for ring in RINGS:
                bus = MemoryBus()
                source = await stack.enter_async_context(RoutingSource(bus))
                await source.publish({c: [route(f"{c}-0", upstream.address)] for c in CLUSTERS})
                controller = YesController(bus)
                for family in ("cluster", "node", "events"):  # routing.get is the source's
                    sub = await bus.subscribe(f"{subjects.PREFIX}.api.{family}.>")
                    task = asyncio.create_task(controller.serve(sub))
                    stack.push_async_callback(cancel_and_wait, task)
                gateway = await stack.enter_async_context(
                    running_gateway(bus, keys=self._ring(ring), shutdown_grace_s=0.5)
                )
                self._gateways[ring] = (gateway.url, controller)
            self._ready.set()
            await self._stop.wait()

    async def _outcome(self, ring: Ring, key: str, call: Call) -> str:
        assert self._http is not None
        url, controller = self._gateways[ring]
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        if call.body is not None:
            headers["Content-Type"] = "application/json"
        asked = controller.asked
        async with self._http.request(
            call.method, url + call.path, data=call.body, headers=headers
        ) as response:
            status = response.status
            if call.surface == "models" and status == 200:
                models = sorted(m["id"] for m in (await response.json())["data"])
                return "served: " + ",".join(models)
            if call.surface == "inference" and status == 200:
                return "served" if "X-Upstream" in response.headers else "200, not upstream's"
            if "/stream" not in call.path:  # an event stream goes on: its head is the answer
                await response.read()
        if call.surface in ("control", "dashboard") and controller.asked > asked:
            return "served" if status < 300 else f"{status}, after asking the controller"
        return "served" if call.surface == "ops" and status == 200 else str(status)


@pytest.fixture(scope="module")
def gateways(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveGateways]:
    with LiveGateways(tmp_path_factory.mktemp("keys")) as live:
        yield live


@given(st.sampled_from(CALLERS), st.sampled_from(CALLERS), st.sampled_from(RINGS))
def test_for_any_two_keys_each_reaches_a_route_only_as_it_is_meant_to(
    gateways: LiveGateways, a: Caller, b: Caller, ring: Ring
) -> None:
    for call in CALLS:
        got = (gateways.outcome(ring, a.key, call), gateways.outcome(ring, b.key, call))
        want = (expected(reach(a, ring), call), expected(reach(b, ring), call))
        assert got == want, (
            f"{ring}: {call.method} {call.path} with {a.key!r}, {b.key!r}: {got}, meant {want}"
        )


@pytest.mark.parametrize("ring", RINGS)
def test_every_key_on_every_route(gateways: LiveGateways, ring: Ring) -> None:
    """The same property without drawing: every caller, every call."""
    wrong = [
        f"{call.method} {call.path} with {caller.key!r}: {got}, meant {want}"
        for caller in CALLERS
        for call in CALLS
        if (got := gateways.outcome(ring, caller.key, call))
        != (want := expected(reach(caller, ring), call))
    ]
    assert not wrong, "\n".join(wrong)


CONTROL_MARK = "<!-- role matrix: control API"


def test_the_docs_control_api_table_is_the_routers_and_the_scope_tables() -> None:
    """docs/security.md's table of /api/v1 routes names every route the app has, each in the
    row of the need gateway/control_routes.py gives it."""
    lines = _doc().split(CONTROL_MARK, 1)[1].splitlines()[1:]
    header = [c.strip().strip("`") for c in lines[0].strip("|").split("|")]
    documented: dict[tuple[str, str], str] = {}
    for line in lines[2:]:
        if not line.startswith("|"):
            break
        cells = dict(
            zip(header, (c.strip() for c in line.strip().strip("|").split("|")), strict=True)
        )
        need = "read" if cells["read"] == "yes" else "all"
        if cells["operate"].startswith("yes for its clusters"):
            need = "cluster"
        for route_text in _TICKED.findall(cells[header[0]]):
            method, path = route_text.split(" ", 1)
            documented[(method, path)] = need
    app = control_app(cast(Bus, None))
    routes = {(r.method, r.resource.canonical) for r in app.router.routes() if r.resource}
    assert set(documented) == {(m, p) for m, p in routes if m != "HEAD"}
    assert documented == ROUTE_NEEDS


# -- the node's front ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def front_layout(tmp_path_factory: pytest.TempPathFactory) -> SecurityLayout:
    """A stack's security files, one identity of every role (node-1 is the front's node)."""
    made = SecurityLayout(tmp_path_factory.mktemp("front") / "stack")
    identities.init(made)
    for role in ROLES:
        if role != "gateway":
            identities.issue(made, f"a-{role}" if role != "node" else "node-1", role)
    identities.issue(made, "node-2", "node")
    return made


async def _front_answer(layout: SecurityLayout, caller: str | None) -> int | str:
    """What node-1's front, as a secured stack runs it (mutual TLS, the stack's crl.pem), does
    with a request from `caller`'s identity (None: a stranger with no certificate): the HTTP
    status, or "refused" when the handshake fails."""
    import ssl

    node = load_credentials(layout.creds("node-1"))
    workload = await Upstream("workload").start()
    front = DirectFront(
        "127.0.0.1",
        0,
        lambda replica, epoch: workload.address if (replica, epoch) == ("r", 1) else None,
        lambda replica, epoch: "",  # leased
        tls=FrontTLS(node.tls_context(server=True), node.ca_pem, layout.crl),
    )
    task = asyncio.create_task(front.run())
    try:
        await front.listening.wait()
        context: ssl.SSLContext | bool = False
        if caller is not None:
            identity = load_credentials(layout.creds(caller))
            context = identity.tls_context(server=False) if identity.tls_pem else False
        if context is False:
            # No certificate: the front's own CA trusted, nothing presented.
            context = ssl.create_default_context(cadata=node.ca_pem)
        url = f"https://127.0.0.1:{front.port}{front_path('r', 1)}/v1/chat/completions"
        try:
            async with (
                aiohttp.ClientSession() as http,
                http.post(url, data=CHAT % b"r", ssl=context) as reply,
            ):
                return reply.status
        except (aiohttp.ClientError, ssl.SSLError, ConnectionError):
            return "refused"
    finally:
        await cancel_and_wait(task)
        await workload.stop()


@pytest.mark.parametrize("role", [*ROLES, None])
async def test_a_node_front_serves_only_gateways(
    front_layout: SecurityLayout, role: Role | None
) -> None:
    # For any two roles, one is served by a node's front and the other not unless both are
    # the gateway's: the front's table has one row. A node's own certificate (node-2) and the
    # control plane's identities, which hold no TLS certificate, are strangers to it. (A front
    # built without FrontTLS is the plain one, NATS unsecured or --insecure-front: it serves
    # whoever reaches it, and says so in the log; docs/security.md.)
    caller = {None: None, "gateway": "gateway", "node": "node-2"}.get(role, f"a-{role}")
    answer = await _front_answer(front_layout, caller)
    if role == "gateway":
        assert answer == 200, answer
    else:
        assert answer in ("refused", 401, 403), f"{caller} was served: {answer}"
