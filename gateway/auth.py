"""API keys per tenant, a token-bucket rate limit per tenant, and admin keys for the control API.

The key file (`gpumesh gateway --keys keys.toml`) is what operators write:

    # Admin keys may call /api/v1 (the control API), all of it. They are not tenant keys: a
    # key listed here and under a tenant may do both.
    admin_keys = ["gm-admin-3f9c..."]

    # Scoped admin keys: `scope` is "read" (GET nodes, clusters, events), "operate" (read,
    # and change the `clusters` named: apply, scale, roll back, delete) or "all".
    [admins.dashboards]
    keys = ["gm-ro-51aa..."]
    scope = "read"

    [admins.llama-team]
    keys = ["gm-llama-9e2c..."]
    scope = "operate"
    clusters = ["llama"]  # required with "operate", refused with the others

    [tenants.acme]
    keys = ["gm-7d1e...", "sha256:5e884898da28047151d0e56f8dc6292773603d0d6aabbdd62a11ef721d1542d8"]
    rate_per_s = 20      # requests per second, sustained; 0 = unlimited (required)
    burst = 40           # optional: how many may come at once; default max(1, 2 * rate_per_s)
    clusters = ["llama"] # optional: the only clusters its keys reach (default: every cluster)
    tokens_per_min = 60000  # optional: a budget in tokens (prompt and completion), 0 = none
    token_burst = 60000     # optional: tokens at once; default tokens_per_min

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

Limits are per tenant (all of its keys share one bucket). Several gateways share each
tenant's limits through NATS (gateway/quota_share.py): each serves its share of the rate, the
burst and the token budget, in proportion to the tenant's demand on it, and decides every
request alone (no request waits on NATS). A token budget is counted from the usage a workload
reports (gateway/usage.py): a request is admitted while the tenant's balance holds a token
and charged when its answer ends, so one request may take the balance below zero by its own
tokens (and each request in flight with it by theirs).

No key file means tenant auth is off: every request is admitted as the tenant "anonymous",
without a rate limit. The control API is then closed (`KeyRing.open()`), or open to everyone
(`KeyRing.open(insecure_api=True)`, `gpumesh gateway --insecure-api`: a local development
stack; the gateway warns about it at start), or keyed by one admin key kept in a file of its
own (`KeyRing.load_admin_key`, what `gpumesh up` makes). With a key file, the control API needs
one of its admin keys; a file without any refuses every control call. A file must hold at least
one key: an empty one is an error rather than a silent "auth off".

A ring read from a file can be read again (`reload`, `watch`): a file that no longer parses
leaves the keys as they were, and says so in one log line.

Every problem with the file is a `KeyFileError`, one line: `keys.toml: tenants.acme.rate_per_s:
must be >= 0`.
"""

from __future__ import annotations

import asyncio
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from hashlib import sha256
from typing import Any, Literal

import structlog

from runtime.env import Clock
from runtime.real_env import LoopClock

_log = structlog.get_logger("gpumesh.gateway")


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
    tokens_per_min: float = 0.0  # a token budget; 0: none
    token_burst: float = 0.0  # tokens at once (the budget's bucket size)

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

    def debit(self, n: float) -> None:
        """Take `n` whether or not they are there: the balance may go below zero (a token
        budget charged after the answer), and refills from there."""
        self._refill()
        self._tokens -= n

    def until_positive(self) -> float:
        """0.0 while at least one token is left, else the seconds until one will be."""
        self._refill()
        if self._tokens + self._EPSILON >= 1.0:
            return 0.0
        return (1.0 - self._tokens) / self._rate

    def resize(self, rate_per_s: float, burst: float) -> None:
        """New limits from now on (a gateway's share changed); what is held is kept, up to
        the new burst."""
        self._refill()
        self._rate = float(rate_per_s)
        self._burst = float(burst)
        self._tokens = min(self._tokens, self._burst)


class TenantQuota:
    """One tenant's limits on this gateway: its request bucket and its token budget, at this
    gateway's share of them (`share`, set by gateway/quota_share.py; 1.0 alone), and what it
    asked for since the last report (`asked`: every request, refused ones too, so that a
    gateway held back by a small share still shows its demand; `tokens`: the tokens charged)."""

    __slots__ = ("asked", "charged", "requests", "share", "tenant", "tokens")

    def __init__(self, tenant: Tenant, clock: Clock, share: float = 1.0) -> None:
        self.tenant = tenant
        self.share = share
        self.asked = 0
        self.charged = 0.0
        self.requests = (
            TokenBucket(tenant.rate_per_s * share, _at_least_one(tenant.burst * share), clock)
            if tenant.rate_per_s > 0
            else None
        )
        self.tokens = (
            TokenBucket(
                tenant.tokens_per_min / 60.0 * share,
                _at_least_one(tenant.token_burst * share),
                clock,
            )
            if tenant.tokens_per_min > 0
            else None
        )

    def admit(self) -> float:
        """0.0 when a request may go now (and it is counted), else the seconds until it may:
        the token budget must hold a token at least, and the request bucket a request."""
        self.asked += 1
        if self.tokens is not None and (wait := self.tokens.until_positive()) > 0:
            return wait
        return self.requests.take() if self.requests is not None else 0.0

    @property
    def spent(self) -> bool:
        """Whether the token budget is what holds requests back now."""
        return self.tokens is not None and self.tokens.until_positive() > 0

    def charge(self, tokens: float) -> None:
        if self.tokens is not None and tokens > 0:
            self.tokens.debit(tokens)
            self.charged += tokens

    def set_share(self, share: float) -> None:
        if share == self.share:
            return
        self.share = share
        tenant = self.tenant
        if self.requests is not None:
            self.requests.resize(tenant.rate_per_s * share, _at_least_one(tenant.burst * share))
        if self.tokens is not None:
            self.tokens.resize(
                tenant.tokens_per_min / 60.0 * share, _at_least_one(tenant.token_burst * share)
            )

    def limits(self) -> tuple[float, float, float, float]:
        t = self.tenant
        return (t.rate_per_s, t.burst, t.tokens_per_min, t.token_burst)


def _at_least_one(burst: float) -> float:
    # A bucket smaller than one request never admits one (take(1) is then math.inf): a
    # gateway with a small share still takes one at a time, at its share of the rate.
    return max(burst, 1.0)


def hashed(key: str) -> str:
    """What to write in the key file instead of `key`: `sha256:<hex>`."""
    return "sha256:" + sha256(key.encode()).hexdigest()


Scope = Literal["read", "operate", "all"]
SCOPES: tuple[Scope, ...] = ("read", "operate", "all")
Need = Literal["read", "cluster", "all"]
"""What a control route needs: `read` (a GET), `cluster` (a change to the cluster its path
names), `all` (anything else: creating a cluster, node verbs)."""


@dataclass(frozen=True, slots=True)
class AdminScope:
    """What one admin key may do on /api/v1."""

    name: str  # `admin_keys`, or the `[admins.<name>]` table it came from
    scope: Scope
    clusters: frozenset[str] = frozenset()  # with scope "operate": the clusters it may change

    def allows(self, need: Need, cluster: str = "") -> bool:
        if self.scope == "all" or need == "read":
            return True
        return need == "cluster" and self.scope == "operate" and cluster in self.clusters


FULL_ADMIN = AdminScope("admin_keys", "all")

Access = Literal["ok", "no_key", "forbidden"]


class KeyRing:
    """Who a request is, what it may do on the control API, and whether its tenant is over
    its rate limit. Build it with `load`, `from_mapping`, `open` or `load_admin_key`.

    `clock` times the rate limits; by default the running event loop's clock, so `admit` must
    be called from within the loop (where the gateway calls it) and a simulator's virtual loop
    stays in charge. A ring read from a file is reloaded in place (`reload`, `watch`), so
    whoever holds it sees the new keys.
    """

    def __init__(
        self,
        tenants: Mapping[bytes, Tenant],
        admins: Mapping[bytes, AdminScope] | frozenset[bytes],
        *,
        enabled: bool,
        api_open: bool = False,
        clock: Clock | None = None,
        source: tuple[Callable[[str], KeyRing], str] | None = None,
    ) -> None:
        self._by_digest = dict(tenants)
        if isinstance(admins, frozenset):  # digests of keys that may do everything
            admins = dict.fromkeys(admins, FULL_ADMIN)
        self._admin = dict(admins)
        self._enabled = enabled
        self._api_open = api_open and not enabled
        self._clock = clock or LoopClock()
        self._quotas: dict[str, TenantQuota] = {}  # by tenant name, made on first use
        self._source = source  # (loader, path): how to read this ring again
        # A new tenant's share before any report says otherwise (quota_share.py sets it
        # to 1/gateways, so a gateway does not start with the whole burst of a shared limit).
        self._share = 1.0
        self._seen: tuple[int, int, int] | None = None  # the file as it was when last read

    @classmethod
    def open(cls, *, insecure_api: bool = False, clock: Clock | None = None) -> KeyRing:
        """Tenant auth off: every request is the anonymous tenant, unlimited. The control API
        is closed to everyone, unless `insecure_api` opens it to everyone."""
        return cls({}, {}, enabled=False, api_open=insecure_api, clock=clock)

    @classmethod
    def load(cls, path: str | os.PathLike[str], *, clock: Clock | None = None) -> KeyRing:
        where = os.fspath(path)
        seen = _signature(where)  # before reading: a change while it is read is seen later
        raw = _read_text(where)
        try:
            data = tomllib.loads(raw)
        except tomllib.TOMLDecodeError as exc:
            raise KeyFileError(f"not valid TOML: {_one_line(str(exc))}", where) from None
        try:
            tenants, admins = _parse(data)
        except KeyFileError as exc:
            raise KeyFileError(exc.reason, where) from None
        loader = partial(cls.load, clock=clock)
        ring = cls(tenants, admins, enabled=True, clock=clock, source=(loader, where))
        ring._seen = seen
        return ring

    @classmethod
    def load_admin_key(cls, path: str | os.PathLike[str], *, clock: Clock | None = None) -> KeyRing:
        """Tenant auth off, and the control API keyed by the one admin key (scope "all") the
        file holds, alone on its first line: what `gpumesh up` writes (gpumesh/up.py)."""
        where = os.fspath(path)
        seen = _signature(where)
        lines = _read_text(where).splitlines()
        key = lines[0].strip() if lines else ""
        if not key or any(line.strip() for line in lines[1:]):
            raise KeyFileError("must hold one admin key, alone on its line", where)
        try:
            digest = _key_digest(key, "admin key")
        except KeyFileError as exc:
            raise KeyFileError(exc.reason, where) from None
        loader = partial(cls.load_admin_key, clock=clock)
        ring = cls({}, {digest: FULL_ADMIN}, enabled=False, clock=clock, source=(loader, where))
        ring._seen = seen
        return ring

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, clock: Clock | None = None) -> KeyRing:
        """The key file's content, parsed: see the module docstring."""
        tenants, admins = _parse(raw)
        return cls(tenants, admins, enabled=True, clock=clock)

    @property
    def enabled(self) -> bool:
        """False for a ring that admits every inference request (no key file)."""
        return self._enabled

    @property
    def api_open(self) -> bool:
        """Whether the control API is open to everyone, without a key (`--insecure-api`)."""
        return self._api_open

    @property
    def path(self) -> str:
        """The file this ring was read from, or ''."""
        return self._source[1] if self._source else ""

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

    def admin(self, authorization_header: str | None) -> AdminScope | None:
        """The scope of the admin key the header carries; None without one. Everything
        (FULL_ADMIN) for anyone when the control API is open."""
        if self._api_open:
            return FULL_ADMIN
        digest = _digest_of(authorization_header)
        return None if digest is None else self._admin.get(digest)

    def is_admin(self, authorization_header: str | None) -> bool:
        """Whether the header carries an admin key, of any scope (or the API is open)."""
        return self.admin(authorization_header) is not None

    def access(self, authorization_header: str | None, need: Need | None, cluster: str) -> Access:
        """Whether a control call that needs `need` on `cluster` may go on: `no_key` without
        an admin key (401), `forbidden` with one whose scope does not allow it (403). `need`
        None (no such route): any admin key will do, so that a 404 tells nothing to strangers."""
        scope = self.admin(authorization_header)
        if scope is None:
            return "no_key"
        if need is None or scope.allows(need, cluster):
            return "ok"
        return "forbidden"

    @property
    def has_admin_keys(self) -> bool:
        return bool(self._admin)

    def admit(self, tenant: Tenant) -> float:
        """0.0 when the tenant may send a request now (and one is counted), else the seconds
        until it may (its request rate, or its token budget spent)."""
        if tenant.rate_per_s <= 0 and tenant.tokens_per_min <= 0:
            return 0.0
        return self.quota(tenant).admit()

    def charge(self, tenant: Tenant, tokens: float) -> None:
        """An answer of `tenant`'s ended, using `tokens` (its token budget, if it has one).
        An answer admitted before a reload that changed or removed the tenant is not charged:
        charging must not bring back the limits the reload replaced."""
        if tenant.tokens_per_min <= 0:
            return
        quota = self._quotas.get(tenant.name)
        if quota is not None and quota.tenant == tenant:
            quota.charge(tokens)

    def quota(self, tenant: Tenant) -> TenantQuota:
        quota = self._quotas.get(tenant.name)
        if quota is None:
            quota = self._quotas[tenant.name] = TenantQuota(tenant, self._clock, self._share)
        return quota

    def share_new_tenants(self, share: float) -> None:
        """The share a tenant first seen from now on starts with (quota_share.py)."""
        self._share = share

    def limited(self) -> list[Tenant]:
        """The tenants with a rate limit or a token budget, by name."""
        tenants = {t.name: t for t in self._by_digest.values()}
        return [t for _, t in sorted(tenants.items()) if t.rate_per_s > 0 or t.tokens_per_min > 0]

    @property
    def quotas(self) -> dict[str, TenantQuota]:
        """The tenants with limits that sent requests here, by name (quota_share.py)."""
        return self._quotas

    # -- reloading ----------------------------------------------------------------------------

    def reload(self, log: Any = None) -> bool:
        """Read the file again and take its keys, in place; True when they were taken. A file
        that does not load leaves the keys as they were: one warning, False. A tenant whose
        limits did not change keeps its bucket (a reload is no way around a rate limit)."""
        if self._source is None:
            return False
        loader, where = self._source
        log = log or _log
        self._seen = _signature(where)
        try:
            fresh = loader(where)
        except KeyFileError as exc:
            log.warning("keys_reload_failed", error=str(exc), detail="kept the keys as they were")
            return False
        self._by_digest = fresh._by_digest
        self._admin = fresh._admin
        limits = {
            t.name: (t.rate_per_s, t.burst, t.tokens_per_min, t.token_burst)
            for t in self._by_digest.values()
        }
        for name, quota in list(self._quotas.items()):
            if limits.get(name) != quota.limits():
                del self._quotas[name]
        log.info(
            "keys_reloaded",
            path=where,
            tenants=len(limits),
            admin_keys=len(self._admin),
        )
        return True

    async def watch(self, log: Any = None, interval: float = 1.0) -> None:
        """Reload whenever the file changes (its mtime, size or inode), looking every
        `interval` seconds; forever. Nothing to watch for a ring not read from a file."""
        if self._source is None:
            return
        where = self._source[1]
        while True:
            await asyncio.sleep(interval)
            if _signature(where) != self._seen:
                self.reload(log)


def _signature(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _read_text(where: str) -> str:
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
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise KeyFileError("not UTF-8 text", where) from None


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
_TOP_FIELDS = ("admin_keys", "admins", "tenants")
_TENANT_FIELDS = ("keys", "rate_per_s", "burst", "clusters", "tokens_per_min", "token_burst")
_ADMIN_FIELDS = ("keys", "scope", "clusters")


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _parse(raw: Mapping[str, Any]) -> tuple[dict[bytes, Tenant], dict[bytes, AdminScope]]:
    if not isinstance(raw, Mapping):
        raise KeyFileError("must be a table of admin_keys, [admins.<name>] and [tenants.<name>]")
    for field in raw:
        if field not in _TOP_FIELDS:
            raise KeyFileError(f"{field}: unknown field (expected {', '.join(_TOP_FIELDS)})")
    # digest -> where it was first given. Admin keys and tenant keys are checked apart: a key
    # may be both, but not twice an admin key, nor the key of two tenants.
    seen_admin: dict[bytes, str] = {}
    seen_tenant: dict[bytes, str] = {}

    admin: dict[bytes, AdminScope] = {}
    for where, key in _key_list(raw.get("admin_keys", []), "admin_keys", allow_empty=True):
        admin[_unique(_key_digest(key, where), where, seen_admin)] = FULL_ADMIN
    admins_raw = raw.get("admins", {})
    if not isinstance(admins_raw, Mapping):
        raise KeyFileError("admins: must be a table of [admins.<name>]")
    for name, table in admins_raw.items():
        scope = _admin_scope(name, table)
        for where, key in _key_list(table["keys"], f"admins.{name}.keys", allow_empty=False):
            admin[_unique(_key_digest(key, where), where, seen_admin)] = scope

    tenants_raw = raw.get("tenants", {})
    if not isinstance(tenants_raw, Mapping):
        raise KeyFileError("tenants: must be a table of [tenants.<name>]")
    tenants: dict[bytes, Tenant] = {}
    for name, table in tenants_raw.items():
        prefix = f"tenants.{name}"
        _check_table(prefix, name, table, _TENANT_FIELDS, "the tenant name")
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
        tokens_per_min = _number(table.get("tokens_per_min", 0), f"{prefix}.tokens_per_min")
        if tokens_per_min < 0:
            raise KeyFileError(f"{prefix}.tokens_per_min: must be >= 0 (0 = no budget)")
        token_burst = tokens_per_min
        if "token_burst" in table:
            if tokens_per_min <= 0:
                raise KeyFileError(f"{prefix}.token_burst: only with tokens_per_min")
            token_burst = _number(table["token_burst"], f"{prefix}.token_burst")
            if token_burst < 1:
                raise KeyFileError(f"{prefix}.token_burst: must be >= 1")
        tenant = Tenant(name, rate, burst, clusters, tokens_per_min, token_burst)
        if "keys" not in table:
            raise KeyFileError(f"{prefix}.keys: required (one or more keys)")
        for where, key in _key_list(table["keys"], f"{prefix}.keys", allow_empty=False):
            tenants[_unique(_key_digest(key, where), where, seen_tenant)] = tenant

    if not admin and not tenants:
        raise KeyFileError(
            "no keys: give admin_keys, an [admins.<name>] or a [tenants.<name>] table "
            "(run without a key file to turn auth off)"
        )
    return tenants, admin


def _check_table(prefix: str, name: str, table: Any, fields: Sequence[str], what_name: str) -> None:
    """A named table of the key file: a name, a table, and only the fields it may have."""
    if not name:
        raise KeyFileError(f"{prefix}: {what_name} must not be empty")
    if not isinstance(table, Mapping):
        raise KeyFileError(f"{prefix}: must be a table")
    for field in table:
        if field not in fields:
            raise KeyFileError(f"{prefix}.{field}: unknown field (expected {', '.join(fields)})")


def _admin_scope(name: str, table: Any) -> AdminScope:
    prefix = f"admins.{name}"
    _check_table(prefix, name, table, _ADMIN_FIELDS, "the name")
    if "keys" not in table:
        raise KeyFileError(f"{prefix}.keys: required (one or more keys)")
    scope = table.get("scope")
    if scope not in SCOPES:
        raise KeyFileError(f"{prefix}.scope: required, one of {', '.join(SCOPES)}")
    clusters = table.get("clusters")
    if scope != "operate":
        if clusters is not None:
            raise KeyFileError(f'{prefix}.clusters: only with scope = "operate"')
        return AdminScope(name, scope)
    if (
        not isinstance(clusters, list)
        or not clusters
        or not all(isinstance(c, str) and c for c in clusters)
    ):
        raise KeyFileError(
            f'{prefix}.clusters: scope = "operate" needs a non-empty list of cluster names'
        )
    return AdminScope(name, scope, frozenset(clusters))


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


# -- the admin key `gpumesh up` makes ---------------------------------------------------------

ADMIN_KEY_FILE = "admin-key"
"""In the data directory: the control API's admin key for a local stack (`gpumesh up` makes it:
gpumesh/up.py ensure_admin_key), which `gpumesh gateway` uses when it is given no `--keys`."""
