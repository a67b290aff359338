"""gateway/auth.py: the token bucket, the key file, Bearer parsing, admin keys, rate limits."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
from hypothesis import given, strategies as st

from gateway.auth import ANONYMOUS, KeyFileError, KeyRing, Tenant, TokenBucket, hashed


class FakeClock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def monotonic(self) -> float:
        return self.t

    def wall_ns(self) -> int:
        return int(self.t * 1e9)

    def advance(self, seconds: float) -> None:
        self.t += seconds


# -- TokenBucket ---------------------------------------------------------------------------


def test_bucket_allows_the_burst_then_denies_with_the_exact_wait() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=2, burst=3, clock=clock)
    assert [bucket.take() for _ in range(3)] == [0.0, 0.0, 0.0]
    assert bucket.take() == 0.5
    assert bucket.take() == 0.5  # a denial takes nothing
    clock.advance(0.25)
    assert bucket.take() == 0.25
    clock.advance(0.25)
    assert bucket.take() == 0.0
    assert bucket.take() == 0.5


def test_bucket_refills_over_time_but_never_above_burst() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=10, burst=4, clock=clock)
    for _ in range(4):
        assert bucket.take() == 0.0
    clock.advance(0.2)  # two tokens back
    assert bucket.tokens == pytest.approx(2.0)
    clock.advance(3600)  # an hour idle still gives only the burst
    assert [bucket.take() for _ in range(5)] == [0.0, 0.0, 0.0, 0.0, pytest.approx(0.1)]
    clock.advance(3600)
    assert bucket.tokens == 4.0


def test_bucket_denies_until_the_wait_is_up() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=1, burst=1, clock=clock)
    assert bucket.take() == 0.0
    clock.advance(0.999)
    assert bucket.take() == pytest.approx(0.001)
    clock.advance(0.001)
    assert bucket.take() == 0.0


def test_bucket_takes_fractions_and_refuses_more_than_it_can_hold() -> None:
    clock = FakeClock()
    bucket = TokenBucket(rate_per_s=1, burst=2, clock=clock)
    assert bucket.take(1.5) == 0.0
    assert bucket.take(1.0) == 0.5
    assert bucket.take(3.0) == math.inf
    assert bucket.take(0.5) == 0.0
    with pytest.raises(ValueError, match="cannot take -1"):
        bucket.take(-1)


def test_waiting_the_returned_time_is_always_enough() -> None:
    clock = FakeClock(0.1)
    bucket = TokenBucket(rate_per_s=3, burst=1, clock=clock)
    for _ in range(1000):
        wait = bucket.take()
        if wait:
            clock.advance(wait)
            assert bucket.take() == 0.0


def test_a_clock_that_steps_back_neither_adds_nor_removes_tokens() -> None:
    clock = FakeClock(50.0)
    bucket = TokenBucket(rate_per_s=1, burst=2, clock=clock)
    bucket.take()
    clock.advance(-10)
    assert bucket.tokens == 1.0
    clock.advance(10.5)  # back to 50.5: half a token since the last stamp
    assert bucket.tokens == 1.5


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 1), (math.inf, 1), (1, 0), (1, math.nan)])
def test_bucket_rejects_impossible_settings(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst, FakeClock())


@given(
    rate=st.floats(min_value=0.01, max_value=1000),
    burst=st.floats(min_value=1, max_value=100),
    steps=st.lists(
        st.tuples(st.floats(min_value=0, max_value=5), st.integers(min_value=0, max_value=50)),
        max_size=40,
    ),
)
def test_bucket_never_admits_more_than_burst_plus_rate_times_elapsed(
    rate: float, burst: float, steps: list[tuple[float, int]]
) -> None:
    clock = FakeClock(0.0)
    bucket = TokenBucket(rate, burst, clock)
    times: list[float] = []
    admitted: list[int] = []
    for dt, takes in steps:
        clock.advance(dt)
        times.append(clock.t)
        admitted.append(sum(bucket.take() == 0.0 for _ in range(takes)))
    # In every window of time, not only from the start: idle time must not bank tokens.
    for i in range(len(times)):
        for j in range(i, len(times)):
            window = sum(admitted[i : j + 1])
            assert window <= burst + rate * (times[j] - times[i]) + 1e-6, (i, j)


@given(
    rate=st.floats(min_value=0.01, max_value=1000),
    burst=st.floats(min_value=1, max_value=100),
    dts=st.lists(st.floats(min_value=0, max_value=5), max_size=40),
)
def test_a_denial_always_names_a_wait_that_works(
    rate: float, burst: float, dts: list[float]
) -> None:
    clock = FakeClock(0.0)
    bucket = TokenBucket(rate, burst, clock)
    for dt in dts:
        clock.advance(dt)
        while (wait := bucket.take()) == 0.0:
            pass
        assert 0 < wait <= 1 / rate + 1e-9
        clock.advance(wait)
        assert bucket.take() == 0.0


# -- the key file --------------------------------------------------------------------------

GOOD = """
admin_keys = ["gm-admin-1", "gm-both"]

[tenants.acme]
keys = ["gm-acme-1", "gm-acme-2"]
rate_per_s = 20

[tenants.beta]
keys = ["sha256:{beta_digest}", "gm-both"]
rate_per_s = 0.5
burst = 3

[tenants.free]
keys = ["gm-free"]
rate_per_s = 0
"""


def write(tmp_path: Path, text: str, name: str = "keys.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def ring(tmp_path: Path, clock: FakeClock) -> KeyRing:
    text = GOOD.replace("{beta_digest}", hashlib.sha256(b"gm-beta-secret").hexdigest().upper())
    return KeyRing.load(write(tmp_path, text), clock=clock)


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_a_good_file_loads(ring: KeyRing) -> None:
    assert ring.enabled
    assert ring.tenants == (
        Tenant("acme", 20.0, 40.0),  # burst defaults to 2 * rate
        Tenant("beta", 0.5, 3.0),
        Tenant("free", 0.0, 1.0),
    )
    assert ring.authenticate(bearer("gm-acme-1")) == Tenant("acme", 20.0, 40.0)
    assert ring.authenticate(bearer("gm-acme-2")) == Tenant("acme", 20.0, 40.0)
    assert ring.authenticate(bearer("gm-free")) == Tenant("free", 0.0, 1.0)
    assert ring.authenticate(bearer("gm-nobody")) is None


def test_default_burst_is_at_least_one(tmp_path: Path) -> None:
    ring = KeyRing.load(write(tmp_path, '[tenants.slow]\nkeys = ["k"]\nrate_per_s = 0.2\n'))
    assert ring.tenants == (Tenant("slow", 0.2, 1.0),)


def test_plaintext_keys_are_not_kept(tmp_path: Path) -> None:
    ring = KeyRing.load(write(tmp_path, '[tenants.a]\nkeys = ["gm-plain-secret"]\nrate_per_s = 1'))
    state = repr(vars(ring))
    assert "gm-plain-secret" not in state
    assert hashlib.sha256(b"gm-plain-secret").digest() in ring._by_digest


def test_sha256_keys_match_the_key_not_the_digest(ring: KeyRing) -> None:
    assert ring.authenticate(bearer("gm-beta-secret")) == Tenant("beta", 0.5, 3.0)
    digest = hashlib.sha256(b"gm-beta-secret").hexdigest()
    assert ring.authenticate(bearer(digest)) is None
    assert ring.authenticate(bearer(f"sha256:{digest}")) is None


def test_hashed_writes_what_the_file_accepts(tmp_path: Path) -> None:
    line = hashed("gm-k")
    assert line == "sha256:" + hashlib.sha256(b"gm-k").hexdigest()
    ring = KeyRing.load(write(tmp_path, f'[tenants.a]\nkeys = ["{line}"]\nrate_per_s = 1'))
    assert ring.authenticate(bearer("gm-k")) is not None


@pytest.mark.parametrize(
    "header",
    [
        "Bearer gm-acme-1",
        "bearer gm-acme-1",
        "BEARER gm-acme-1",
        "BeArEr gm-acme-1",
        "Bearer    gm-acme-1",
        "Bearer gm-acme-1   ",
        "  Bearer gm-acme-1",
        "Bearer\tgm-acme-1",
    ],
)
def test_bearer_variants_that_authenticate(ring: KeyRing, header: str) -> None:
    tenant = ring.authenticate(header)
    assert tenant is not None
    assert tenant.name == "acme"


@pytest.mark.parametrize(
    "header",
    [
        None,
        "",
        "gm-acme-1",
        "Basic gm-acme-1",
        "Token gm-acme-1",
        "Bearergm-acme-1",
        "Bearer",
        "Bearer ",
        "Bearer gm-acme-1 extra",
        "Bearer GM-ACME-1",
        "Bearer gm-acme-1\ud800",
    ],
)
def test_bearer_variants_that_do_not(ring: KeyRing, header: str | None) -> None:
    assert ring.authenticate(header) is None
    assert not ring.is_admin(header)


def test_admin_and_tenant_keys_are_separate_roles(ring: KeyRing) -> None:
    assert ring.is_admin(bearer("gm-admin-1"))
    assert ring.authenticate(bearer("gm-admin-1")) is None  # an admin key is not a tenant key
    assert not ring.is_admin(bearer("gm-acme-1"))
    assert not ring.is_admin(bearer("gm-beta-secret"))
    # Listed in both: may do both.
    assert ring.is_admin(bearer("gm-both"))
    tenant = ring.authenticate(bearer("gm-both"))
    assert tenant is not None
    assert tenant.name == "beta"


def test_without_admin_keys_no_one_is_admin(tmp_path: Path) -> None:
    ring = KeyRing.load(write(tmp_path, '[tenants.a]\nkeys = ["gm-a"]\nrate_per_s = 1'))
    assert ring.enabled
    assert not ring.is_admin(bearer("gm-a"))
    assert not ring.is_admin(None)


def test_only_admin_keys_is_a_valid_file(tmp_path: Path) -> None:
    ring = KeyRing.load(write(tmp_path, 'admin_keys = ["gm-admin"]'))
    assert ring.enabled
    assert ring.tenants == ()
    assert ring.is_admin(bearer("gm-admin"))
    assert ring.authenticate(bearer("gm-admin")) is None


def test_auth_off_admits_everyone_as_anonymous_and_the_api_is_closed() -> None:
    ring = KeyRing.open(clock=FakeClock())
    assert not ring.enabled
    assert not ring.api_open
    for header in (None, "", "Bearer anything", "garbage"):
        assert ring.authenticate(header) is ANONYMOUS
        assert not ring.is_admin(header)
        assert ring.access(header, "read", "") == "no_key"
    assert all(ring.admit(ANONYMOUS) == 0.0 for _ in range(10_000))


def test_insecure_api_opens_the_control_api_to_everyone() -> None:
    ring = KeyRing.open(insecure_api=True, clock=FakeClock())
    assert ring.api_open
    for header in (None, "", "Bearer anything", "garbage"):
        assert ring.authenticate(header) is ANONYMOUS
        assert ring.is_admin(header)
        assert ring.access(header, "all", "") == "ok"


def test_from_mapping_matches_the_file_and_its_errors_have_no_path() -> None:
    ring = KeyRing.from_mapping(
        {"tenants": {"a": {"keys": ["gm-a"], "rate_per_s": 2}}}, clock=FakeClock()
    )
    assert ring.authenticate(bearer("gm-a")) == Tenant("a", 2.0, 4.0)
    with pytest.raises(KeyFileError) as caught:
        KeyRing.from_mapping({"tenants": {"a": {"keys": ["gm-a"], "rate_per_s": -2}}})
    assert str(caught.value) == "tenants.a.rate_per_s: must be >= 0"
    assert caught.value.path == ""


ACME = '[tenants.acme]\nkeys = ["gm-a"]\n'
NO_KEYS = (
    "no keys: give admin_keys, an [admins.<name>] or a [tenants.<name>] table "
    "(run without a key file to turn auth off)"
)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (ACME + "rate_per_s = -1", "tenants.acme.rate_per_s: must be >= 0"),
        (ACME, "tenants.acme.rate_per_s: required (0 = unlimited)"),
        (ACME + 'rate_per_s = "10"', "tenants.acme.rate_per_s: must be a number"),
        (ACME + "rate_per_s = true", "tenants.acme.rate_per_s: must be a number"),
        (ACME + "rate_per_s = inf", "tenants.acme.rate_per_s: must be a finite number"),
        (ACME + "rate_per_s = nan", "tenants.acme.rate_per_s: must be a finite number"),
        (ACME + "rate_per_s = 1\nburst = 0.5", "tenants.acme.burst: must be >= 1"),
        (ACME + "rate_per_s = 1\nburst = -3", "tenants.acme.burst: must be >= 1"),
        (
            ACME + "rate_per_s = 1\nrate = 2",
            "tenants.acme.rate: unknown field (expected keys, rate_per_s, burst, clusters, "
            "tokens_per_min, token_burst)",
        ),
        ("[tenants.acme]\nrate_per_s = 1", "tenants.acme.keys: required (one or more keys)"),
        (
            "[tenants.acme]\nkeys = []\nrate_per_s = 1",
            "tenants.acme.keys: must hold at least one key",
        ),
        (
            '[tenants.acme]\nkeys = "gm-a"\nrate_per_s = 1',
            "tenants.acme.keys: must be a list of strings",
        ),
        (
            "[tenants.acme]\nkeys = [1]\nrate_per_s = 1",
            "tenants.acme.keys: must be a list of strings",
        ),
        (
            '[tenants.acme]\nkeys = ["gm-a", ""]\nrate_per_s = 1',
            "tenants.acme.keys[1]: must not be empty",
        ),
        (
            '[tenants.acme]\nkeys = ["gm-a "]\nrate_per_s = 1',
            "tenants.acme.keys[0]: must not contain whitespace",
        ),
        (
            '[tenants.acme]\nkeys = ["sha256:abc"]\nrate_per_s = 1',
            "tenants.acme.keys[0]: sha256: must be followed by 64 hex digits",
        ),
        (
            ACME + 'rate_per_s = 1\n[tenants.beta]\nkeys = ["gm-b", "gm-a"]\nrate_per_s = 1',
            "tenants.beta.keys[1]: duplicate key (also tenants.acme.keys[0])",
        ),
        (
            ACME + f'rate_per_s = 1\n[tenants.beta]\nkeys = ["{hashed("gm-a")}"]\nrate_per_s = 1',
            "tenants.beta.keys[0]: duplicate key (also tenants.acme.keys[0])",
        ),
        (
            '[tenants.acme]\nkeys = ["gm-a", "gm-a"]\nrate_per_s = 1',
            "tenants.acme.keys[1]: duplicate key (also tenants.acme.keys[0])",
        ),
        ('admin_keys = ["x", "x"]', "admin_keys[1]: duplicate key (also admin_keys[0])"),
        ('admin_keys = "x"', "admin_keys: must be a list of strings"),
        ('admin_keys = [""]', "admin_keys[0]: must not be empty"),
        ('admin_key = ["x"]', "admin_key: unknown field (expected admin_keys, admins, tenants)"),
        ("tenants = 3", "tenants: must be a table of [tenants.<name>]"),
        ("[tenants]\nacme = 3", "tenants.acme: must be a table"),
        (
            '[tenants.""]\nkeys = ["k"]\nrate_per_s = 1',
            "tenants.: the tenant name must not be empty",
        ),
        ("", NO_KEYS),
        ("admin_keys = []\n[tenants]", NO_KEYS),
    ],
)
def test_each_bad_file_gives_one_line_naming_the_field(
    tmp_path: Path, text: str, message: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(KeyFileError) as caught:
        KeyRing.load(path)
    assert str(caught.value) == f"{path}: {message}"
    assert caught.value.path == str(path)
    assert "\n" not in str(caught.value)
    assert isinstance(caught.value, ValueError)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError) as caught:
        KeyRing.load(tmp_path / "nope.toml")
    assert str(caught.value) == f"{tmp_path / 'nope.toml'}: no such file"


def test_unreadable_file(tmp_path: Path) -> None:
    with pytest.raises(KeyFileError) as caught:
        KeyRing.load(tmp_path)
    assert str(caught.value) == f"{tmp_path}: cannot read: is a directory"


def test_invalid_toml_is_one_line(tmp_path: Path) -> None:
    path = write(tmp_path, 'admin_keys = ["x"\n\n[tenants.acme\n')
    with pytest.raises(KeyFileError) as caught:
        KeyRing.load(path)
    assert str(caught.value).startswith(f"{path}: not valid TOML: ")
    assert "\n" not in str(caught.value)


def test_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_bytes(b'admin_keys = ["\xff"]')
    with pytest.raises(KeyFileError) as caught:
        KeyRing.load(path)
    assert str(caught.value) == f"{path}: not UTF-8 text"


# -- admission -----------------------------------------------------------------------------


def test_admit_limits_each_tenant_with_its_own_bucket(ring: KeyRing, clock: FakeClock) -> None:
    beta = ring.authenticate(bearer("gm-beta-secret"))
    acme = ring.authenticate(bearer("gm-acme-1"))
    assert beta is not None
    assert acme is not None
    assert [ring.admit(beta) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert ring.admit(beta) == 2.0  # one token per 2 s
    # Acme is untouched by beta's exhaustion, across both of its keys.
    acme_2 = ring.authenticate(bearer("gm-acme-2"))
    assert acme_2 is not None
    admitted = [ring.admit(acme if i % 2 else acme_2) for i in range(41)]
    assert admitted[:40] == [0.0] * 40
    assert admitted[40] == pytest.approx(0.05)
    assert ring.admit(beta) == 2.0
    clock.advance(2.0)
    assert ring.admit(beta) == 0.0
    assert ring.admit(beta) == 2.0


def test_unlimited_tenant_is_always_admitted(ring: KeyRing) -> None:
    free = ring.authenticate(bearer("gm-free"))
    assert free is not None
    assert all(ring.admit(free) == 0.0 for _ in range(10_000))


async def test_the_default_clock_is_the_running_loop(tmp_path: Path) -> None:
    ring = KeyRing.load(write(tmp_path, '[tenants.a]\nkeys = ["gm-a"]\nrate_per_s = 1\nburst = 1'))
    tenant = ring.authenticate(bearer("gm-a"))
    assert tenant is not None
    assert ring.admit(tenant) == 0.0
    assert 0.9 < ring.admit(tenant) <= 1.0


def test_a_tenant_may_be_confined_to_some_clusters(tmp_path: Path) -> None:
    path = tmp_path / "keys.toml"
    path.write_text('[tenants.acme]\nkeys = ["gm-a"]\nrate_per_s = 0\nclusters = ["llama"]\n')
    tenant = KeyRing.load(path).authenticate("Bearer gm-a")
    assert tenant is not None and tenant.reaches("llama") and not tenant.reaches("other")
    path.write_text('[tenants.acme]\nkeys = ["gm-a"]\nrate_per_s = 0\nclusters = []\n')
    with pytest.raises(KeyFileError, match=r"tenants\.acme\.clusters: must be a non-empty list"):
        KeyRing.load(path)
