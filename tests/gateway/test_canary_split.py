"""A canary's split (RoutingUpdate.splits): the router keeps it, the dispatcher draws each
request's cluster from its own random source, and the proxy serves, counts and logs the
request under the cluster that took it (docs/gateway.md, "A canary's share")."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from events.contract.messages import CanarySplit, RouteEntry, RoutingUpdate
from gateway.auth import ANONYMOUS, KeyRing, Tenant
from gateway.dispatch import Dispatcher
from gateway.instruments import Instruments
from gateway.load import LoadMeter
from gateway.proxy import Proxy, ProxySettings
from gateway.reply import FlowControlled, Headers
from gateway.retry import RetryPolicy
from gateway.router import Router
from gateway.transport.base import ConnectFailed, UpstreamRequest
from runtime.real_env import LoopClock
from tests.factories import ManualClock

CANARY = "llama-canary"
TEN = {"llama": CanarySplit(to=CANARY, weight=10)}


def entry(replica_id: str, epoch: int = 1) -> RouteEntry:
    return RouteEntry(replica_id=replica_id, node_id=f"node-{replica_id}", address="x", epoch=epoch)


def table(
    position: int,
    splits: dict[str, CanarySplit] | None = None,
    *,
    canary: Sequence[str] = ("llama-canary-0",),
    clusters: tuple[str, ...] = ("llama", CANARY),
) -> RoutingUpdate:
    routes: dict[str, tuple[RouteEntry, ...]] = {"llama": (entry("llama-0"), entry("llama-1"))}
    if canary:
        routes[CANARY] = tuple(entry(r) for r in canary)
    return RoutingUpdate(position=position, routes=routes, clusters=clusters, splits=splits or {})


def dispatcher(seed: int = 1, update: RoutingUpdate | None = None) -> Dispatcher:
    clock = ManualClock()
    router = Router(clock, random.Random(seed))
    router.apply(update or table(1, TEN))
    return Dispatcher(router, RetryPolicy(), clock, random.Random(seed + 1))


def draws(d: Dispatcher, cluster: str = "llama", n: int = 10_000) -> list[str]:
    return [d.pick_cluster(cluster) for _ in range(n)]


# -- the router keeps the split ---------------------------------------------------------------


def test_a_change_of_splits_alone_is_a_table_change() -> None:
    router = Router(ManualClock(), random.Random(1))
    assert router.apply(table(1))
    assert router.split("llama") is None
    assert not router.apply(table(2))  # the periodic re-send
    assert router.apply(table(3, TEN))
    assert router.split("llama") == TEN["llama"]
    assert not router.apply(table(4, TEN))
    assert router.apply(table(5, {"llama": CanarySplit(to=CANARY, weight=50)}))
    assert router.apply(table(6))
    assert router.split("llama") is None


def test_a_split_to_or_from_an_unknown_cluster_is_dropped() -> None:
    router = Router(ManualClock(), random.Random(1))
    router.apply(table(1, {**TEN, "mistral": CanarySplit(to=CANARY, weight=10)}))
    assert router.split("mistral") is None  # no such cluster
    router.apply(table(2, TEN, clusters=("llama",), canary=()))
    assert router.split("llama") is None  # the canary's cluster is gone


def test_a_canary_without_a_ready_replica_takes_nothing() -> None:
    router = Router(ManualClock(), random.Random(1))
    router.apply(table(1, TEN, canary=()))
    assert router.split("llama") is None
    assert router.split(CANARY) is None


# -- the dispatcher draws ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_ten_percent_over_ten_thousand_draws(seed: int) -> None:
    counts = Counter(draws(dispatcher(seed)))
    assert set(counts) == {"llama", CANARY}
    # Binomial(10000, 0.1): standard deviation 30; 5 of them either way.
    assert 850 <= counts[CANARY] <= 1150, counts


@pytest.mark.parametrize("weight", [1, 50, 99])
def test_the_share_follows_the_weight(weight: int) -> None:
    split = {"llama": CanarySplit(to=CANARY, weight=weight)}
    share = Counter(draws(dispatcher(7, table(1, split))))[CANARY] / 10_000
    assert abs(share - weight / 100) < 0.025


def test_the_draw_is_deterministic_for_a_seed() -> None:
    assert draws(dispatcher(5), n=500) == draws(dispatcher(5), n=500)
    assert draws(dispatcher(5), n=500) != draws(dispatcher(6), n=500)


def test_no_ready_canary_replica_sends_everything_to_the_cluster() -> None:
    d = dispatcher(update=table(1, TEN, canary=()))
    assert set(draws(d, n=1000)) == {"llama"}


def test_a_removed_split_sends_everything_to_the_cluster() -> None:
    d = dispatcher()
    assert CANARY in draws(d, n=1000)
    d.router.apply(table(2))  # promoted or aborted: the split is gone
    assert set(draws(d, n=1000)) == {"llama"}


def test_no_draw_without_a_split() -> None:
    """A cluster without a canary costs its dispatcher no draw: every other seeded sequence
    (backoff, Retry-After) stays as it was."""

    class Counting(random.Random):
        calls = 0

        def random(self) -> float:
            Counting.calls += 1
            return super().random()

    clock = ManualClock()
    router = Router(clock, random.Random(1))
    router.apply(table(1, TEN, canary=()))
    d = Dispatcher(router, RetryPolicy(), clock, Counting(2))
    assert {d.pick_cluster("llama"), d.pick_cluster(CANARY), d.pick_cluster("nope")} == {
        "llama",
        CANARY,
        "nope",
    }
    assert Counting.calls == 0


def test_naming_the_canary_reaches_the_canary() -> None:
    assert set(draws(dispatcher(), CANARY, n=1000)) == {CANARY}


async def test_retries_stay_within_the_chosen_cluster() -> None:
    clock = LoopClock()
    router = Router(clock, random.Random(1))
    router.apply(table(1, TEN, canary=("llama-canary-0", "llama-canary-1")))
    d = Dispatcher(router, RetryPolicy(), clock, random.Random(2))
    tried: list[str] = []

    async def attempt(route: RouteEntry, first_byte_timeout: float) -> str:
        tried.append(route.replica_id)
        if len(tried) == 1:
            raise ConnectFailed(route.replica_id, "scripted")
        return "ok"

    route, _ = await d.run(CANARY, attempt)
    assert len(tried) == 2 and all(r.startswith("llama-canary-") for r in tried)
    d.finished(CANARY, route, "ok")


# -- the proxy: served, counted and logged under the cluster that took it --------------------


class Answer:
    status = 200
    headers: Sequence[tuple[str, str]] = (("Content-Type", "application/json"),)
    complete = True

    def __init__(self, replica_id: str) -> None:
        self.body = f'{{"replica": "{replica_id}"}}'.encode()

    def take_buffered(self) -> bytes:
        return self.body

    async def chunks(self) -> AsyncIterator[bytes]:
        empty: tuple[bytes, ...] = ()
        for chunk in empty:
            yield chunk

    async def aclose(self) -> None:
        return None


class Replicas:
    name = "fake"

    def __init__(self) -> None:
        self.served: list[str] = []

    async def open(self, route: RouteEntry, request: UpstreamRequest) -> Answer:
        self.served.append(route.replica_id)
        return Answer(route.replica_id)

    async def close(self) -> None:
        return None


class Inbound:
    method = "POST"

    def header(self, lower_name: str) -> str | None:
        return None

    def header_items(self) -> Headers:
        return []


class Sink:
    def __init__(self) -> None:
        self.status = 0

    def send(self, status: int, headers: Headers, body: bytes) -> None:
        self.status = status

    async def start(self, status: int, headers: Headers, first: bytes = b"") -> None:
        raise AssertionError("a whole answer")

    async def write(self, data: bytes) -> None:
        raise AssertionError("a whole answer")

    async def end(self) -> None:
        raise AssertionError("a whole answer")

    def abort(self) -> None:
        raise AssertionError("a whole answer")

    def client_gone(self) -> bool:
        return False

    def relay_writer(self, source: FlowControlled) -> Callable[[bytes], None] | None:
        return None

    def relay_done(self) -> None:
        pass


class Lines:
    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []

    def request(self, fields: dict[str, Any]) -> None:
        self.lines.append(fields)

    def flush(self) -> None:
        pass


async def test_the_proxy_serves_counts_and_logs_under_the_cluster_that_took_it() -> None:
    clock = LoopClock()
    router = Router(clock, random.Random(1))
    router.apply(table(1, {"llama": CanarySplit(to=CANARY, weight=30)}))
    meter = LoadMeter(clock)
    d = Dispatcher(router, RetryPolicy(), clock, random.Random(2), meter=meter)
    registry = CollectorRegistry()
    replicas, lines = Replicas(), Lines()
    proxy = Proxy(
        router,
        d,
        replicas,
        Instruments(registry, router),
        KeyRing.open(insecure_api=True),
        ProxySettings(gateway_id="gw-1"),
        log=None,
        access_log=lines,
    )

    async def ask(model: str, tenant: Tenant = ANONYMOUS) -> int:
        sink = Sink()
        body = f'{{"model": "{model}", "messages": []}}'.encode()
        await proxy.serve_openai(Inbound(), sink, tenant, "/v1/chat/completions", body)
        return sink.status

    statuses = [await ask("llama") for _ in range(400)]
    assert set(statuses) == {200}
    by_cluster = Counter(line["cluster"] for line in lines.lines)
    assert set(by_cluster) == {"llama", CANARY}
    assert 80 <= by_cluster[CANARY] <= 160  # 30% of 400, give or take 4 deviations
    for line in lines.lines:  # the replica that answered is the logged cluster's
        assert str(line["replica"]).startswith(f"{line['cluster']}-")
    counted = {
        cluster: registry.get_sample_value(
            "gpumesh_gateway_requests_total", {"cluster": cluster, "status": "200"}
        )
        for cluster in ("llama", CANARY)
    }
    assert counted == {c: float(n) for c, n in by_cluster.items()}
    report = meter.report("gw-1")  # every request done: arrivals under the cluster served
    assert set(report.clusters) == {"llama", CANARY}
    assert all(load.in_flight == 0 for load in report.clusters.values())

    # A key that reaches only `llama` is served by its canary's share too; naming the canary
    # needs a key that reaches it, as any cluster does.
    only_llama = Tenant("acme", 0.0, 1.0, frozenset({"llama"}))
    assert {await ask("llama", only_llama) for _ in range(50)} == {200}
    assert await ask(CANARY, only_llama) == 404
    lines.lines.clear()
    assert await ask(CANARY) == 200
    assert lines.lines[-1]["cluster"] == CANARY

    # Promoted or aborted: the split is gone, and every request is the cluster's again.
    router.apply(table(2))
    lines.lines.clear()
    for _ in range(100):
        await ask("llama")
    assert {line["cluster"] for line in lines.lines} == {"llama"}
