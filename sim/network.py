"""The simulator's network: NATS over links with latency, loss, duplication, reordering,
partitions, isolated endpoints and a server outage, on the virtual clock.

Every process gets its own `endpoint(name)`, a Bus (the runtime.env protocol, plus NatsBus's
`add_reconnect_callback`, `is_connected`, `new_inbox` and `close`). A message goes from the
publishing endpoint to the server, which routes it exactly as MemoryBus does (sim/bus.py's
`route`: subject wildcards, every plain subscriber, one member per queue group round-robin),
then crosses the link from the publisher to each subscriber's endpoint: the link's faults decide
whether it is lost, when it arrives (on the virtual clock) and whether it comes twice. Per link,
messages arrive in the order they were sent unless `reorder` holds one back.

With `tick_s`, the server hands messages over on a tick, as nats-server flushes what it routed
to each connection once per read loop rather than per message: the arrival time drawn for a
message moves to the nearest multiple of `tick_s` that is still within the link's bounds (it
stays as drawn when no tick falls within them). Messages due at the same instant arrive in one
turn of the loop, in the order they were sent, with one timer between them; so a controller
reads a fleet's heartbeats a batch per wake-up instead of one wake-up each.

Two ways to cut an endpoint off, with the semantics of the real client (nats-py, NatsBus):

* `isolate(name)` / `reconnect(name)`: the process loses its network, and its client notices at
  once (its link is down). While cut off it is *disconnected*, as nats-py is while reconnecting:
  `publish` (and the request half of `request`) goes into a pending buffer of 2 MiB (nats-py's
  default `pending_size`) that is flushed, in order, on reconnect; past that it raises BusError
  (nats-py's OutboundBufferLimitError); a request times out (RequestTimeout) unless the endpoint
  is back and answered in time; `subscribe` works and takes effect on reconnect; nothing reaches
  its subscriptions, and whatever was in flight to it is lost. The server does not notice at
  once: it goes on routing to the stale connection (a queue group keeps handing it its share,
  which is lost) until its pings time out, `evict_after_s` later (nats-server's defaults, a ping
  every 2 min and 2 unanswered, close a dead client after 4 to 6 min). `reconnect` brings the
  client back after its reconnect wait (up to `reconnect_wait_s`, drawn): it subscribes again,
  flushes the pending buffer, then runs its reconnect callbacks in a task of its own, one after
  the other, a failing one logged and skipped, as NatsBus does.
* `outage(True)` / `outage(False)`: the NATS server itself is down. Every endpoint is
  disconnected as above, the server's state (sessions, subscriptions, queue-group turns) and
  every message in flight are lost; when it is back, each endpoint that is not isolated
  reconnects after its own reconnect wait, in endpoint creation order. (An endpoint made during
  an outage starts disconnected, where nats-py's first connect would fail: it simply waits.)

`partition(a, b)` is different: a silent cut that neither side notices (no disconnect, no
buffering, no reconnect callbacks), between endpoints or between endpoints and the server,
which is named "nats". A message from X to Y is lost if X -> Y, X -> nats or nats -> Y is cut,
checked when it is sent and again when it would arrive; a request that crosses one times out.
`heal()` removes partitions, never isolations: an isolated endpoint comes back by `reconnect`.

NoResponders is raised, as by the server, only when the request reached the server and no
subscription there matched (the 503 status comes back over the link); a responder behind a
partition, or a stale one not yet evicted, is a RequestTimeout.

Determinism: every draw comes from the injected RandomSource, in the order messages are routed
(per target: loss, latency, duplicate, reorder and its delay; then reconnect waits in endpoint
creation order); nothing iterates a set or a hash-ordered collection. `record=True` keeps a
trace of every message's fate at every subscriber (TraceEntry), to compare two runs.
"""

from __future__ import annotations

import asyncio
import contextvars
import itertools
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Final, NamedTuple

import structlog

from runtime.env import (
    DEFAULT_MAX_PAYLOAD,
    NO_RESPONDERS,
    BusError,
    Msg,
    MsgHandler,
    NoResponders,
    RandomSource,
    ReconnectCallback,
    RequestTimeout,
    is_no_responders,
)

from .bus import MemorySubscription, Plan, pick, plan, subject_matches

log = structlog.get_logger("gpumesh.sim.network")

SERVER: Final = "nats"  # the server's name in partitions: X cut from "nats" is cut from all
ANY: Final = "*"  # set_link wildcard
DEFAULT_PENDING_SIZE: Final = 2 * 1024 * 1024  # nats-py's pending_size while reconnecting
DEFAULT_RECONNECT_WAIT_S: Final = 0.5  # NatsBus.connect's reconnect_wait
DEFAULT_EVICT_AFTER_S: Final = 300.0  # nats-server: ping_interval 2 min, ping_max 2
_PROTOCOL_OVERHEAD: Final = 16  # "PUB ... \r\n...\r\n", roughly, for the pending buffer
_WILDCARD_HITS_KEPT: Final = 65_536  # subjects whose wildcard matches are remembered
_LINKS_KEPT: Final = 65_536  # (src, dst) pairs whose link faults are remembered


@dataclass(frozen=True, slots=True)
class LinkFaults:
    """What a link does to each message crossing it (each copy is drawn independently).

    latency_s: one-way delay, uniform in [low, high] (publisher -> server -> subscriber).
    loss: probability the message is lost.
    duplicate: probability it is delivered twice (the copy right behind the original).
    reorder: probability it is held back an extra `reorder_s` (uniform), so that messages sent
        after it on the same link may overtake it. With reorder 0 a link is FIFO, like TCP.
    """

    latency_s: tuple[float, float] = (0.0005, 0.002)
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    reorder_s: tuple[float, float] = (0.005, 0.05)

    def __post_init__(self) -> None:
        for name in ("latency_s", "reorder_s"):
            low, high = getattr(self, name)
            if not 0.0 <= low <= high:
                raise ValueError(f"{name} must be (low, high) with 0 <= low <= high")
        for name in ("loss", "duplicate", "reorder"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be a probability in [0, 1]")


@dataclass
class NetworkStats:
    """Counters, for tests and reports. `dropped` is by reason: "loss" (a link's loss draw),
    "partition", "disconnected" (the receiver was cut off, or was gone and back since),
    "outage" (the server died with the message in flight), "unsubscribed"."""

    published: int = 0  # messages that reached the server
    delivered: int = 0  # copies put in a subscription's queue
    duplicated: int = 0  # extra copies made by `duplicate`
    delayed: int = 0  # messages held back by `reorder`
    buffered: int = 0  # publishes held by a disconnected client, flushed on reconnect
    unrouted: int = 0  # messages that reached the server and matched no subscription
    rejected: int = 0  # publishes refused with BusError (buffer full, connection closed)
    dropped: Counter[str] = field(default_factory=Counter)


class TraceEntry(NamedTuple):
    """One message's fate at one subscriber (or at the server): `outcome` is "delivered",
    "unrouted" or a drop reason, stamped with the virtual time it happened."""

    time: float
    src: str
    dst: str
    subject: str
    data: bytes
    outcome: str


class SimSubscription(MemorySubscription):
    """A MemorySubscription owned by one endpoint; `known` once the server has it."""

    def __init__(
        self,
        endpoint: SimEndpoint,
        subject: str,
        queue: str,
        sid: int,
        handler: MsgHandler | None = None,
    ) -> None:
        super().__init__(endpoint, subject, queue, sid, handler)
        self.endpoint = endpoint
        self.known = endpoint.is_connected

    async def next_msg(self, timeout: float) -> Msg:
        """The next message; TimeoutError if none within `timeout`, BusError once closed
        (as NatsSubscription: a closed subscription must not look like a cancellation)."""
        if self.closed and self._inbox.empty():
            raise BusError(f"subscription to {self.subject} is closed")
        async with asyncio.timeout(timeout):
            msg = await self._inbox.get()
        if msg is None:
            raise BusError(f"subscription to {self.subject} is closed")
        return msg


@dataclass(slots=True)
class _Outgoing:
    msg: Msg
    want_status: bool  # it has a reply subject: the server answers 503 if nobody listens

    @property
    def size(self) -> int:
        msg = self.msg
        headers = sum(len(k) + len(v) + 4 for k, v in (msg.headers or {}).items())
        return len(msg.data) + len(msg.subject) + len(msg.reply) + headers + _PROTOCOL_OVERHEAD


@dataclass(slots=True)
class _Flight:
    src: str
    sub: SimSubscription
    msg: Msg
    server_epoch: int  # the server incarnation that routed it
    session: int  # the receiver's connection epoch when routed


class SimEndpoint:
    """One process's connection to the simulated NATS server: a Bus."""

    def __init__(self, network: SimNetwork, name: str) -> None:
        self.name = name
        self._net = network
        self.isolated = False
        self.closed = False
        self._connected = not network.server_down
        self.session = network._server_epoch if self._connected else -1
        self.epoch = 0  # bumped on every disconnect: what was routed to it before is lost
        self.down_since = 0.0
        self.reconnects = 0
        self.disconnects = 0
        self._subs: list[SimSubscription] = []
        self._pending: list[_Outgoing] = []
        self._pending_bytes = 0
        self._reconnect_generation = 0
        self._reconnecting = False
        self._callbacks: list[ReconnectCallback] = []
        self._callback_task: asyncio.Task[None] | None = None
        self._callbacks_again = False

    def __repr__(self) -> str:
        state = "closed" if self.closed else "connected" if self._connected else "disconnected"
        return f"<SimEndpoint {self.name} {state}>"

    @property
    def is_connected(self) -> bool:
        return self._connected

    @property
    def max_payload(self) -> int:
        return DEFAULT_MAX_PAYLOAD

    @property
    def pending_bytes(self) -> int:
        """Bytes held in the pending buffer while disconnected."""
        return self._pending_bytes

    def new_inbox(self) -> str:
        return self._net.new_inbox()

    def add_reconnect_callback(self, callback: ReconnectCallback) -> None:
        """Await `callback()` after every reconnect, in a task of the endpoint's own."""
        self._callbacks.append(callback)

    def remove_reconnect_callback(self, callback: ReconnectCallback) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    async def publish(
        self, subject: str, data: bytes, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        msg = Msg(subject=subject, data=data, reply=reply, headers=headers)
        # Any message with a reply subject that nobody takes is answered "no responders", as
        # by nats-server for a client that asked for it (nats-py does), not only a request.
        self._send(_Outgoing(msg, want_status=bool(reply)))

    async def subscribe(
        self, subject: str, *, queue: str = "", handler: MsgHandler | None = None
    ) -> SimSubscription:
        if self.closed:
            raise BusError(f"subscribe to {subject} failed: connection closed")
        sub = SimSubscription(self, subject, queue, self._net._next_sid(), handler)
        self._subs.append(sub)
        self._net._add(sub)
        return sub

    async def request(
        self,
        subject: str,
        data: bytes,
        *,
        timeout: float,
        headers: dict[str, str] | None = None,
    ) -> Msg:
        inbox = self.new_inbox()
        sub = await self.subscribe(inbox)
        try:
            self._send(
                _Outgoing(Msg(subject=subject, data=data, reply=inbox, headers=headers), True)
            )
            try:
                reply = await sub.next_msg(timeout)
            except TimeoutError:
                raise RequestTimeout(subject, timeout) from None
            if is_no_responders(reply):
                raise NoResponders(subject)
            return reply
        finally:
            await sub.unsubscribe()

    async def close(self) -> None:
        """The process lets go of its connection: every subscription ends, the reconnect
        callbacks are dropped, the pending buffer is lost; later calls raise BusError. The
        network's `endpoint(name)` then hands out a fresh endpoint (a restarted process)."""
        if self.closed:
            return
        self.closed = True
        self._drop_connection()
        self._callbacks.clear()
        self._pending.clear()
        self._pending_bytes = 0
        task, self._callback_task = self._callback_task, None
        for sub in list(self._subs):
            await sub.unsubscribe()
        if task is not None and not task.done():
            task.cancel()

    # -- the network's side ----------------------------------------------------------------

    def _remove(self, sub: MemorySubscription) -> None:
        assert isinstance(sub, SimSubscription)
        self._subs.remove(sub)
        self._net._discard(sub)

    def _send(self, out: _Outgoing) -> None:
        subject = out.msg.subject
        if self.closed:
            self._net.stats.rejected += 1
            raise BusError(f"publish to {subject} failed: connection closed")
        if not self._connected:
            size = out.size
            if self._pending_bytes + size > self._net.pending_size:
                self._net.stats.rejected += 1
                raise BusError(f"publish to {subject} failed: outbound buffer limit exceeded")
            self._pending.append(out)
            self._pending_bytes += size
            self._net.stats.buffered += 1
            return
        self._net._route(self, out)

    def _has_session(self, now: float) -> bool:
        """Whether the server still holds this endpoint's connection (and subscriptions)."""
        if self.closed or self.session != self._net._server_epoch:
            return False
        if self._connected:
            return True
        evict = self._net.evict_after_s
        return evict is None or now - self.down_since < evict

    def _drop_connection(self) -> None:
        self._net._plans.clear()
        self._reconnect_generation += 1  # a reconnect already scheduled is void
        self._reconnecting = False
        if self._connected:
            self._connected = False
            self.epoch += 1
            self.down_since = self._net._now()
            self.disconnects += 1
        if self.closed:
            self.session = -1

    def _schedule_reconnect(self) -> None:
        if self.closed or self._connected or self.isolated or self._net.server_down:
            return
        if self._reconnecting:
            return  # already on its way back
        self._reconnecting = True
        self._reconnect_generation += 1
        wait = self._net.reconnect_wait_s
        delay = self._net.rng.uniform(0.0, wait) if wait > 0 else 0.0
        asyncio.get_running_loop().call_later(delay, self._reconnected, self._reconnect_generation)

    def _reconnected(self, generation: int) -> None:
        if generation != self._reconnect_generation:
            return
        self._reconnecting = False
        if self.closed or self._connected or self.isolated or self._net.server_down:
            return
        # nats-py's order: replay the subscriptions, flush the pending buffer, then callbacks.
        self._net._plans.clear()
        self._connected = True
        self.session = self._net._server_epoch
        self.reconnects += 1
        for sub in self._subs:
            sub.known = True
        pending, self._pending = self._pending, []
        self._pending_bytes = 0
        for out in pending:
            self._net._route(self, out)
        if not self._callbacks:
            return
        if self._callback_task is not None and not self._callback_task.done():
            self._callbacks_again = True
            return
        self._callback_task = asyncio.get_running_loop().create_task(
            self._run_callbacks(), name=f"sim-reconnect-callbacks:{self.name}"
        )

    async def _run_callbacks(self) -> None:
        while True:
            self._callbacks_again = False
            for callback in list(self._callbacks):
                try:
                    await callback()
                except Exception:
                    log.exception("sim_reconnect_callback_failed", endpoint=self.name)
            if not self._callbacks_again:
                return


class SimNetwork:
    """NATS between simulated processes, with faults. See the module docstring."""

    def __init__(
        self,
        rng: RandomSource,
        *,
        default: LinkFaults = LinkFaults(),
        reconnect_wait_s: float = DEFAULT_RECONNECT_WAIT_S,
        evict_after_s: float | None = DEFAULT_EVICT_AFTER_S,
        pending_size: int = DEFAULT_PENDING_SIZE,
        record: bool = False,
        tick_s: float = 0.0,
    ) -> None:
        if tick_s < 0:
            raise ValueError("tick_s must be >= 0")
        self.rng = rng
        self.tick_s = tick_s
        self.default = default
        self.reconnect_wait_s = reconnect_wait_s
        self.evict_after_s = evict_after_s
        self.pending_size = pending_size
        self.stats = NetworkStats()
        self.trace: list[TraceEntry] | None = [] if record else None
        self.server_down = False
        self._server_epoch = 0
        self._endpoints: dict[str, SimEndpoint] = {}  # insertion-ordered: creation order
        # The server's subscriptions, in subscription order within each: by literal subject
        # (most: inboxes, per-node subjects), and the few with wildcards.
        self._literal: dict[str, list[SimSubscription]] = {}
        self._wildcard: list[SimSubscription] = []
        # subject -> the wildcard subscriptions matching it; emptied when those change.
        self._wildcard_hits: dict[str, list[SimSubscription]] = {}
        # subject -> its routing plan, kept only while every subscription it names is live
        # and connected; emptied whenever a subscription, a connection or the server changes.
        self._plans: dict[str, Plan[SimSubscription]] = {}
        self._links: dict[tuple[str, str], LinkFaults] = {}
        self._cuts: set[tuple[str, str]] = set()  # membership tests only, never iterated
        self._lanes: dict[tuple[str, str], deque[_Flight]] = {}  # per link, in flight
        # What arrives at each virtual instant, in the order it was sent: a link (its lane's
        # oldest message) or a held-back message. One loop timer per instant, not per message.
        self._due: dict[float, list[tuple[str, str] | _Flight]] = {}
        self._resolved: dict[tuple[str, str], LinkFaults] = {}  # link(); emptied on set_link
        self._turns: dict[str, int] = {}
        self._sids = itertools.count(1)
        self._inboxes = itertools.count(1)

    # -- endpoints ---------------------------------------------------------------------------

    def endpoint(self, name: str) -> SimEndpoint:
        """The Bus of the process called `name`: the same one on every call, until it is
        closed; after that a fresh one (a new connection from a restarted process)."""
        if name in (SERVER, ANY) or not name:
            raise ValueError(f"{name!r} cannot name an endpoint")
        current = self._endpoints.get(name)
        if current is not None and not current.closed:
            return current
        fresh = SimEndpoint(self, name)
        if current is not None and current.isolated:
            fresh.isolated = True  # the machine is still cut off: so is its new process
            fresh._drop_connection()
        self._endpoints[name] = fresh
        return fresh

    @property
    def endpoints(self) -> list[SimEndpoint]:
        return list(self._endpoints.values())

    def new_inbox(self) -> str:
        """A subject nobody else gets (`_INBOX.<n>`, deterministic), for replies to it."""
        return f"_INBOX.{next(self._inboxes)}"

    # -- faults ------------------------------------------------------------------------------

    def set_link(self, src: str, dst: str, faults: LinkFaults) -> None:
        """Faults of the link src -> dst; either may be "*". The most specific entry wins:
        (src, dst), then (src, *), then (*, dst), then (*, *), then the network's default."""
        self._links[(src, dst)] = faults
        self._resolved.clear()

    def clear_link(self, src: str, dst: str) -> None:
        self._links.pop((src, dst), None)
        self._resolved.clear()

    def link(self, src: str, dst: str) -> LinkFaults:
        resolved = self._resolved.get((src, dst))
        if resolved is not None:
            return resolved
        links = self._links
        for key in ((src, dst), (src, ANY), (ANY, dst), (ANY, ANY)):
            faults = links.get(key)
            if faults is not None:
                break
        else:
            faults = self.default
        if len(self._resolved) >= _LINKS_KEPT:
            self._resolved.clear()
        self._resolved[(src, dst)] = faults
        return faults

    def partition(
        self, side_a: Iterable[str], side_b: Iterable[str], *, one_way: bool = False
    ) -> None:
        """Cut every link between the two sides, silently (nobody is disconnected). With
        `one_way`, only a -> b is cut; b -> a still delivers. "nats" names the server."""
        a, b = list(side_a), list(side_b)
        for name in (*a, *b):
            if name == ANY or not name:
                raise ValueError(f"{name!r} cannot be partitioned; list the names")
        for x in a:
            for y in b:
                if x != y:
                    self._cuts.add((x, y))
                    if not one_way:
                        self._cuts.add((y, x))

    def heal(
        self, side_a: Iterable[str] | None = None, side_b: Iterable[str] | None = None
    ) -> None:
        """Remove every partition, or only those between `side_a` and `side_b` (both ways).
        Link faults stay, and so do isolations (see `reconnect`)."""
        if side_a is None and side_b is None:
            self._cuts.clear()
            return
        a, b = list(side_a or ()), list(side_b or ())
        for x in a:
            for y in b:
                self._cuts.discard((x, y))
                self._cuts.discard((y, x))

    def cut(self, src: str, dst: str) -> bool:
        """Whether a message from endpoint `src` to endpoint `dst` is cut by a partition."""
        cuts = self._cuts
        if not cuts:
            return False
        return (src, dst) in cuts or (src, SERVER) in cuts or (SERVER, dst) in cuts

    def isolate(self, name: str) -> None:
        """`name` loses its network: disconnected until `reconnect(name)`."""
        endpoint = self.endpoint(name)
        endpoint.isolated = True
        endpoint._drop_connection()

    def reconnect(self, name: str) -> None:
        """`name` has its network back: it reconnects after its reconnect wait, unless the
        server is down (then when the server is back)."""
        endpoint = self.endpoint(name)
        endpoint.isolated = False
        endpoint._schedule_reconnect()

    def outage(self, down: bool) -> None:
        """The NATS server goes down (True) or comes back (False)."""
        if down == self.server_down:
            return
        self.server_down = down
        self._plans.clear()
        if down:
            self._server_epoch += 1  # every session and every message in flight is lost
            self._turns.clear()
            for endpoint in self.endpoints:
                endpoint._drop_connection()
        else:
            for endpoint in self.endpoints:
                endpoint._schedule_reconnect()

    # -- routing -----------------------------------------------------------------------------

    def _now(self) -> float:
        return asyncio.get_running_loop().time()

    def _next_sid(self) -> int:
        return next(self._sids)

    def _add(self, sub: SimSubscription) -> None:
        if _is_literal(sub.subject):
            self._literal.setdefault(sub.subject, []).append(sub)
            self._plans.pop(sub.subject, None)  # a reply inbox: the only plan it changes
        else:
            self._wildcard.append(sub)
            self._wildcard_hits.clear()
            self._plans.clear()

    def _discard(self, sub: SimSubscription) -> None:
        if not _is_literal(sub.subject):
            self._wildcard.remove(sub)
            self._wildcard_hits.clear()
            self._plans.clear()
            return
        self._plans.pop(sub.subject, None)
        same = self._literal[sub.subject]
        same.remove(sub)
        if not same:
            del self._literal[sub.subject]

    def _record(self, src: str, dst: str, msg: Msg, outcome: str) -> None:
        if outcome == "delivered":
            self.stats.delivered += 1
        elif outcome == "unrouted":
            self.stats.unrouted += 1
        else:
            self.stats.dropped[outcome] += 1
        if self.trace is not None:
            self.trace.append(TraceEntry(self._now(), src, dst, msg.subject, msg.data, outcome))

    def _route(self, sender: SimEndpoint, out: _Outgoing) -> None:
        """`out` leaves `sender` (connected) for the server, which routes it."""
        src, msg = sender.name, out.msg
        if self._cuts and (src, SERVER) in self._cuts:
            self._record(src, SERVER, msg, "partition")
            return
        self.stats.published += 1
        now = self._now()
        subject = msg.subject
        planned = self._plans.get(subject)
        if planned is None:
            planned = self._plan(subject, now)
        targets = pick(planned, self._turns)
        if not targets:
            self._record(src, SERVER, msg, "unrouted")
            if out.want_status:
                # The 503 goes back to the requester alone, over its own link.
                status = Msg(subject=msg.reply, data=b"", headers={"Status": NO_RESPONDERS})
                for sub in sender._subs:
                    if sub.subject == msg.reply and sub.known:
                        self._transmit(src, sub, status, now)
            return
        for sub in targets:
            self._transmit(src, sub, msg, now)

    def _plan(self, subject: str, now: float) -> Plan[SimSubscription]:
        """Who takes `subject` now; remembered while nothing that decides it can change."""
        matching = self._wildcard_hits.get(subject)
        if matching is None:
            if len(self._wildcard_hits) >= _WILDCARD_HITS_KEPT:
                self._wildcard_hits.clear()  # reply inboxes are many and used once
            matching = [s for s in self._wildcard if subject_matches(s.subject, subject)]
            self._wildcard_hits[subject] = matching
        literal = self._literal.get(subject)
        if literal:
            matching = sorted([*literal, *matching], key=_by_sid) if matching else literal
        live = [s for s in matching if s.known and s.endpoint._has_session(now)]
        planned = plan(live, subject)
        if len(live) == len(matching) and all(s.endpoint._connected for s in live):
            # Nothing here can change without emptying the plans: reuse it for this subject.
            if len(self._plans) >= _WILDCARD_HITS_KEPT:
                self._plans.clear()
            self._plans[subject] = planned
        return planned

    def _transmit(self, src: str, sub: SimSubscription, msg: Msg, now: float) -> None:
        """The server hands `msg` (from `src`) to `sub`: the link to its endpoint decides.

        Every message to every subscriber comes through here, so the common case (no cut, a
        link already resolved, no loss, duplicate or reorder) is spelled out inline."""
        receiver = sub.endpoint
        dst = receiver.name
        key = (src, dst)
        cuts = self._cuts
        if cuts and (key in cuts or (src, SERVER) in cuts or (SERVER, dst) in cuts):
            self._record(src, dst, msg, "partition")
            return
        if not receiver._connected:
            self._record(src, dst, msg, "disconnected")
            return
        rng = self.rng
        faults = self._resolved.get(key) or self.link(src, dst)
        if faults.loss > 0 and rng.random() < faults.loss:
            self._record(src, dst, msg, "loss")
            return
        low, high = faults.latency_s
        # random.uniform's own formula, inline: the same draw, the same value.
        delay = low + (high - low) * rng.random() if high > low else low
        copies = 1
        if faults.duplicate > 0 and rng.random() < faults.duplicate:
            copies = 2
            self.stats.duplicated += 1
        flight = _Flight(src, sub, msg, self._server_epoch, receiver.epoch)
        what: tuple[str, str] | _Flight
        if faults.reorder > 0 and rng.random() < faults.reorder:
            self.stats.delayed += 1
            held_low, held_high = faults.reorder_s
            delay += rng.uniform(held_low, held_high) if held_high > held_low else held_low
            at = now + delay
            if self.tick_s:
                at = self._on_tick(at, now + low + held_low, now + high + held_high)
            what = flight  # held back: it arrives on its own, whatever else is on the link
        else:
            at = now + delay
            if self.tick_s:
                at = self._on_tick(at, now + low, now + high)
            # FIFO per link, like the TCP connections underneath: the arrivals fire at the
            # drawn times, and each hands over the oldest message still in flight on the link.
            # So the arrival times are the drawn ones, sorted, and each message stays within
            # its bounds: of the first k + 1 arrivals on a link one at least is for a message
            # sent no earlier than message k, and the k + 1 arrivals of messages 0..k are due
            # by its send + high.
            lane = self._lanes.get(key)
            if lane is None:
                lane = self._lanes[key] = deque()
            lane.append(flight)
            if copies == 2:
                lane.append(flight)
            what = key
        due = self._due.get(at)
        if due is None:
            due = self._due[at] = []
            # An empty context: a handler subscription runs in the arrival, and must not run
            # (and log) in the context of whichever sender happened to open this instant.
            loop = asyncio.get_running_loop()
            loop.call_at(at, self._arrive_all, at, context=contextvars.Context())
        due.append(what)
        if copies == 2:
            due.append(what)

    def _on_tick(self, at: float, earliest: float, latest: float) -> float:
        """The network's tick nearest to `at` within [earliest, latest], or `at` itself when
        no tick falls in that window. The same tick is the same float for every message (a
        multiple of `tick_s`), so whatever lands on it arrives in one turn of the loop."""
        tick = self.tick_s
        k = round(at / tick)
        on = k * tick
        if on < earliest:
            on = (k + 1) * tick
        elif on > latest:
            on = (k - 1) * tick
        return on if earliest <= on <= latest else at

    def _arrive_all(self, at: float) -> None:
        # Popped first: a zero-latency message sent while these are handed over is due at
        # this same instant, and gets a timer (and a turn) of its own.
        lanes = self._lanes
        for what in self._due.pop(at):
            if isinstance(what, _Flight):
                self._arrive(what)
                continue
            lane = lanes[what]
            flight = lane.popleft()
            if not lane:
                del lanes[what]
            self._arrive(flight)

    def _arrive(self, flight: _Flight) -> None:
        sub, src, msg = flight.sub, flight.src, flight.msg
        receiver = sub.endpoint
        dst = receiver.name
        if flight.server_epoch != self._server_epoch:
            self._record(src, dst, msg, "outage")
        elif flight.session != receiver.epoch or not receiver._connected:
            self._record(src, dst, msg, "disconnected")
        elif self._cuts and ((src, dst) in self._cuts or (SERVER, dst) in self._cuts):
            self._record(src, dst, msg, "partition")
        elif sub.closed:
            self._record(src, dst, msg, "unsubscribed")
        else:
            sub.deliver(msg)
            if self.trace is None:
                self.stats.delivered += 1  # `_record`'s count, without the call: the common case
            else:
                self._record(src, dst, msg, "delivered")


def _is_literal(subject: str) -> bool:
    tokens = subject.split(".")
    return "*" not in tokens and ">" not in tokens


def _by_sid(sub: SimSubscription) -> int:
    return sub.sid
