"""The stage link (nodeagent/stage_link.py, events/contract/stage_link.py): TCP streams between
pipeline stages carried over the simulator's MemoryBus, with real loopback sockets at both
ends (so on real time: the timeouts here are a fraction of a second)."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest

from events.contract import stage_link as frames
from events.contract.stage_link import (
    FrameError,
    StageAccept,
    StageCredit,
    StageError,
    StageOpen,
)
from nodeagent.stage_link import Resolve, StageLinkClient, StageLinkServer, StageTarget
from runtime.env import Msg
from sim.bus import MemoryBus

REPLICA, EPOCH, RANK = "r1", 3, 1
TARGET = StageTarget("worker", REPLICA, EPOCH, RANK)


def only(port: int) -> Resolve:
    """The worker runs stage RANK of REPLICA at EPOCH, on `port`; nothing else."""

    def resolve(replica_id: str, epoch: int, rank: int) -> tuple[str, int] | None:
        if (replica_id, epoch, rank) == (REPLICA, EPOCH, RANK):
            return ("127.0.0.1", port)
        return None

    return resolve


Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
        writer.write_eof()  # the head's half-close, passed on
    except ConnectionError:
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def tcp_server(handler: Handler) -> AsyncIterator[int]:
    server = await asyncio.start_server(handler, "127.0.0.1", 0)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


@contextlib.asynccontextmanager
async def running(*runners: Callable[[], Coroutine[Any, Any, None]]) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(run()) for run in runners]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        assert all(isinstance(r, asyncio.CancelledError) for r in results), results


@contextlib.asynccontextmanager
async def link(
    bus: Any, resolve: Resolve, *, server: dict[str, Any] | None = None, **client: Any
) -> AsyncIterator[tuple[StageLinkServer, StageLinkClient, tuple[str, int]]]:
    worker = StageLinkServer(bus, "worker", resolve, **(server or {}))
    head = StageLinkClient(bus, "head", **client)
    async with running(worker.run, head.run):
        await worker.subscribed.wait()
        await head.ready.wait()
        address = await head.forward(TARGET)
        yield worker, head, address


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    """Poll counters that no event announces (streams end in the agents' own tasks)."""
    async with asyncio.timeout(timeout):
        while not check():  # noqa: ASYNC110
            await asyncio.sleep(0.005)


async def exchange(address: tuple[str, int], data: bytes) -> bytes:
    """Send `data` and read everything back until end of file, both at once."""
    reader, writer = await asyncio.open_connection(*address)

    async def send() -> None:
        view = memoryview(data)
        for start in range(0, len(data), 1 << 20):
            writer.write(view[start : start + (1 << 20)])
            await writer.drain()
        writer.write_eof()

    try:
        sending = asyncio.create_task(send())
        got = await reader.read(-1)
        await sending
        return got
    finally:
        writer.close()


# Bytes through.


@pytest.mark.parametrize("size", [1, 64 * 1024, 20 * 1024 * 1024], ids=["1B", "64KiB", "20MiB"])
async def test_an_echo_returns_exactly_what_was_sent_both_ways_at_once(size: int) -> None:
    data = (hashlib.sha256(b"seed").digest() * (size // 32 + 1))[:size]
    async with tcp_server(echo) as port, link(MemoryBus(), only(port)) as (worker, head, addr):
        got = await exchange(addr, data)
        assert len(got) == size
        assert hashlib.sha256(got).digest() == hashlib.sha256(data).digest()
        await until(lambda: worker.in_flight == 0 and head.in_flight == 0)
    assert worker.errors == {} and head.errors == {}
    assert worker.streams == head.streams == 1


async def test_many_short_connections_in_a_row() -> None:
    # llama.cpp's head opens about 15 while it starts; ggml-rpc-server takes one at a time.
    async with tcp_server(echo) as port, link(MemoryBus(), only(port)) as (worker, head, addr):
        for i in range(15):
            message = f"hello {i}".encode()
            assert await exchange(addr, message) == message
            await until(lambda: worker.in_flight == 0)
        assert worker.streams == head.streams == 15
        assert worker.errors == {} and head.errors == {}


async def test_a_small_window_still_carries_everything() -> None:
    data = bytes(range(256)) * 4096  # 1 MiB through 4 KiB windows: credit after credit
    async with (
        tcp_server(echo) as port,
        link(MemoryBus(), only(port), server={"window": 4096}, window=4096) as (_, head, addr),
    ):
        assert await exchange(addr, data) == data
    assert head.errors == {}


# Ends.


async def test_a_worker_that_closes_mid_stream_ends_the_heads_connection() -> None:
    async def hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(10)
        writer.write(b"bye")
        writer.close()

    async with tcp_server(hangs_up) as port, link(MemoryBus(), only(port)) as (worker, head, addr):
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(b"0123456789")
        async with asyncio.timeout(5):
            assert await reader.read(-1) == b"bye"  # then the end of file
        writer.close()
        await until(lambda: worker.in_flight == 0 and head.in_flight == 0)


async def test_a_worker_reset_resets_the_heads_connection() -> None:
    async def resets(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readexactly(1)
        from nodeagent.tcp_reset import reset

        reset(writer.transport)

    async with tcp_server(resets) as port, link(MemoryBus(), only(port)) as (worker, head, addr):
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(b"x")
        with pytest.raises(ConnectionResetError):
            async with asyncio.timeout(5):
                await reader.read(-1)
        writer.close()
        await until(lambda: head.in_flight == 0)
    assert worker.errors == {"reset": 1}
    assert head.last_error.startswith("reset: reading the local socket")


class DroppingBus(MemoryBus):
    """Loses the `nth` DATA frame published on subjects containing `where`."""

    def __init__(self, where: str, nth: int) -> None:
        super().__init__()
        self.where = where
        self.nth = nth
        self.seen = 0

    async def publish(
        self, subject: str, data: bytes, *, reply: str = "", headers: dict[str, str] | None = None
    ) -> None:
        if self.where in subject and data[0] == frames.DATA:
            self.seen += 1
            if self.seen == self.nth:
                return
        await super().publish(subject, data, reply=reply, headers=headers)


async def test_a_lost_frame_ends_the_stream_with_an_error_never_a_corrupt_stream() -> None:
    data = bytes(range(256)) * 4096 * 4  # 4 MiB: 64 chunks back; the 3rd never arrives
    bus = DroppingBus(".head.", 3)
    async with tcp_server(echo) as port, link(bus, only(port)) as (worker, head, addr):
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(data)
        got = b""
        with pytest.raises(ConnectionResetError):
            async with asyncio.timeout(5):
                while chunk := await reader.read(1 << 16):
                    got += chunk
        assert data.startswith(got) and len(got) <= 2 * frames.MAX_CHUNK
        writer.close()
        await until(lambda: worker.in_flight == 0 and head.in_flight == 0)
    assert head.errors == {"gap": 1}
    assert head.last_error == "gap: DATA frame 4 came where 3 was due"  # ACCEPT was 0
    assert worker.errors == {"gap": 1}  # told by the head's ERROR


# Refusals, straight on the bus as a head would send them.


class RawHead:
    """A head's agent played by hand: frames to the worker, the worker's frames collected."""

    def __init__(self, bus: MemoryBus, stream: str = "s1") -> None:
        self.bus = bus
        self.to = frames.stagelink_to_stage("worker", "head", stream)
        self.back = frames.stagelink_to_head("head", "worker", stream)
        self.frames: asyncio.Queue[frames.Frame] = asyncio.Queue()

    async def start(self) -> None:
        await self.bus.subscribe(self.back, handler=self._on)

    def _on(self, msg: Msg) -> None:
        self.frames.put_nowait(frames.decode(msg.data))

    async def send(self, frame: bytes) -> None:
        await self.bus.publish(self.to, frame)

    async def next(self, timeout: float = 5.0) -> frames.Frame:
        async with asyncio.timeout(timeout):
            return await self.frames.get()


@pytest.mark.parametrize(
    ("open_", "expected"),
    [
        (
            StageOpen(replica_id=REPLICA, epoch=EPOCH, rank=2),
            "node worker does not run stage 2 of replica r1 at epoch 3",
        ),
        (
            StageOpen(replica_id=REPLICA, epoch=EPOCH - 1, rank=RANK),
            "node worker does not run stage 1 of replica r1 at epoch 2",
        ),
        (
            StageOpen(replica_id="other", epoch=EPOCH, rank=RANK),
            "node worker does not run stage 1 of replica other at epoch 3",
        ),
    ],
)
async def test_an_open_for_a_stage_this_node_does_not_run_is_refused_in_one_line(
    open_: StageOpen, expected: str
) -> None:
    bus = MemoryBus()
    worker = StageLinkServer(bus, "worker", only(1))
    async with running(worker.run):
        await worker.subscribed.wait()
        raw = RawHead(bus)
        await raw.start()
        await raw.send(frames.encode_open(open_))
        frame = await raw.next()
    assert frame.kind == frames.ERROR and frame.seq == 0
    assert frame.meta == StageError(reason="unknown_stage", detail=expected)
    assert worker.errors == {"unknown_stage": 1} and worker.streams == 0


async def test_only_the_admitted_head_node_may_open() -> None:
    bus = MemoryBus()
    admit = lambda head, replica, epoch: "" if head == "head" else "not the head of r1"  # noqa: E731
    worker = StageLinkServer(bus, "worker", only(1), admit=admit)
    async with running(worker.run):
        await worker.subscribed.wait()
        raw = RawHead(bus)
        raw.to = frames.stagelink_to_stage("worker", "mallory", "s1")
        raw.back = frames.stagelink_to_head("mallory", "worker", "s1")
        await raw.start()
        await raw.send(frames.encode_open(StageOpen(replica_id=REPLICA, epoch=EPOCH, rank=RANK)))
        frame = await raw.next()
    assert frame.meta == StageError(
        reason="forbidden",
        detail="stage 1 of replica r1 at epoch 3 from node mallory: not the head of r1",
    )


async def test_a_fenced_replica_is_refused_and_its_open_streams_cut() -> None:
    bus = MemoryBus()
    fenced = {"why": ""}
    async with (
        tcp_server(echo) as port,
        link(
            bus,
            only(port),
            server={"fence": lambda r, e: fenced["why"], "recheck_s": 0.02},
        ) as (worker, head, addr),
    ):
        reader, writer = await asyncio.open_connection(*addr)
        writer.write(b"ping")
        assert await reader.readexactly(4) == b"ping"
        fenced["why"] = "lease lapsed"
        with pytest.raises(ConnectionResetError):
            async with asyncio.timeout(5):
                await reader.read(-1)
        writer.close()
        assert head.last_error == "fenced: lease lapsed"
        # And a new connection is refused at its OPEN.
        reader, writer = await asyncio.open_connection(*addr)
        with pytest.raises(ConnectionResetError):
            async with asyncio.timeout(5):
                await reader.read(-1)
        writer.close()
        assert head.last_error == "fenced: stage 1 of replica r1 at epoch 3: lease lapsed"
    assert worker.errors == {"fenced": 2}


async def test_a_stage_gone_from_the_node_ends_its_stream() -> None:
    running_stage = {"yes": True}
    async with tcp_server(echo) as port:
        base = only(port)

        def resolve(replica_id: str, epoch: int, rank: int) -> tuple[str, int] | None:
            return base(replica_id, epoch, rank) if running_stage["yes"] else None

        async with link(MemoryBus(), resolve, server={"recheck_s": 0.02}) as (_, head, addr):
            reader, writer = await asyncio.open_connection(*addr)
            writer.write(b"ping")
            assert await reader.readexactly(4) == b"ping"
            running_stage["yes"] = False
            with pytest.raises(ConnectionResetError):
                async with asyncio.timeout(5):
                    await reader.read(-1)
            writer.close()
    assert head.last_error == (
        "unknown_stage: node worker no longer runs stage 1 of replica r1 at epoch 3"
    )


async def test_garbage_and_a_bad_window_are_refused_in_one_line() -> None:
    bus = MemoryBus()
    worker = StageLinkServer(bus, "worker", only(1))
    async with running(worker.run):
        await worker.subscribed.wait()
        raw = RawHead(bus)
        await raw.start()
        await raw.send(b"\x01\x00")
        frame = await raw.next()
        assert isinstance(frame.meta, StageError) and frame.meta.reason == "bad_request"
        assert (
            frame.meta.detail == "not a stage link frame: 2 bytes, shorter than its 9-byte prefix"
        )
        await raw.send(
            frames.encode_open(StageOpen(replica_id=REPLICA, epoch=EPOCH, rank=RANK, window=0))
        )
        frame = await raw.next()
        assert frame.meta == StageError(reason="bad_request", detail="window of 0 bytes")


async def test_nobody_listening_on_the_workers_subject_fails_the_connection_at_once() -> None:
    bus = MemoryBus()
    head = StageLinkClient(bus, "head")
    async with running(head.run):
        await head.ready.wait()
        addr = await head.forward(StageTarget("gone", REPLICA, EPOCH, RANK))
        reader, writer = await asyncio.open_connection(*addr)
        with pytest.raises(ConnectionResetError):
            async with asyncio.timeout(2):
                await reader.read(-1)
        writer.close()
    assert head.last_error == "unreachable: no agent listens for stage links on node gone"


# Flow control.


async def test_a_head_that_credits_nothing_is_given_up_after_the_stall_timeout() -> None:
    flooded = asyncio.Event()
    ended: list[BaseException | None] = []

    async def floods(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                writer.write(b"w" * 65536)
                await writer.drain()
                flooded.set()
        except ConnectionError as exc:
            ended.append(exc)
        finally:
            writer.close()

    bus = MemoryBus()
    async with tcp_server(floods) as port:
        worker = StageLinkServer(bus, "worker", only(port), stall_timeout_s=0.2)
        async with running(worker.run):
            await worker.subscribed.wait()
            raw = RawHead(bus)
            await raw.start()
            await raw.send(
                frames.encode_open(
                    StageOpen(replica_id=REPLICA, epoch=EPOCH, rank=RANK, window=5000)
                )
            )
            accept = await raw.next()
            assert accept.kind == frames.ACCEPT and isinstance(accept.meta, StageAccept)
            got = 0
            while got < 5000:
                data = await raw.next()
                assert data.kind == frames.DATA
                got += len(data.payload)
            assert got == 5000  # the window, and not a byte more
            loop = asyncio.get_running_loop()
            started = loop.time()
            error = await raw.next(timeout=5)
            waited = loop.time() - started
            assert error.kind == frames.ERROR and error.seq == data.seq + 1
            assert error.meta == StageError(
                reason="stalled", detail="no CREDIT for 0.2 s with 5000 bytes unacknowledged"
            )
            assert 0.15 < waited < 2.0
            await until(lambda: worker.in_flight == 0 and bool(ended))
    assert isinstance(ended[0], ConnectionResetError)  # the worker's engine saw it break


async def test_credit_lets_a_sender_go_on_and_overrun_is_refused() -> None:
    bus = MemoryBus()
    async with tcp_server(echo) as port:
        worker = StageLinkServer(bus, "worker", only(port), window=8192)
        async with running(worker.run):
            await worker.subscribed.wait()
            raw = RawHead(bus)
            await raw.start()
            await raw.send(
                frames.encode_open(
                    StageOpen(replica_id=REPLICA, epoch=EPOCH, rank=RANK, window=100)
                )
            )
            assert (await raw.next()).meta == StageAccept(window=8192)
            await raw.send(frames.encode_data(1, b"a" * 100))
            echoed = await raw.next()
            assert echoed.kind == frames.DATA and echoed.payload == b"a" * 100
            # The window is full: nothing more comes until we credit it.
            await raw.send(frames.encode_data(2, b"b" * 50))
            with pytest.raises(TimeoutError):
                await raw.next(timeout=0.1)
            await raw.send(frames.encode_credit(3, 100))
            more = await raw.next()
            assert more.kind == frames.DATA and more.payload == b"b" * 50
            # Over the worker's window of 8192 (nothing of it credited: it is all written, but
            # the worker credits in quarters, and 8300 bytes are more than it ever allows).
            await raw.send(frames.encode_data(4, b"c" * 8300))
            error = await raw.next()
            while error.kind == frames.DATA:  # some of the echo may be on its way
                error = await raw.next()
            assert isinstance(error.meta, StageError) and error.meta.reason == "overrun"


async def test_a_worker_that_credits_nothing_is_given_up_by_the_head() -> None:
    bus = MemoryBus()
    seen: asyncio.Queue[frames.Frame] = asyncio.Queue()

    def worker_by_hand(msg: Msg) -> None:
        seen.put_nowait(frames.decode(msg.data))

    await bus.subscribe(f"{frames.stagelink('worker')}.stage.*.*", handler=worker_by_hand)
    head = StageLinkClient(bus, "head", stall_timeout_s=0.2, new_stream_id=lambda: "s9")
    async with running(head.run):
        await head.ready.wait()
        addr = await head.forward(TARGET)
        reader, writer = await asyncio.open_connection(*addr)
        opened = await seen.get()
        assert opened.kind == frames.OPEN
        await bus.publish(
            frames.stagelink_to_head("head", "worker", "s9"), frames.encode_accept(1000)
        )
        writer.write(b"h" * 5000)
        with pytest.raises(ConnectionResetError):
            async with asyncio.timeout(5):
                await reader.read(-1)
        writer.close()
        kinds = []
        while not seen.empty():
            kinds.append(seen.get_nowait())
    assert sum(len(f.payload) for f in kinds if f.kind == frames.DATA) == 1000
    assert kinds[-1].meta == StageError(
        reason="stalled", detail="no CREDIT for 0.2 s with 1000 bytes unacknowledged"
    )
    assert head.errors == {"stalled": 1}


# Shutdown.


def stage_link_tasks() -> list[asyncio.Task[Any]]:
    """Tasks running code of nodeagent/stage_link.py."""
    return [
        t
        for t in asyncio.all_tasks()
        if t.get_coro().cr_code.co_filename.endswith("nodeagent/stage_link.py")  # type: ignore[union-attr]
    ]


async def test_closing_the_server_and_client_cancels_every_task() -> None:
    bus = MemoryBus()
    async with tcp_server(echo) as port:
        worker = StageLinkServer(bus, "worker", only(port))
        head = StageLinkClient(bus, "head")
        tasks = [asyncio.create_task(worker.run()), asyncio.create_task(head.run())]
        await worker.subscribed.wait()
        await head.ready.wait()
        addr = await head.forward(TARGET)
        connections = [await asyncio.open_connection(*addr) for _ in range(3)]
        for reader, writer in connections:
            writer.write(b"hi")
            assert await reader.readexactly(2) == b"hi"
        assert worker.in_flight == head.in_flight == 3
        assert len(stage_link_tasks()) > 6  # each stream: one task and two pumps per end
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert stage_link_tasks() == []
        for reader, writer in connections:
            with pytest.raises(ConnectionResetError):
                await reader.read(-1)
            writer.close()
    assert worker.in_flight == head.in_flight == 0
    with pytest.raises(ConnectionRefusedError):  # the listener is gone too
        await asyncio.open_connection(*addr)


async def test_unforward_ends_only_that_forwards_streams() -> None:
    async with tcp_server(echo) as port, link(MemoryBus(), only(port)) as (_, head, addr):
        other = await head.forward(TARGET)
        reader, writer = await asyncio.open_connection(*addr)
        await head.unforward(addr)
        with pytest.raises(ConnectionResetError):
            await reader.read(-1)
        writer.close()
        assert await exchange(other, b"still here") == b"still here"
        assert list(head.forwards()) == [other]


# Framing.


def test_frames_round_trip() -> None:
    open_ = StageOpen(replica_id="r", epoch=2, rank=1, window=4096)
    assert frames.decode(frames.encode_open(open_)).meta == open_
    frame = frames.decode(frames.encode_data(7, b"abc"))
    assert (frame.kind, frame.seq, frame.payload) == (frames.DATA, 7, b"abc")
    assert frames.decode(frames.encode_credit(3, 99)).meta == StageCredit(consumed=99)
    assert frames.decode(frames.encode_close(4)).kind_name == "CLOSE"
    error = frames.decode(frames.encode_error(5, "reset", "two\nlines"))
    assert error.meta == StageError(reason="reset", detail="two lines")


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "not a stage link frame: 0 bytes, shorter than its 9-byte prefix"),
        (b"\x7f" + bytes(8), "not a stage link frame: unknown kind 0x7f"),
        (
            b"\x01\x00\x00\x00\x00\x00\x00\x00\x10{}",
            "truncated OPEN frame: meta of 16 bytes, 2 left",
        ),
        (b"\x01" + bytes(8), "OPEN frame without its meta"),
        (
            b"\x03\x00\x00\x00\x00\x00\x00\x00\x02{}",
            "DATA frame with 2 bytes of meta, expected none",
        ),
        (
            frames.encode_data(0, bytes(frames.MAX_CHUNK + 1)),
            "DATA frame of 65537 bytes, over the 65536-byte chunk",
        ),
    ],
)
def test_garbage_is_a_frame_error_in_one_line(data: bytes, message: str) -> None:
    with pytest.raises(FrameError) as caught:
        frames.decode(data)
    assert str(caught.value) == message


def test_undecodable_meta_is_a_frame_error_in_one_line() -> None:
    data = b"\x04\x00\x00\x00\x00\x00\x00\x00\x05[1,2]"
    with pytest.raises(FrameError) as caught:
        frames.decode(data)
    assert "\n" not in str(caught.value)
    assert str(caught.value).startswith("CREDIT frame with undecodable meta")


def test_subjects_name_the_sender() -> None:
    to_stage = frames.stagelink_to_stage("w", "h", "s")
    assert to_stage == "gpumesh.v1.node.w.stagelink.stage.h.s"
    assert frames.stream_of(to_stage) == ("h", "s")
    assert frames.stream_of(frames.stagelink_to_head("h", "w", "s")) == ("w", "s")
    assert frames.stream_of("gpumesh.v1.node.w.tunnel") is None
