"""A running gateway: the routing feed, the HTTP server, and the suspicion and load publishers,
owned together.

`Gateway.run()` owns every task in one TaskGroup; cancelling it (SIGTERM in `gpumesh gateway`)
stops accepting connections, gives in-flight requests `shutdown_grace_s` to finish, then closes
the upstream pools.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import msgspec
import structlog

from events.contract import subjects
from events.contract.messages import ReplicaSuspicion
from runtime.env import Bus, BusError, Clock, RandomSource

from .access_log import AccessLog
from .app import build_app
from .auth import KeyRing
from .dispatch import MAX_HELD, Dispatcher
from .feed import RoutingFeed
from .front import Front
from .http_protocol import GatewayRunner
from .instruments import Instruments
from .load import LoadMeter
from .load_publisher import LoadPublisher
from .metrics import new_registry
from .proxy import Affinity, Proxy, ProxySettings
from .quota_share import QuotaSharer
from .retry import RetryPolicy
from .router import Ejection, Router, RouterConfig
from .transport.base import Transport
from .transport.direct import DirectTransport

if TYPE_CHECKING:  # opentelemetry is loaded only with --trace
    from .tracing import RequestTracer

TransportName = Literal["direct", "overlay"]
# How long aiohttp waits past the grace for the handlers cut_in_flight() just ended (a stream
# writes its error event and finishes); aiohttp cancels what is left only after twice that.
_AFTER_GRACE_S = 1.0
_SUSPICIONS_QUEUED = 1000  # beyond this, suspicions are dropped: they are hints, not state


@dataclass(frozen=True, slots=True)
class GatewayConfig:
    gateway_id: str
    host: str = "127.0.0.1"
    port: int = 8080  # 0 picks a free one (tests)
    transport: TransportName = "direct"
    max_body_bytes: int = 16 * 1024 * 1024
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    # Requests held per cluster while it starts from zero replicas (`--max-held`).
    max_held: int = MAX_HELD
    router: RouterConfig = field(default_factory=RouterConfig)
    affinity: Affinity = "off"
    access_log: bool = True
    tls_cert: Path | None = None
    tls_key: Path | None = None
    shutdown_grace_s: float = 10.0
    # A connection must deliver a complete request head within this of opening, or of its
    # previous response; an idle keep-alive connection is closed after it too (slow loris).
    header_timeout_s: float = 15.0
    request_body_timeout_s: float = 30.0  # the whole request body, once the head is in
    connect_timeout: float = 2.0
    # Listen only once a first routing table is in (from the controller, or the last one on
    # JetStream), waiting at most this long: a gateway that listened at once would answer 503
    # to everything until then, and a load balancer checking TCP would send it traffic.
    routes_wait_s: float = 0.0


class Gateway:
    def __init__(
        self,
        bus: Bus,
        config: GatewayConfig,
        keys: KeyRing,
        *,
        clock: Clock,
        rng: RandomSource,
        log: Any = None,
        access_log: AccessLog | None = None,
        routing_log: Callable[[], Awaitable[bytes | None]] | None = None,
        tracer: RequestTracer | None = None,
    ) -> None:
        """`routing_log`: the last routing table, from JetStream (wire/routing_log.py), for a
        start while no controller answers. `tracer`: a span per request (`--trace`,
        gateway/tracing.py); shut down, its spans flushed, when run() ends."""
        self.config = config
        self.bus = bus
        self.keys = keys
        self.log = (log or structlog.get_logger("gpumesh.gateway")).bind(gateway=config.gateway_id)
        self.router = Router(clock, rng, replace(config.router, affinity=config.affinity))
        self.registry = new_registry()
        self.instruments = Instruments(self.registry, self.router)
        self.meter = LoadMeter(clock)
        self.load = LoadPublisher(
            bus, self.meter, clock, self.instruments, config.gateway_id, self.log
        )
        self.quotas = QuotaSharer(bus, keys, clock, config.gateway_id, self.log)
        self.dispatcher = Dispatcher(
            self.router,
            config.retry,
            clock,
            rng,
            on_ejection=self._on_ejection,
            meter=self.meter,
            holds=self.load,
            max_held=config.max_held,
        )
        self.transport = self._transport()
        self.proxy = Proxy(
            self.router,
            self.dispatcher,
            self.transport,
            self.instruments,
            keys,
            ProxySettings(
                gateway_id=config.gateway_id,
                affinity=config.affinity,
                access_log=config.access_log,
                request_body_timeout_s=config.request_body_timeout_s,
            ),
            self.log,
            access_log,
        )
        self.tracer = self.proxy.tracer = tracer
        self.feed = RoutingFeed(
            bus, self.router, self.dispatcher, self.log, routing_log=routing_log
        )
        self._suspicions: asyncio.Queue[Ejection] = asyncio.Queue(_SUSPICIONS_QUEUED)
        self.started = asyncio.Event()
        self.url = ""

    def _transport(self) -> Transport:
        if self.config.transport == "overlay":
            from .transport.overlay import OverlayTransport

            return OverlayTransport(self.bus, connect_timeout=self.config.connect_timeout)
        return DirectTransport(connect_timeout=self.config.connect_timeout)

    def _on_ejection(self, ejection: Ejection) -> None:
        self.instruments.ejection(ejection.cluster, ejection.reason)
        self.log.warning(
            "replica_ejected",
            cluster=ejection.cluster,
            replica=ejection.replica_id,
            node=ejection.node_id,
            reason=ejection.reason,
            failures=ejection.failures,
            ejected_for_s=round(ejection.duration_s, 2),
        )
        try:
            self._suspicions.put_nowait(ejection)
        except asyncio.QueueFull:
            self.log.warning("suspicion_dropped", replica=ejection.replica_id)

    async def run(self) -> None:
        app = build_app(
            self.proxy,
            self.bus,
            self.keys,
            self.registry,
            ready=self.feed.ready.is_set,
            max_body_bytes=self.config.max_body_bytes,
            request_body_timeout_s=self.config.request_body_timeout_s,
        )
        runner = GatewayRunner(
            app,
            access_log=None,  # the proxy logs each request itself, with its routing context
            handler_cancellation=True,  # a client that goes away stops its upstream request
            shutdown_timeout=self.config.shutdown_grace_s + _AFTER_GRACE_S,
            # aiohttp arms this at connection start and closes a handler still waiting for a
            # whole request head when it expires: the slow-loris header defence.
            keepalive_timeout=self.config.header_timeout_s,
            # After an early answer (408, 413) aiohttp reads what is left of the body so the
            # client sees the answer rather than a reset: 2 s of that, not aiohttp's 10.
            lingering_time=2.0,
        )
        await runner.setup()
        assert runner.server is not None
        # Every connection starts at the front; it hands aiohttp what it does not serve itself.
        front = Front(
            self.proxy,
            runner.server,
            max_body_bytes=self.config.max_body_bytes,
            header_timeout_s=self.config.header_timeout_s,
            request_body_timeout_s=self.config.request_body_timeout_s,
            log=self.log,
        )
        loop = asyncio.get_running_loop()
        listener: asyncio.Server | None = None
        try:
            async with asyncio.TaskGroup() as tasks:
                tasks.create_task(self.feed.run(), name="routing-feed")
                await self._first_table()
                listener = await loop.create_server(
                    front,
                    self.config.host,
                    self.config.port,
                    ssl=self._tls(),
                    backlog=4096,
                    reuse_address=True,
                )
                port = listener.sockets[0].getsockname()[1]
                scheme = "https" if self.config.tls_cert else "http"
                self.url = f"{scheme}://{self.config.host}:{port}"
                if not self.keys.enabled:
                    self.log.warning("auth_disabled", hint="no key file: every client is admitted")
                if self.keys.api_open:
                    self.log.warning(
                        "control_api_open",
                        hint="--insecure-api: anyone who reaches this gateway may call /api/v1",
                    )
                if self.keys.path:  # read again when the file changes
                    tasks.create_task(self.keys.watch(self.log), name="key-file")
                self.log.info("gateway_listening", url=self.url, transport=self.transport.name)
                self.started.set()
                tasks.create_task(self._publish_suspicions(), name="suspicions")
                tasks.create_task(self.load.run(), name="load")
                if self.keys.enabled:  # tenants, perhaps with limits to share
                    tasks.create_task(self.quotas.run(), name="quota-share")
        finally:
            # Stop listening and wait for in-flight requests; when the grace ends, cut what is
            # still running ourselves: aiohttp's own cut comes only after twice its timeout, and
            # closes the connection before a handler could tell its client why.
            if listener is not None:
                listener.close()
            cut = loop.call_later(self.config.shutdown_grace_s, self.proxy.cut_in_flight)
            try:
                async with asyncio.TaskGroup() as stopping:
                    stopping.create_task(
                        front.shutdown(self.config.shutdown_grace_s + _AFTER_GRACE_S)
                    )
                    stopping.create_task(runner.cleanup())
            finally:
                cut.cancel()
                self.proxy.access_log.flush()
            await self.transport.close()
            if self.tracer is not None:
                await asyncio.to_thread(self.tracer.shutdown)  # flushes what is buffered

    async def _first_table(self) -> None:
        wait = self.config.routes_wait_s
        if wait <= 0 or self.feed.ready.is_set():
            return
        try:
            async with asyncio.timeout(wait):
                await self.feed.ready.wait()
        except TimeoutError:
            self.log.warning(
                "routes_not_in",
                detail="listening without a routing table: 503 until one arrives",
                waited_s=wait,
            )

    def _tls(self) -> ssl.SSLContext | None:
        if self.config.tls_cert is None:
            return None
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.config.tls_cert, self.config.tls_key)
        return context

    async def _publish_suspicions(self) -> None:
        while True:
            ejection = await self._suspicions.get()
            message = ReplicaSuspicion(
                gateway_id=self.config.gateway_id,
                cluster=ejection.cluster,
                replica_id=ejection.replica_id,
                node_id=ejection.node_id,
                epoch=ejection.epoch,
                reason=ejection.reason,
                failures=ejection.failures,
                ejected_for_s=round(ejection.duration_s, 3),
            )
            try:
                await self.bus.publish(subjects.SUSPECT, msgspec.json.encode(message))
            except BusError as exc:
                self.log.warning("suspicion_publish_failed", error=str(exc))
