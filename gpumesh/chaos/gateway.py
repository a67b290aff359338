"""The client side of chaos's traffic: one request to the gateway per arrival, and its failure
named the way the simulator names it."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Protocol

import msgspec

from .errors import ChaosError

if TYPE_CHECKING:
    import aiohttp

REQUEST_TIMEOUT_S = 30.0  # the gateway gives up after its own deadline first
# The suffix of a failure once the answer's status line had come (its first byte): the body
# broke off, or did not come in time. Every other failure is one before the first byte.
AFTER_FIRST_BYTE = "AfterFirstByte"


class Client(Protocol):
    """Where a run's requests go (GatewayClient; a test's stand-in)."""

    async def check(self) -> None:
        """Raise ChaosError, in one line, if requests cannot go anywhere."""

    async def send(self, cluster: str) -> str:
        """One request to `cluster`: "" when it was answered, else how it failed."""

    async def close(self) -> None: ...


class GatewayClient:
    """OpenAI-style chat requests to the gateway over aiohttp, with no retries of its own."""

    def __init__(self, gateway: str, api_key: str = "") -> None:
        self.gateway = gateway.rstrip("/")
        self.api_key = api_key
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
            )
        return self._session

    async def check(self) -> None:
        import aiohttp

        try:
            async with self._open().get(
                f"{self.gateway}/healthz", timeout=aiohttp.ClientTimeout(total=3.0)
            ) as response:
                if response.status != 200:
                    raise ChaosError(f"the gateway at {self.gateway} answers {response.status}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise ChaosError(
                f"no gateway answers at {self.gateway} ({type(exc).__name__}); pass "
                "--gateway URL (gpumesh up serves one on 127.0.0.1:8080)"
            ) from None

    async def send(self, cluster: str) -> str:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        body = {"model": cluster, "messages": [{"role": "user", "content": "gpumesh chaos"}]}
        try:
            async with self._open().post(
                f"{self.gateway}/v1/chat/completions", json=body, headers=headers
            ) as response:
                status = response.status
                try:
                    data = await response.read()
                except TimeoutError:
                    return f"ClientTimeout{AFTER_FIRST_BYTE}"
                except (aiohttp.ClientError, OSError, ValueError) as exc:
                    return f"{type(exc).__name__}{AFTER_FIRST_BYTE}"
        except TimeoutError:
            return "ClientTimeout"
        except aiohttp.ClientConnectorError:
            return "GatewayUnreachable"
        except (aiohttp.ClientError, OSError, ValueError) as exc:
            return type(exc).__name__
        return "" if 200 <= status < 300 else failure_kind(status, data)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None


def failure_kind(status: int, body: bytes) -> str:
    """A failed request in the simulator's words (gateway/proxy.py's answers), else `http_N`."""
    code = ""
    # Any body at all may come back (a proxy's HTML page, JSON of another shape).
    with contextlib.suppress(msgspec.DecodeError, AttributeError, TypeError, LookupError):
        code = str(msgspec.json.decode(body)["error"]["code"])
    if status == 404 and code == "model_not_found":
        return "UnknownCluster"
    if status == 503 and code == "no_ready_replica":
        return "NoReadyReplica"
    if status in (502, 504):
        return "AttemptsExhausted"
    return f"http_{status}" + (f"_{code}" if code else "")
