"""A nats-server with JetStream for the contract tests: one per test session, on 127.0.0.1 at
a port it picks, storing in a temporary directory; each store gets a stream of its own, so
tests share the server without seeing each other's events."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import itertools
import tempfile
import threading
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any

import nats
import nats.errors
from nats.aio.client import Client

from events.jetstream_store import JetStreamEventStore, JetStreamOptions
from wire.nats_server import EmbeddedNats

_names = itertools.count(1)


class SharedServer:
    """Started on first use, stopped at exit. A thread with an event loop of its own starts
    and stops the child process, so it can be asked for from a test's running loop or from
    none (the differential machine)."""

    _url: str | None = None

    @classmethod
    def url(cls) -> str:
        if cls._url is None:
            workdir = tempfile.TemporaryDirectory(prefix="gpumesh-contract-nats-")
            loop = asyncio.new_event_loop()
            server = EmbeddedNats(Path(workdir.name))
            _in_thread(loop, server.start())

            def stop() -> None:
                try:
                    _in_thread(loop, server.stop())
                finally:
                    loop.close()
                    workdir.cleanup()

            atexit.register(stop)
            cls._url = server.url
        return cls._url


def _in_thread(loop: asyncio.AbstractEventLoop, work: Coroutine[Any, Any, None]) -> None:
    failed: list[BaseException] = []

    def run() -> None:
        try:
            loop.run_until_complete(work)
        except BaseException as exc:
            failed.append(exc)

    thread = threading.Thread(target=run, name="contract-nats")
    thread.start()
    thread.join()
    if failed:
        raise failed[0]


def fresh_options(**overrides: object) -> JetStreamOptions:
    """A stream, subjects and bucket no other store on the server uses."""
    n = next(_names)
    return JetStreamOptions(
        stream=f"CONTRACT_{n}",
        subject_prefix=f"contract{n}.log",
        **overrides,  # type: ignore[arg-type]
    )


async def connect() -> Client:
    return await nats.connect(SharedServer.url(), name="contract", max_reconnect_attempts=0)


async def open_store(options: JetStreamOptions | None = None) -> JetStreamEventStore:
    """A store on its own connection (closed with it) and a fresh stream."""
    nc = await connect()
    try:
        return await JetStreamEventStore.open(nc, options or fresh_options(), owns_connection=True)
    except BaseException:
        await nc.close()
        raise


async def drop(options: JetStreamOptions) -> None:
    """Delete the store's stream and bucket, so a long session leaves the server light."""
    nc = await connect()
    try:
        js = nc.jetstream()
        for name in (options.stream, f"KV_{options.bucket}"):
            with contextlib.suppress(nats.errors.Error):
                await js.delete_stream(name)
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def opened(options: JetStreamOptions) -> AsyncIterator[JetStreamEventStore]:
    """A store on `options`, closed on leaving."""
    store = await open_store(options)
    try:
        yield store
    finally:
        await store.close()
