"""Who may see the dashboard: the admin keys of /api/v1, carried by a cookie.

A browser cannot put `Authorization: Bearer` on an EventSource, so the key is given once, to
the login form, and exchanged for a session: a random token in an HttpOnly, SameSite=Strict
cookie scoped to /ui. The gateway keeps, per token, the key it stands for and checks that key
against the key ring on every request, so a key taken out of the key file (a reload) ends its
sessions at once, and a session never outlives the key it came from.

Sessions live in this gateway's memory: a restart, or another gateway behind the same name,
asks for the key again. They end after `ttl_s`, on logout, or when `max_sessions` newer ones
push them out.
"""

from __future__ import annotations

import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final

from gateway.auth import AdminScope, KeyRing
from runtime.env import Clock
from runtime.real_env import LoopClock

COOKIE: Final = "gpumesh_ui"
DEFAULT_TTL_S: Final = 12 * 3600.0
DEFAULT_MAX_SESSIONS: Final = 1024


@dataclass(frozen=True, slots=True)
class _Session:
    authorization: str  # the header the key would have been sent in
    expires_at: float  # on the clock's monotonic time


class Sessions:
    """Tokens handed out by the login form, each standing for one admin key."""

    def __init__(
        self,
        keys: KeyRing,
        *,
        ttl_s: float = DEFAULT_TTL_S,
        max_sessions: int = DEFAULT_MAX_SESSIONS,
        clock: Clock | None = None,
    ) -> None:
        self._keys = keys
        self._ttl_s = ttl_s
        self._max = max_sessions
        self._clock = clock or LoopClock()
        self._by_token: OrderedDict[str, _Session] = OrderedDict()

    @property
    def ttl_s(self) -> float:
        return self._ttl_s

    def __len__(self) -> int:
        return len(self._by_token)

    def login(self, key: str) -> str | None:
        """A new session's token when `key` is an admin key (any scope: the dashboard only
        reads), else None."""
        authorization = f"Bearer {key.strip()}"
        if not key.strip() or self._keys.admin(authorization) is None:
            return None
        token = secrets.token_urlsafe(32)
        self._by_token[token] = _Session(authorization, self._clock.monotonic() + self._ttl_s)
        while len(self._by_token) > self._max:
            self._by_token.popitem(last=False)
        return token

    def scope(self, token: str | None) -> AdminScope | None:
        """The scope of the key behind a live session; None for an unknown, expired or
        revoked one (which is forgotten)."""
        if not token:
            return None
        session = self._by_token.get(token)
        if session is None:
            return None
        if self._clock.monotonic() >= session.expires_at:
            del self._by_token[token]
            return None
        scope = self._keys.admin(session.authorization)
        if scope is None:
            del self._by_token[token]
        return scope

    def logout(self, token: str | None) -> None:
        if token:
            self._by_token.pop(token, None)
