"""A tenant's token budget and its limits shared between gateways (gateway/auth.py TenantQuota,
gateway/quota_share.py), on a clock of the test's own."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from events.contract import subjects
from events.contract.messages import QuotaReport, TenantDemand
from gateway.auth import KeyFileError, KeyRing, TokenBucket
from gateway.quota_share import MIN_WEIGHT_RPS, QuotaSharer
from runtime.env import Msg


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def wall_ns(self) -> int:
        return int(self.now * 1e9)


def ring(clock: Clock, **tenant: object) -> KeyRing:
    table = {"keys": ["gm-acme"], "rate_per_s": 0, **tenant}
    return KeyRing.from_mapping({"tenants": {"acme": table}}, clock=clock)  # type: ignore[arg-type]


def test_a_token_budget_admits_while_above_zero_and_charges_after() -> None:
    clock = Clock()
    keys = ring(clock, tokens_per_min=600, token_burst=20)  # 10 tokens a second
    acme = keys.authenticate("Bearer gm-acme")
    assert acme is not None and acme.tokens_per_min == 600
    admitted = 0
    while keys.admit(acme) == 0.0:
        admitted += 1
        keys.charge(acme, 3)  # each answer used 3 tokens
    # 20 tokens: 7 answers of 3, the last taking the balance to -1: over by less than one.
    assert admitted == 7
    assert keys.quota(acme).spent
    wait = keys.admit(acme)
    assert wait == pytest.approx(0.2, abs=1e-6)  # 2 tokens short of one, at 10 a second
    clock.now += wait
    assert keys.admit(acme) == 0.0


def test_rate_and_budget_both_hold() -> None:
    clock = Clock()
    keys = ring(clock, rate_per_s=1, burst=1, tokens_per_min=6000)
    acme = keys.authenticate("Bearer gm-acme")
    assert acme is not None
    assert keys.admit(acme) == 0.0
    assert keys.admit(acme) == pytest.approx(1.0)  # the request rate, not the budget
    assert not keys.quota(acme).spent


@pytest.mark.parametrize(
    ("tenant", "message"),
    [
        ({"tokens_per_min": -1}, "tenants.acme.tokens_per_min: must be >= 0 (0 = no budget)"),
        ({"token_burst": 5}, "tenants.acme.token_burst: only with tokens_per_min"),
        ({"tokens_per_min": 60, "token_burst": 0}, "tenants.acme.token_burst: must be >= 1"),
        ({"tokens_per_min": "lots"}, "tenants.acme.tokens_per_min: must be a number"),
    ],
)
def test_bad_budgets_are_one_line(tenant: dict[str, object], message: str) -> None:
    with pytest.raises(KeyFileError, match="^" + message.replace("(", r"\(").replace(")", r"\)")):
        ring(Clock(), **tenant)


def test_a_bucket_resized_keeps_what_it_holds_up_to_its_new_burst() -> None:
    clock = Clock()
    bucket = TokenBucket(10, 10, clock)
    bucket.resize(5, 4)
    assert bucket.tokens == 4
    bucket.debit(6)
    assert bucket.until_positive() == pytest.approx(3 / 5, abs=1e-6)  # from -2 to 1


class Bus:
    """Published reports, for the test to hand to the other sharer."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def publish(self, subject: str, data: bytes, **_: object) -> None:
        assert subject == subjects.QUOTA
        self.sent.append(data)


def report(gateway: str, **tenants: tuple[float, float]) -> Msg:
    """A peer's report: tenant -> (requests per second, share held)."""
    body = QuotaReport(
        gateway_id=gateway,
        tenants={
            n: TenantDemand(requests_per_s=rps, share=share) for n, (rps, share) in tenants.items()
        },
    )
    return Msg(subject=subjects.QUOTA, data=msgspec.json.encode(body))


def test_shares_follow_the_demand_capped_at_the_rate() -> None:
    async def scenario() -> None:
        clock = Clock()
        keys = ring(clock, rate_per_s=20, burst=10)
        acme = keys.authenticate("Bearer gm-acme")
        assert acme is not None
        bus = Bus()
        sharer = QuotaSharer(bus, keys, clock, "gw-a", log=None)  # type: ignore[arg-type]
        for _ in range(30):  # 30 requests asked here over the second: capped at the rate, 20
            keys.admit(acme)
        sharer.heard(report("gw-b", acme=(10.0, 0.3)))
        sharer.heard(report("gw-a", acme=(999.0, 1.0)))  # our own, back from NATS: ignored
        clock.now = 1.0
        await sharer.tick()
        quota = keys.quota(acme)
        assert quota.share == pytest.approx(20 / 30)  # down to the target at once
        assert quota.requests is not None and quota.requests.tokens <= 10 * 20 / 30
        sent = msgspec.json.decode(bus.sent[-1], type=QuotaReport)
        assert sent.gateway_id == "gw-a"
        assert sent.tenants["acme"] == TenantDemand(requests_per_s=30.0, share=quota.share)
        # gw-b gone quiet for longer than STALE_AFTER_S: up into the room nobody holds.
        clock.now = 5.0
        keys.admit(acme)
        await sharer.tick()
        assert quota.share == 1.0
        # Idle here, busy there: down to a floor, so the first requests here still go.
        sharer.heard(report("gw-b", acme=(40.0, 0.0)))
        clock.now = 6.0
        await sharer.tick()
        assert quota.share == pytest.approx(MIN_WEIGHT_RPS / (MIN_WEIGHT_RPS + 20.0))

    asyncio.run(scenario())


def test_a_share_rises_only_into_room_nobody_holds_split_among_those_rising() -> None:
    async def scenario() -> None:
        clock = Clock()
        keys = ring(clock, rate_per_s=20, burst=10)
        acme = keys.authenticate("Bearer gm-acme")
        assert acme is not None
        sharer = QuotaSharer(Bus(), keys, clock, "gw-a", log=None)  # type: ignore[arg-type]
        keys.quota(acme).set_share(0.3)
        for _ in range(25):
            keys.admit(acme)
        # Both busy (capped weights: target 1/2 each), gw-b holding 0.3 too: 0.4 is free, and
        # each of the two takes at most half of it, so together they never pass one.
        sharer.heard(report("gw-b", acme=(25.0, 0.3)))
        clock.now = 1.0
        await sharer.tick()
        assert keys.quota(acme).share == pytest.approx(0.5)
        # gw-b took the whole target before we could: no room, no rise.
        keys.quota(acme).set_share(0.2)
        for _ in range(25):
            keys.admit(acme)
        sharer.heard(report("gw-b", acme=(25.0, 0.8)))
        clock.now = 2.0
        await sharer.tick()
        assert keys.quota(acme).share == pytest.approx(0.2)

    asyncio.run(scenario())


def test_idle_tenants_are_reported_and_new_ones_start_with_a_share_of_the_gateways_heard() -> None:
    async def scenario() -> None:
        clock = Clock()
        keys = ring(clock, rate_per_s=20, burst=10)
        bus = Bus()
        sharer = QuotaSharer(bus, keys, clock, "gw-a", log=_Log())  # type: ignore[arg-type]
        sharer.heard(report("gw-b", acme=(0.0, 1 / 3)))
        sharer.heard(report("gw-c", acme=(0.0, 1 / 3)))
        sharer.heard(Msg(subject=subjects.QUOTA, data=b"not json"))
        assert sharer.peers == ["gw-b", "gw-c"]
        clock.now = 1.0
        await sharer.tick()
        sent = msgspec.json.decode(bus.sent[-1], type=QuotaReport)
        assert sent.tenants["acme"].requests_per_s == 0.0  # idle, and listed
        acme = keys.authenticate("Bearer gm-acme")
        assert acme is not None
        assert keys.quota(acme).share == pytest.approx(1 / 3)

    asyncio.run(scenario())


class _Log:
    def warning(self, event: str, **kw: object) -> None:
        assert event == "quota_report_undecodable"


def test_a_small_share_still_admits_one_request_at_a_time() -> None:
    clock = Clock()
    keys = ring(clock, rate_per_s=20, burst=10, tokens_per_min=600, token_burst=20)
    acme = keys.authenticate("Bearer gm-acme")
    assert acme is not None
    quota = keys.quota(acme)
    quota.set_share(0.02)  # a bucket of 0.2 requests and 0.4 tokens: never one whole
    assert keys.admit(acme) == 0.0
    wait = keys.admit(acme)
    assert wait == pytest.approx(1 / (20 * 0.02))  # finite: one at this share of the rate
    clock.now += wait
    assert keys.admit(acme) == 0.0


def test_an_answer_ending_after_a_reload_does_not_bring_the_old_limits_back(
    tmp_path: object,
) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "keys.toml"
    path.write_text('[tenants.acme]\nkeys = ["gm-acme"]\nrate_per_s = 0\ntokens_per_min = 600\n')
    clock = Clock()
    keys = KeyRing.load(path, clock=clock)  # type: ignore[arg-type]
    old = keys.authenticate("Bearer gm-acme")
    assert old is not None and keys.admit(old) == 0.0  # admitted, its answer still running
    path.write_text('[tenants.acme]\nkeys = ["gm-acme"]\nrate_per_s = 0\ntokens_per_min = 60000\n')
    assert keys.reload()
    keys.charge(old, 100)  # the answer admitted before the reload ends
    assert "acme" not in keys.quotas  # not made again with the old limits
    new = keys.authenticate("Bearer gm-acme")
    assert new is not None and keys.admit(new) == 0.0
    assert keys.quotas["acme"].tenant.tokens_per_min == 60000
    path.write_text('[tenants.beta]\nkeys = ["gm-beta"]\nrate_per_s = 1\n')
    assert keys.reload()
    keys.charge(new, 5)  # a tenant removed: nothing comes back
    assert "acme" not in keys.quotas


class _Said:
    def __init__(self) -> None:
        self.errors: list[tuple[str, dict[str, object]]] = []

    def error(self, event: str, **kw: object) -> None:
        self.errors.append((event, kw))


def test_two_gateways_given_one_id_are_told_apart_said_so_and_share_as_two() -> None:
    async def scenario() -> None:
        clock = Clock()
        keys = ring(clock, rate_per_s=20, burst=10)
        acme = keys.authenticate("Bearer gm-acme")
        assert acme is not None
        bus, said = Bus(), _Said()
        sharer = QuotaSharer(bus, keys, clock, "gw-a", log=said)  # type: ignore[arg-type]
        clock.now = 1.0
        await sharer.tick()
        ours = msgspec.json.decode(bus.sent[-1], type=QuotaReport)
        assert ours.instance == f"{0:x}"  # the wall clock's ns when it was made
        sharer.heard(Msg(subject=subjects.QUOTA, data=bus.sent[-1]))  # ours, back: skipped
        assert sharer.peers == [] and said.errors == []
        # Another process with the same --gateway-id, busy with the same tenant.
        twin = QuotaReport(
            gateway_id="gw-a",
            instance="5f",
            tenants={"acme": TenantDemand(requests_per_s=20.0, share=1.0)},
        )
        for _ in range(2):
            sharer.heard(Msg(subject=subjects.QUOTA, data=msgspec.json.encode(twin)))
        assert sharer.peers == ["gw-a#5f"]
        assert [event for event, _ in said.errors] == ["gateway_id_shared"]  # once
        for _ in range(25):
            keys.admit(acme)
        clock.now = 2.0
        await sharer.tick()
        assert keys.quota(acme).share == pytest.approx(0.5)  # not the whole limit each
        # An older gateway sends no instance: not told apart (it is taken for our own).
        older = QuotaReport(gateway_id="gw-a", tenants={})
        sharer.heard(Msg(subject=subjects.QUOTA, data=msgspec.json.encode(older)))
        assert sharer.peers == ["gw-a#5f"]

    asyncio.run(scenario())
