"""API keys per tenant, a token-bucket rate limit per tenant, and admin keys for the control API.

The key file (`gpumesh gateway --keys keys.toml`) is what operators write:

    # Admin keys may call /api/v1 (the control API). They are not tenant keys: a key listed
    # here and under a tenant may do both.
    admin_keys = ["gm-admin-3f9c..."]

    [tenants.acme]
    keys = ["gm-7d1e...", "sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"]
    rate_per_s = 20      # requests per second, sustained; 0 = unlimited (required)
    burst = 40           # optional: how many may come at once; default max(1, 2 * rate_per_s)
    clusters = ["llama"] # optional: the only clusters its keys reach (default: every cluster)

    [tenants.beta]
    keys = ["gm-a04b..."]
    rate_per_s = 0

Keys:
  - A client sends `Authorization: Bearer <key>` (the scheme is case-insensitive).
  - A key is any non-empty string without whitespace. One that starts with `sha256:` is the
    SHA-256 of the real key, in hex, so the file need not hold plaintext:
        printf %s "$KEY" | sha256sum
        python -c 'import sys, gateway.auth as a; print(a.hashed(sys.argv[1]))' "$KEY"
  - Each key belongs to one tenant; the same key twice (in plaintext or hashed) is an error.
  - Only SHA-256 digests are kept after loading; a request's key is hashed and looked up by its
    digest, so the comparison reveals nothing useful about the stored keys through timing.

Limits are per tenant (all of its keys share one bucket) and per gateway process.

No key file means auth is off: every request is admitted as the tenant "anonymous", without a
rate limit, and the control API is open too. That is a local development stack, and the gateway
warns about it at start. With a key file, the control API needs one of `admin_keys`; a file
without any refuses every control call. A file must hold at least one key: an empty one is an
error rather than a silent "auth off".

Every problem with the file is a `KeyFileError`, one line: `keys.toml: tenants.acme.rate_per_s:
must be >= 0`.
"""

from __future__ import annotations

import math
import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from hashlib import sha256
from typing import Any

from runtime.env import Clock
from runtime.real_env import LoopClock


class KeyFileError(ValueError):
    """One line: `path: field: problem` (no path for a key ring built from a mapping)."""

    def __init__(self, reason: str, path: str = "") -> None:
        self.reason = reason
        self.path = path
        super().__init__(f"{path}: {reason}" if path else reason)


@dataclass(frozen=True, slots=True)
class Tenant:
    name: str
    rate_per_s: float  # 0: unlimited
    burst: float
    clusters: frozenset[str] = frozenset()  # the clusters its keys reach; empty: every one

    def reaches(self, cluster: str) -> bool:
        return not self.clusters or cluster in self.clusters


ANONYMOUS = Tenant("anonymous", 0.0, 1.0)
"""Every client, when auth is off."""


class TokenBucket:
    """`burst` tokens at most, refilled at `rate_per_s`; refilled lazily when taken from."""

    # Float slack, so that waiting exactly the retry-after that take() returned is enough.
    _EPSILON = 1e-9

    __slots__ = ("_burst", "_clock", "_rate", "_stamp", "_tokens")

    def __init__(self, rate_per_s: float, burst: float, clock: Clock) -> None:
        if not (rate_per_s > 0 and math.isfinite(rate_per_s)):
            raise ValueError(f"rate_per_s: must be a finite number > 0, got {rate_per_s}")
        if not (burst > 0 and math.isfinite(burst)):
            raise ValueError(f"burst: must be a finite number > 0, got {burst}")
        self._rate = float(rate_per_s)
        self._burst = float(burst)
        self._clock = clock
        self._tokens = self._burst
        self._stamp = clock.monotonic()

    @property
    def tokens(self) -> float:
        """Tokens available now (refills first)."""
        self._refill()
        return self._tokens

    def take(self, n: float = 1.0) -> float:
        """0.0 when `n` tokens were available (and are now taken), else the seconds until they
        will be (nothing taken). math.inf when `n` is more than the bucket holds."""
        if n < 0:
            raise ValueError(f"cannot take {n} tokens")
        now = self._clock.monotonic()
        elapsed = now - self._stamp
        tokens = self._tokens
        if elapsed > 0:
            tokens += elapsed * self._rate
            if tokens > self._burst:
                tokens = self._burst
            self._tokens = tokens
            self._stamp = now
        if tokens + self._EPSILON >= n:
            self._tokens = tokens - n
            return 0.0
        if n > self._burst:
            return math.inf
        return (n - tokens) / self._rate

    def _refill(self) -> None:
        now = self._clock.monotonic()
        elapsed = now - self._stamp
        if elapsed > 0:
            self._tokens = min(self._burst, self._tokens + elapsed * self._rate)
            self._stamp = now


def hashed(key: str) -> str:
    """What to write in the key file instead of `key`: `sha256:<hex>`."""
    return "sha256:" + sha256(key.encode()).hexdigest()


class KeyRing:
    """Who a request is, whether it may call the control API, and whether its tenant is over
    its rate limit. Build it with `load`, `from_mapping` or `open`.

    `clock` times the rate limits; by default the running event loop's clock, so `admit` must
    be called from within the loop (where the gateway calls it) and a simulator's virtual loop
    stays in charge.
    """

    def __init__(
        self,
        tenants: Mapping[bytes, Tenant],
        admin_digests: frozenset[bytes],
        *,
        enabled: bool,
        clock: Clock | None = None,
    ) -> None:
        self._by_digest = dict(tenants)
        self._admin = admin_digests
        self._enabled = enabled
        self._clock = clock or LoopClock()
        self._buckets: dict[str, TokenBucket] = {}

    @classmethod
    def open(cls, *, clock: Clock | None = None) -> KeyRing:
        """Auth off: every request is the anonymous tenant, unlimited, and admin."""
        return cls({}, frozenset(), enabled=False, clock=clock)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, clock: Clock | None = None) -> KeyRing:
        where = os.fspath(path)
        try:
            with open(where, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            raise KeyFileError("no such file", where) from None
        except IsADirectoryError:
            raise KeyFileError("cannot read: is a directory", where) from None
        except OSError as exc:
            raise KeyFileError(f"cannot read: {exc.strerror or exc}", where) from None
        try:
            raw = tomllib.loads(data.decode("utf-8"))
        except UnicodeDecodeError:
            raise KeyFileError("not UTF-8 text", where) from None
        except tomllib.TOMLDecodeError as exc:
            raise KeyFileError(f"not valid TOML: {_one_line(str(exc))}", where) from None
        try:
            return cls.from_mapping(raw, clock=clock)
        except KeyFileError as exc:
            raise KeyFileError(exc.reason, where) from None

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, clock: Clock | None = None) -> KeyRing:
        """The key file's content, parsed: see the module docstring."""
        tenants, admin = _parse(raw)
        return cls(tenants, admin, enabled=True, clock=clock)

    @property
    def enabled(self) -> bool:
        """False for a ring that admits everyone (no key file)."""
        return self._enabled

    @property
    def tenants(self) -> tuple[Tenant, ...]:
        return tuple(sorted(set(self._by_digest.values()), key=lambda t: t.name))

    def authenticate(self, authorization_header: str | None) -> Tenant | None:
        """The tenant whose key the `Authorization: Bearer <key>` header carries; None when it
        is missing, malformed or unknown. ANONYMOUS for anything when auth is off."""
        if not self._enabled:
            return ANONYMOUS
        digest = _digest_of(authorization_header)
        if digest is None:
            return None
        return self._by_digest.get(digest)

    def is_admin(self, authorization_header: str | None) -> bool:
        """Whether the header carries an admin key. With auth off (no key file: a local
        development stack) everyone is; with a key file but no admin_keys, no one is."""
        if not self._enabled:
            return True
        digest = _digest_of(authorization_header)
        return digest is not None and digest in self._admin

    def admit(self, tenant: Tenant) -> float:
        """0.0 when the tenant may send a request now (and one is counted), else the seconds
        until it may. Buckets are keyed by tenant name and made on first use."""
        if tenant.rate_per_s <= 0:
            return 0.0
        bucket = self._buckets.get(tenant.name)
        if bucket is None:
            bucket = TokenBucket(tenant.rate_per_s, tenant.burst, self._clock)
            self._buckets[tenant.name] = bucket
        return bucket.take()


def _digest_of(header: str | None) -> bytes | None:
    if not header:
        return None
    parts = header.split(None, 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return None
    try:
        return sha256(parts[1].rstrip().encode()).digest()
    except UnicodeEncodeError:  # a lone surrogate: no key of ours
        return None


# -- the key file --------------------------------------------------------------------------

_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
_TOP_FIELDS = ("admin_keys", "tenants")
_TENANT_FIELDS = ("keys", "rate_per_s", "burst", "clusters")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _parse(raw: Mapping[str, Any]) -> tuple[dict[bytes, Tenant], frozenset[bytes]]:
    if not isinstance(raw, Mapping):
        raise KeyFileError("must be a table of admin_keys and [tenants.<name>]")
    for field in raw:
        if field not in _TOP_FIELDS:
            raise KeyFileError(f"{field}: unknown field (expected {', '.join(_TOP_FIELDS)})")
    # digest -> where it was first given. Admin keys and tenant keys are checked apart: a key
    # may be both, but not twice an admin key, nor the key of two tenants.
    seen_admin: dict[bytes, str] = {}
    seen_tenant: dict[bytes, str] = {}

    admin: set[bytes] = set()
    for where, key in _key_list(raw.get("admin_keys", []), "admin_keys", allow_empty=True):
        admin.add(_unique(_key_digest(key, where), where, seen_admin))

    tenants_raw = raw.get("tenants", {})
    if not isinstance(tenants_raw, Mapping):
        raise KeyFileError("tenants: must be a table of [tenants.<name>]")
    tenants: dict[bytes, Tenant] = {}
    for name, table in tenants_raw.items():
        prefix = f"tenants.{name}"
        if not name:
            raise KeyFileError(f"{prefix}: the tenant name must not be empty")
        if not isinstance(table, Mapping):
            raise KeyFileError(f"{prefix}: must be a table")
        for field in table:
            if field not in _TENANT_FIELDS:
                raise KeyFileError(
                    f"{prefix}.{field}: unknown field (expected {', '.join(_TENANT_FIELDS)})"
                )
        if "rate_per_s" not in table:
            raise KeyFileError(f"{prefix}.rate_per_s: required (0 = unlimited)")
        rate = _number(table["rate_per_s"], f"{prefix}.rate_per_s")
        if rate < 0:
            raise KeyFileError(f"{prefix}.rate_per_s: must be >= 0")
        burst = max(1.0, 2.0 * rate)
        if "burst" in table:
            burst = _number(table["burst"], f"{prefix}.burst")
            if burst < 1:
                raise KeyFileError(f"{prefix}.burst: must be >= 1")
        clusters: frozenset[str] = frozenset()
        if "clusters" in table:
            value = table["clusters"]
            if (
                not isinstance(value, list)
                or not value
                or not all(isinstance(c, str) and c for c in value)
            ):
                raise KeyFileError(f"{prefix}.clusters: must be a non-empty list of cluster names")
            clusters = frozenset(value)
        tenant = Tenant(name, rate, burst, clusters)
        if "keys" not in table:
            raise KeyFileError(f"{prefix}.keys: required (one or more keys)")
        for where, key in _key_list(table["keys"], f"{prefix}.keys", allow_empty=False):
            tenants[_unique(_key_digest(key, where), where, seen_tenant)] = tenant

    if not admin and not tenants:
        raise KeyFileError(
            "no keys: give admin_keys or a [tenants.<name>] table "
            "(run without a key file to turn auth off)"
        )
    return tenants, frozenset(admin)


def _key_list(value: Any, where: str, *, allow_empty: bool) -> list[tuple[str, str]]:
    if not isinstance(value, list) or not all(isinstance(k, str) for k in value):
        raise KeyFileError(f"{where}: must be a list of strings")
    if not value and not allow_empty:
        raise KeyFileError(f"{where}: must hold at least one key")
    return [(f"{where}[{i}]", key) for i, key in enumerate(value)]


def _key_digest(key: str, where: str) -> bytes:
    if not key:
        raise KeyFileError(f"{where}: must not be empty")
    if any(c.isspace() for c in key):
        raise KeyFileError(f"{where}: must not contain whitespace")
    if key.startswith("sha256:"):
        hex_digest = key.removeprefix("sha256:")
        if not _HEX64.fullmatch(hex_digest):
            raise KeyFileError(f"{where}: sha256: must be followed by 64 hex digits")
        return bytes.fromhex(hex_digest)
    return sha256(key.encode()).digest()


def _unique(digest: bytes, where: str, seen: dict[bytes, str]) -> bytes:
    first = seen.setdefault(digest, where)
    if first != where:
        raise KeyFileError(f"{where}: duplicate key (also {first})")
    return digest


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise KeyFileError(f"{where}: must be a number")
    if not math.isfinite(value):
        raise KeyFileError(f"{where}: must be a finite number")
    return float(value)
