"""One request's way to a response head: pick a replica, try, maybe try another, or wait.

Only asyncio primitives and the injected clock and random source: on the simulator's
virtual-time loop the same code waits, times out and backs off without costing wall time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from events.contract.messages import RouteEntry
from runtime.env import Clock, RandomSource

from .load import LoadMeter
from .retry import RetryPolicy
from .router import Ejection, Router
from .transport.base import BrokenWhileHeld, FirstByteTimeout, Outcome, UpstreamError

T = TypeVar("T")

# Retry-After for a cluster with no ready replica: spread, so that clients told to come back
# do not all come back in the same second.
RETRY_AFTER_MIN_S = 1.0
RETRY_AFTER_MAX_S = 5.0
# Requests one gateway holds per cluster while it starts from zero replicas (`--max-held`):
# enough for a burst to wait out a cold start, bounded so that a flood of them is refused at
# once rather than each holding a connection and a task for minutes.
MAX_HELD = 256


class DispatchError(Exception):
    """Why a request gets no answer from a replica, as its client is to be told.

    `status`, `code` and `message` are the reply (OpenAI's error shape; docs/gateway.md,
    "Status codes of the inference routes") and `retry_after_s`, when set, its Retry-After.
    Two things only the request knows are added where the error becomes a reply
    (gateway/proxy.py, `refuse`): the models its key may see, when `lists_known`, and why it
    was not repeated, when `not_repeated`. Each kind keeps what it reports in fields of its
    own; str() is the line for a log.

    Raised from inside an attempt (by the caller's `attempt` or `settle`), it ends the request
    there, and `outcome` says how that attempt counts against its replica.
    """

    retry_after_s: float | None = None
    lists_known = False
    not_repeated = False
    outcome: Outcome = "cancelled"

    def __init__(self, status: int, code: str, message: str, log: str = "") -> None:
        super().__init__(log or message)
        self.status = status
        self.code = code
        self.message = message


class UnknownCluster(DispatchError):
    """No live cluster has this name (or none this caller may know of: `lists_known` False)."""

    def __init__(self, cluster: str, *, lists_known: bool = True) -> None:
        message = f"The model `{cluster}` does not exist"
        super().__init__(404, "model_not_found", message, f"unknown cluster {cluster}")
        self.cluster = cluster
        self.lists_known = lists_known


class NoReadyReplica(DispatchError):
    """The request waited queue_timeout_s and the cluster still has no replica to try."""

    retry_after_s: float  # always: drawn, so that clients told to come back spread out

    def __init__(self, cluster: str, waited_s: float, retry_after_s: float) -> None:
        super().__init__(
            503,
            "no_ready_replica",
            f"cluster {cluster!r} has no ready replica",
            f"cluster {cluster}: no ready replica after {waited_s:.1f} s",
        )
        self.cluster = cluster
        self.waited_s = waited_s
        self.retry_after_s = retry_after_s


class ColdStartTimeout(NoReadyReplica):
    """The cluster scales from zero, and no replica became ready within the time a request may
    be held for it (RoutingUpdate.cold_start: its spec's `autoscale.cold_start_timeout_s`).

    A NoReadyReplica, so a caller that handles that one (the simulator) handles this too."""

    def __init__(self, cluster: str, limit_s: float, retry_after_s: float) -> None:
        DispatchError.__init__(
            self,
            503,
            "cold_start_timeout",
            f"no replica of cluster {cluster!r} became ready within {limit_s:g} s "
            "(autoscale.cold_start_timeout_s)",
            f"cluster {cluster}: no replica ready after a {limit_s:g} s cold start",
        )
        self.cluster = cluster
        self.waited_s = self.limit_s = limit_s
        self.retry_after_s = retry_after_s


class HoldFull(NoReadyReplica):
    """The cluster is starting from zero replicas and this gateway already holds `max_held`
    requests for it: one more is refused at once rather than queued without bound."""

    def __init__(self, cluster: str, max_held: int, retry_after_s: float) -> None:
        DispatchError.__init__(
            self,
            503,
            "hold_full",
            f"cluster {cluster!r} is starting from zero replicas and already holds "
            f"{max_held} requests (gateway --max-held)",
            f"cluster {cluster}: {max_held} requests held for a cold start already",
        )
        self.cluster = cluster
        self.waited_s = 0.0
        self.max_held = max_held
        self.retry_after_s = retry_after_s


class AttemptsExhausted(DispatchError):
    """Every attempt failed before an answer could begin; `last` says how the last one did.

    502, with `last`'s outcome as the code; 504 if it timed out. A body that broke while held
    back (BrokenWhileHeld) is a `reset`: the client never saw it begin."""

    def __init__(
        self, last: UpstreamError, attempts: int, cluster: str = "", *, repeatable: bool = True
    ) -> None:
        if not isinstance(last, BrokenWhileHeld):
            code = last.outcome
            message = (
                f"no replica of {cluster!r} answered after {attempts} attempt(s); last: {last}"
            )
        elif repeatable:
            code, message = "reset", f"every answer broke off before its end; last: {last}"
        else:
            code, message = "reset", f"the answer broke off before its end ({last})"
        status = 504 if isinstance(last, FirstByteTimeout) else 502
        log = f"{attempts} attempt(s) failed, last: {last} ({last.outcome})"
        super().__init__(status, code, message, log)
        self.last = last
        self.attempts = attempts
        self.cluster = cluster
        self.not_repeated = not repeatable and not last.never_delivered


def _ignore(_ejection: Ejection) -> None:
    return None


class HoldObserver(Protocol):
    """Told of the requests a dispatcher holds for want of a replica (the gateway's metrics
    and its load reports; gateway/load_publisher.py). Called on the request's own task: quick,
    no I/O."""

    def held(self, cluster: str, count: int) -> None:
        """This dispatcher now holds `count` requests of `cluster`."""

    def held_at_zero(self, cluster: str) -> None:
        """A request began to wait for a cluster with no route at all: the autoscaler's
        cold-start signal, which must not wait for the next report."""

    def cold_start(self, cluster: str, seconds: float) -> None:
        """A request held while `cluster` started from zero got its answer's first byte
        `seconds` after its hold began."""


class DispatchTrace(Protocol):
    """Told of one request's decisions as the dispatcher makes them (gateway/tracing.py turns
    them into span events). Given to run() per request; None costs nothing. Called on the
    request's own task: quick, no I/O."""

    def attempt(self, route: RouteEntry, attempt: int) -> None:
        """Attempt number `attempt` (from 1) goes to `route`."""

    def attempt_failed(self, route: RouteEntry, error: UpstreamError, attempt: int) -> None:
        """That attempt failed before an answer could begin."""

    def backoff(self, delay_s: float, attempt: int) -> None:
        """Another attempt follows, after `delay_s`."""

    def ejected(self, ejection: Ejection) -> None:
        """This request's failure ejected its replica."""

    def hold(self, reason: str, limit_s: float) -> None:
        """The request waits (at most `limit_s`) for the table to change: `reason` is
        cold_start, replacement (every candidate failed, the last refusing connections) or
        no_ready_replica."""

    def hold_ended(self, reason: str, woken: bool) -> None:
        """That wait ended: the table changed (`woken`), or its time ran out."""


@dataclass(slots=True)
class _Request:
    """One request's way through run(): what the waits and the load meter need of it."""

    cluster: str
    key: str
    arrival: float
    # What the deadline and the queue timeout count from: the arrival, moved on by the time
    # held in a cold start, which is the cluster's time to start and not the request's budget.
    start: float
    tried: list[RouteEntry] = field(default_factory=list)
    holding: bool = False  # counted among the cluster's held requests
    in_flight: bool = False  # counted in flight on the meter
    cold_since: float | None = None  # held in a cold start since
    cold_began: float | None = None  # its first cold-start hold began (the histogram's zero)
    trace: DispatchTrace | None = None


class Dispatcher:
    def __init__(
        self,
        router: Router,
        policy: RetryPolicy,
        clock: Clock,
        rng: RandomSource,
        on_ejection: Callable[[Ejection], None] = _ignore,
        *,
        meter: LoadMeter | None = None,
        holds: HoldObserver | None = None,
        max_held: int = MAX_HELD,
    ) -> None:
        """`meter`, if given, counts every request's load for the autoscaler: its arrival, its
        holds, and in flight from its first attempt until the caller's `finished`. `max_held`
        bounds the requests held per cluster while it starts from zero (HoldFull beyond)."""
        if max_held < 1:
            raise ValueError(f"max_held must be >= 1, got {max_held!r}")
        self.router = router
        self.policy = policy
        self._clock = clock
        self._rng = rng
        # Also told of the ejections that `finished` causes: an answer that broke off on its
        # way to the client counts against its replica as an attempt's failure does.
        self.on_ejection = on_ejection
        self.meter = meter
        self._holds = holds
        self.max_held = max_held
        self._held: dict[str, int] = {}  # cluster -> requests waiting for a replica of it
        # Replaced on every notify(): a waiter holds the event current when it last looked at
        # the table, so a change between its look and its wait still wakes it.
        self._table_changed = asyncio.Event()

    def notify(self) -> None:
        """Wake the requests waiting for a replica; call after router.apply() returned True."""
        self._table_changed.set()
        self._table_changed = asyncio.Event()

    def pick_cluster(self, cluster: str) -> str:
        """The cluster that serves a request for `cluster`: while `cluster` has a canary with a
        ready replica (Router.split), its canary for `weight` percent of the requests, drawn
        one request at a time from this dispatcher's random source; `cluster` otherwise,
        without a draw. The caller asks once per request, before run(), and gives run() and
        finished() the cluster it answers: the request's retries, holds and load count stay
        with that cluster."""
        split = self.router.split(cluster)
        if split is None:
            return cluster
        return split.to if self._rng.random() * 100 < split.weight else cluster

    def held(self, cluster: str) -> int:
        """Requests of `cluster` waiting for a replica now."""
        return self._held.get(cluster, 0)

    def finished(
        self,
        cluster: str,
        route: RouteEntry,
        outcome: Outcome,
        trace: DispatchTrace | None = None,
    ) -> None:
        """The answer run() returned for `cluster` has ended (in full: "ok"; broken off:
        "stream_broken"; the client left: "cancelled"): the route's outstanding request is
        done, an ejection that causes is reported, and the meter no longer counts it in
        flight. Exactly once per successful run()."""
        ejection = self.router.finished(route, outcome)
        if ejection is not None:
            self.on_ejection(ejection)
            if trace is not None:
                trace.ejected(ejection)
        if self.meter is not None:
            self.meter.done(cluster)

    async def run(
        self,
        cluster: str,
        attempt: Callable[[RouteEntry, float], Awaitable[T]],
        *,
        key: str = "",
        repeatable: bool = True,
        settle: Callable[[RouteEntry, T], Awaitable[None]] | None = None,
        trace: DispatchTrace | None = None,
    ) -> tuple[RouteEntry, T]:
        """The route that answered and what `attempt` returned for it. A request that is not
        `repeatable` is tried again only after a failure that proves it never reached a
        replica (RetryPolicy.retryable).

        `settle`, if given, runs once `attempt` has returned, outside its first-byte timeout:
        what must still succeed before the caller passes the answer on (the proxy reads a
        non-streaming body whole). An UpstreamError from it is an attempt's failure like any
        other: it counts against the route and is retried on the policy's terms.

        The request stays outstanding on that route (and in flight on the meter): the caller
        calls `finished(cluster, route, ...)` once the body is done, with "ok",
        "stream_broken" or "cancelled".

        `trace`, if given, is told of this request's attempts, failures, backoffs, ejections
        and holds.
        """
        if not self.router.known(cluster):
            raise UnknownCluster(cluster)
        arrival = self._clock.monotonic()
        request = _Request(cluster, key, arrival, arrival, trace=trace)
        if self.meter is not None:
            self.meter.arrived(cluster)
        try:
            return await self._run(request, attempt, repeatable, settle)
        except BaseException:
            if request.in_flight and self.meter is not None:
                self.meter.done(cluster)
            raise
        finally:
            self._unhold(request)

    async def _run(
        self,
        request: _Request,
        attempt: Callable[[RouteEntry, float], Awaitable[T]],
        repeatable: bool,
        settle: Callable[[RouteEntry, T], Awaitable[None]] | None,
    ) -> tuple[RouteEntry, T]:
        cluster = request.cluster
        attempts = 0
        last: UpstreamError | None = None
        while True:
            dead = last is not None and last.outcome == "connect_error"
            route = await self._next_route(request, dead)
            deadline = request.start + self.policy.deadline_s
            left = deadline - self._clock.monotonic()
            if left <= 0:
                # The wait for a replica used up the deadline: not the replica's fault, so no
                # attempt that would be bound to time out against it.
                if last is not None:
                    raise AttemptsExhausted(
                        last, attempts, cluster, repeatable=repeatable
                    ) from last
                raise self._no_ready_replica(cluster, request.arrival)
            first_byte_timeout = min(self.policy.first_byte_timeout_s, left)
            attempts += 1
            if request.trace is not None:
                request.trace.attempt(route, attempts)
            if not request.in_flight and self.meter is not None:
                self.meter.sent(cluster)
            request.in_flight = True
            try:
                result = await self._attempt(request, route, attempt, settle, first_byte_timeout)
                return route, result
            except UpstreamError as exc:
                failure = last = exc
                if request.trace is not None:
                    request.trace.attempt_failed(route, exc, attempts)
            if route not in request.tried:
                request.tried.append(route)
            delay = self.policy.backoff(attempts, self._rng)
            if (
                not self.policy.retryable(failure, repeatable=repeatable)
                or attempts >= self.policy.max_attempts
                or self._clock.monotonic() + delay >= deadline
            ):
                raise AttemptsExhausted(
                    failure, attempts, cluster, repeatable=repeatable
                ) from failure
            if request.trace is not None:
                request.trace.backoff(delay, attempts)
            await asyncio.sleep(delay)

    async def _attempt(
        self,
        request: _Request,
        route: RouteEntry,
        attempt: Callable[[RouteEntry, float], Awaitable[T]],
        settle: Callable[[RouteEntry, T], Awaitable[None]] | None,
        first_byte_timeout: float,
    ) -> T:
        self.router.started(route)
        try:
            # The transport enforces first_byte_timeout itself; this guard holds the deadline
            # even for one that does not.
            guard = asyncio.timeout(first_byte_timeout)
            try:
                async with guard:
                    result = await attempt(route, first_byte_timeout)
            except TimeoutError:
                if not guard.expired():
                    raise
                raise FirstByteTimeout(
                    route.replica_id, f"no response head within {first_byte_timeout:g} s"
                ) from None
            head_at = self._clock.monotonic()
            if settle is not None:
                await settle(route, result)
        except (UpstreamError, DispatchError) as exc:
            ejection = self.router.finished(route, exc.outcome)
            if ejection is not None:
                self.on_ejection(ejection)
                if request.trace is not None:
                    request.trace.ejected(ejection)
            raise
        except BaseException:
            # Cancelled (the client left) or a bug in the attempt: either way the request is no
            # longer outstanding, and neither says anything about the replica's health.
            self.router.finished(route, "cancelled")
            raise
        # Counted once the answer is certain to be passed on (a body that broke in `settle` is
        # retried elsewhere), at the moment its head came.
        if self.meter is not None:
            self.meter.first_byte(request.cluster, head_at - request.arrival)
        if self._holds is not None and request.cold_began is not None:
            self._holds.cold_start(request.cluster, head_at - request.cold_began)
        return result

    async def _next_route(self, request: _Request, dead: bool = False) -> RouteEntry:
        cluster, key = request.cluster, request.key
        while True:
            changed = self._table_changed
            if not self.router.known(cluster):
                raise UnknownCluster(cluster)  # deleted while this request waited
            # Only the placements that failed are excluded: a replica replaced at a new epoch
            # (same id, maybe another node) is a new candidate.
            current = set(self.router.routes(cluster))
            exclude = [r.replica_id for r in request.tried if r in current]
            route = self.router.choose(cluster, key=key, exclude=exclude)
            if route is not None:
                self._unhold(request)
                return route
            cold_start_s = None if current else self.router.cold_start(cluster)
            if cold_start_s is not None:
                # Starting from zero replicas: hold the request for as long as a replica may
                # take to start, rather than the queue timeout, which a cold start outlasts.
                if await self._wait(
                    request, changed, request.arrival + cold_start_s, "cold_start", cold=True
                ):
                    continue
                if (route := self.router.choose(cluster, key=key)) is not None:
                    self._unhold(request)
                    return route  # a change in the very tick the wait ran out
                raise ColdStartTimeout(cluster, cold_start_s, self._retry_after())
            self._end_cold(request)
            give_up = request.start + min(self.policy.queue_timeout_s, self.policy.deadline_s)
            # Every candidate failed once already, the last one refusing connections: its node
            # died and the controller is replacing it. Wait for the table to change (within the
            # queue timeout) before another go at a replica that just failed.
            if exclude and dead and await self._wait(request, changed, give_up, "replacement"):
                continue
            if exclude and (route := self.router.choose(cluster, key=key)) is not None:
                self._unhold(request)
                return route  # another go beats giving up while attempts remain
            if await self._wait(request, changed, give_up, "no_ready_replica"):
                continue
            if (route := self.router.choose(cluster, key=key)) is not None:
                self._unhold(request)
                return route  # a change in the very tick the wait ran out
            raise self._no_ready_replica(cluster, request.arrival)

    async def _wait(
        self,
        request: _Request,
        changed: asyncio.Event,
        until: float,
        reason: str,
        *,
        cold: bool = False,
    ) -> bool:
        """Hold the request until the table changes (True) or `until` (False)."""
        left = until - self._clock.monotonic()
        if left <= 0:
            return False
        self._hold(request, cold)
        trace = request.trace
        if trace is not None:
            trace.hold(reason, left)
        try:
            async with asyncio.timeout(left):
                await changed.wait()
        except TimeoutError:
            if trace is not None:
                trace.hold_ended(reason, False)
            return False
        if trace is not None:
            trace.hold_ended(reason, True)
        return True

    def _hold(self, request: _Request, cold: bool) -> None:
        cluster = request.cluster
        if cold and not request.holding and self.held(cluster) >= self.max_held:
            raise HoldFull(cluster, self.max_held, self._retry_after())
        if cold and request.cold_since is None:
            request.cold_since = self._clock.monotonic()
            if request.cold_began is None:
                request.cold_began = request.cold_since
        if request.holding:
            return
        request.holding = True
        count = self._held[cluster] = self.held(cluster) + 1
        if self.meter is not None:
            # Held or in flight, never both: the autoscaler adds the two up as demand.
            if request.in_flight:
                self.meter.done(cluster)
                request.in_flight = False
            self.meter.hold_began(cluster)
        if self._holds is not None:
            self._holds.held(cluster, count)
            if not self.router.routes(cluster):
                self._holds.held_at_zero(cluster)

    def _unhold(self, request: _Request) -> None:
        self._end_cold(request)
        if not request.holding:
            return
        request.holding = False
        cluster = request.cluster
        count = self.held(cluster) - 1
        if count:
            self._held[cluster] = count
        else:
            del self._held[cluster]
        if self.meter is not None:
            self.meter.hold_ended(cluster)
        if self._holds is not None:
            self._holds.held(cluster, count)

    def _end_cold(self, request: _Request) -> None:
        if request.cold_since is not None:
            request.start += self._clock.monotonic() - request.cold_since
            request.cold_since = None

    def _retry_after(self) -> float:
        return self._rng.uniform(RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S)

    def _no_ready_replica(self, cluster: str, arrival: float) -> NoReadyReplica:
        return NoReadyReplica(cluster, self._clock.monotonic() - arrival, self._retry_after())
