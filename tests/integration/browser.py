"""A headless Chromium driven over the Chrome DevTools Protocol, with aiohttp's websocket client:
what the dashboard's browser tests (tests/integration/test_dashboard_browser.py) and
bench/dashboard.py use. No selenium or playwright: Debian's `chromium` (`apt-get install -y
chromium`; .ci/run installs it where it can) and aiohttp, which the project has already.

    async with Chromium.launch() as browser:
        page = await browser.new_page()
        await page.goto("http://127.0.0.1:8080/ui/fleet")
        await page.wait_for("document.body.dataset.ready === '1'")
        assert page.problems == []          # console errors, exceptions, failed loads
        await page.screenshot(Path("fleet.png"))

`chromium_path()` is None where no browser is installed: the tests skip, saying so.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--mute-audio",
)
CANDIDATES = ("/usr/bin/chromium", "chromium", "chromium-browser")


def chromium_path() -> str | None:
    """The browser to drive: $GPUMESH_CHROMIUM, else Debian's chromium; None when absent."""
    wanted = os.environ.get("GPUMESH_CHROMIUM")
    for candidate in (wanted,) if wanted else CANDIDATES:
        found = shutil.which(candidate)
        if found:
            return found
    return None


class BrowserError(Exception):
    pass


@dataclass
class Page:
    """One tab: commands go to its CDP session; what it logs is gathered in `problems`."""

    browser: Chromium
    session_id: str
    target_id: str
    problems: list[str] = field(default_factory=list)
    console: list[str] = field(default_factory=list)
    _loaded: asyncio.Event = field(default_factory=asyncio.Event)

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.browser.send(method, params, session_id=self.session_id)

    def on_event(self, method: str, params: dict[str, Any]) -> None:
        if method == "Runtime.consoleAPICalled":
            text = " ".join(_remote_text(arg) for arg in params.get("args", []))
            self.console.append(f"{params.get('type')}: {text}")
            if params.get("type") in ("error", "assert"):
                self.problems.append(f"console.{params['type']}: {text}")
        elif method == "Runtime.exceptionThrown":
            details = params.get("exceptionDetails", {})
            exception = details.get("exception", {})
            text = exception.get("description") or details.get("text", "")
            self.problems.append(f"exception: {text}")
        elif method == "Log.entryAdded":
            entry = params.get("entry", {})
            if entry.get("level") == "error":
                self.problems.append(f"log ({entry.get('source')}): {entry.get('text')}")
        elif method == "Page.loadEventFired":
            self._loaded.set()

    async def goto(self, url: str, *, timeout: float = 10.0) -> None:
        """Load `url` and wait for its load event (scripts have run)."""
        self._loaded.clear()
        reply = await self.send("Page.navigate", {"url": url})
        if reply.get("errorText"):
            raise BrowserError(f"{url}: {reply['errorText']}")
        await asyncio.wait_for(self._loaded.wait(), timeout)

    async def evaluate(self, expression: str) -> Any:
        """The expression's value (promises awaited), as JSON gives it back."""
        reply = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "awaitPromise": True, "returnByValue": True},
        )
        if "exceptionDetails" in reply:
            details = reply["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise BrowserError(f"{expression[:80]}: {text}")
        return reply.get("result", {}).get("value")

    async def wait_for(self, expression: str, *, timeout: float = 10.0, every: float = 0.05) -> Any:
        """Evaluate until the value is truthy; returns it. The browser is another process: a
        look every `every` seconds is how a test waits on it."""
        deadline = asyncio.get_running_loop().time() + timeout
        while True:
            value = await self.evaluate(expression)
            if value:
                return value
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"not true within {timeout} s: {expression}")
            await asyncio.sleep(every)

    async def fill(self, selector: str, value: str) -> None:
        """Type `value` into an input as a person would, as far as the page can tell."""
        await self.evaluate(
            f"(() => {{ const i = document.querySelector({json.dumps(selector)});"
            f" i.value = {json.dumps(value)}; i.dispatchEvent(new Event('input')); }})()"
        )

    async def screenshot(self, path: Path, *, full_page: bool = False) -> None:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        reply = await self.send("Page.captureScreenshot", params)
        await asyncio.to_thread(path.write_bytes, base64.b64decode(reply["data"]))

    async def viewport(self, width: int, height: int) -> None:
        await self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )

    async def close(self) -> None:
        with contextlib.suppress(BrowserError):
            await self.browser.send("Target.closeTarget", {"targetId": self.target_id})


class Chromium:
    """A chromium process of our own (its own temporary profile) and one CDP connection."""

    def __init__(self, process: subprocess.Popen[bytes], profile: Path) -> None:
        self._process = process
        self._profile = profile
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._pages: dict[str, Page] = {}
        self._reader: asyncio.Task[None] | None = None

    @classmethod
    @contextlib.asynccontextmanager
    async def launch(
        cls, *, binary: str | None = None, timeout: float = 20.0
    ) -> AsyncIterator[Chromium]:
        binary = binary or chromium_path()
        if binary is None:
            raise BrowserError("no chromium (apt-get install -y chromium)")
        profile = Path(tempfile.mkdtemp(prefix="gpumesh-chromium-"))
        browser = cls(_start(binary, profile), profile)
        try:
            await browser._connect(timeout)
            yield browser
        finally:
            await browser._close()

    async def _connect(self, timeout: float) -> None:
        active = self._profile / "DevToolsActivePort"
        deadline = asyncio.get_running_loop().time() + timeout
        while not (active.exists() and len(active.read_text().splitlines()) >= 2):
            if self._process.poll() is not None:
                raise BrowserError(f"chromium exited ({self._process.returncode}): {self._log()}")
            if asyncio.get_running_loop().time() > deadline:
                raise BrowserError(f"chromium did not open its DevTools port: {self._log()}")
            await asyncio.sleep(0.05)
        port, path = active.read_text().splitlines()[:2]
        self._http = aiohttp.ClientSession()
        self._ws = await self._http.ws_connect(
            f"ws://127.0.0.1:{port}{path}", max_msg_size=0, heartbeat=None
        )
        self._reader = asyncio.create_task(self._read(), name="cdp-reader")

    def _log(self) -> str:
        try:
            return (self._profile / "chromium.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    async def _read(self) -> None:
        assert self._ws is not None
        try:
            async for message in self._ws:
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                body = message.json()
                if "id" in body:
                    waiter = self._waiting.pop(body["id"], None)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(body)
                    continue
                page = self._pages.get(body.get("sessionId", ""))
                if page is not None:
                    page.on_event(body.get("method", ""), body.get("params", {}))
        finally:
            for waiter in self._waiting.values():
                if not waiter.done():
                    waiter.set_exception(BrowserError("the DevTools connection closed"))

    async def send(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        session_id: str = "",
        timeout: float = 30.0,
    ) -> dict[str, Any]:
        if self._ws is None or self._ws.closed:
            raise BrowserError("not connected")
        ident = next(self._ids)
        message: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session_id:
            message["sessionId"] = session_id
        waiter: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[ident] = waiter
        await self._ws.send_json(message)
        reply = await asyncio.wait_for(waiter, timeout)
        if "error" in reply:
            raise BrowserError(f"{method}: {reply['error'].get('message')}")
        result: dict[str, Any] = reply.get("result", {})
        return result

    async def new_page(self, *, width: int = 1400, height: int = 900) -> Page:
        target = (await self.send("Target.createTarget", {"url": "about:blank"}))["targetId"]
        attached = await self.send("Target.attachToTarget", {"targetId": target, "flatten": True})
        page = Page(self, attached["sessionId"], target)
        self._pages[page.session_id] = page
        for domain in ("Page.enable", "Runtime.enable", "Log.enable"):
            await page.send(domain)
        await page.viewport(width, height)
        return page

    async def _close(self) -> None:
        with contextlib.suppress(Exception):
            if self._ws is not None and not self._ws.closed:
                await self.send("Browser.close", timeout=5.0)
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._reader
        if self._http is not None:
            await self._http.close()
        try:
            await asyncio.to_thread(self._process.wait, 5)
        except subprocess.TimeoutExpired:
            pass
        # Its helpers (zygote, renderers, the GPU process) share its session: none outlives it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._process.pid, signal.SIGKILL)
        await asyncio.to_thread(self._process.wait)
        shutil.rmtree(self._profile, ignore_errors=True)


def _start(binary: str, profile: Path) -> subprocess.Popen[bytes]:
    """Chromium in a session of its own (its helpers are killed with it), logging to a file in
    its profile; the port it picks is written to DevToolsActivePort there."""
    with (profile / "chromium.log").open("wb") as log:
        return subprocess.Popen(
            [binary, *FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0"],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _remote_text(arg: dict[str, Any]) -> str:
    if "value" in arg:
        return str(arg["value"])
    return str(arg.get("description", arg.get("type", "")))
