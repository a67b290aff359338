from __future__ import annotations

import asyncio

import pytest

from runtime import Mailbox, MailboxClosed, MailboxFull


async def settle() -> None:
    """Let every ready task run until it blocks again (no time passes)."""
    for _ in range(5):
        await asyncio.sleep(0)


async def test_send_waits_while_full_and_resumes_when_space_frees() -> None:
    mailbox: Mailbox[int] = Mailbox(2, name="mb")
    await mailbox.send(1)
    await mailbox.send(2)
    async with asyncio.TaskGroup() as tg:
        blocked = tg.create_task(mailbox.send(3))
        await settle()
        assert not blocked.done()
        assert mailbox.stats().waiting_senders == 1
        assert await mailbox.receive() == 1
        await blocked
    assert [await mailbox.receive(), await mailbox.receive()] == [2, 3]
    stats = mailbox.stats()
    assert (stats.size, stats.capacity, stats.peak, stats.waiting_senders) == (0, 2, 2, 0)


async def test_waiting_senders_are_served_in_order() -> None:
    mailbox: Mailbox[str] = Mailbox(1)
    await mailbox.send("first")
    async with asyncio.TaskGroup() as tg:
        for name in ("a", "b", "c"):
            tg.create_task(mailbox.send(name))
            await settle()
        got = [await mailbox.receive() for _ in range(4)]
    assert got == ["first", "a", "b", "c"]


async def test_try_send_raises_mailbox_full_at_capacity() -> None:
    mailbox: Mailbox[int] = Mailbox(1, name="tiny")
    mailbox.try_send(1)
    with pytest.raises(MailboxFull) as info:
        mailbox.try_send(2)
    assert (info.value.name, info.value.capacity) == ("tiny", 1)
    assert len(mailbox) == 1


async def test_close_refuses_sends_and_lets_the_receiver_drain() -> None:
    mailbox: Mailbox[int] = Mailbox(10)
    for i in range(3):
        await mailbox.send(i)
    mailbox.close()
    with pytest.raises(MailboxClosed):
        await mailbox.send(99)
    with pytest.raises(MailboxClosed):
        mailbox.try_send(99)
    assert [item async for item in mailbox] == [0, 1, 2]
    with pytest.raises(MailboxClosed):
        await mailbox.receive()
    assert mailbox.stats().closed


async def test_close_wakes_a_receiver_waiting_on_an_empty_mailbox() -> None:
    mailbox: Mailbox[int] = Mailbox(1)
    receiver = asyncio.create_task(mailbox.receive())
    await settle()
    mailbox.close()
    with pytest.raises(MailboxClosed):
        await receiver


async def test_close_fails_senders_waiting_for_space() -> None:
    mailbox: Mailbox[int] = Mailbox(1)
    await mailbox.send(1)
    blocked = asyncio.create_task(mailbox.send(2))
    await settle()
    mailbox.close()
    with pytest.raises(MailboxClosed):
        await blocked
    assert [item async for item in mailbox] == [1]


async def test_a_cancelled_waiting_sender_does_not_lose_the_slot() -> None:
    mailbox: Mailbox[int] = Mailbox(1)
    await mailbox.send(1)
    async with asyncio.TaskGroup() as tg:
        first = tg.create_task(mailbox.send(2))
        second = tg.create_task(mailbox.send(3))
        await settle()
        assert await mailbox.receive() == 1  # wakes `first`...
        first.cancel()  # ...which is cancelled before it takes the slot
        await second
    assert first.cancelled()
    assert await mailbox.receive() == 3
    assert len(mailbox) == 0


async def test_interrupt_raises_in_the_receiver_and_keeps_queued_items() -> None:
    mailbox: Mailbox[int] = Mailbox(5)
    await mailbox.send(1)
    mailbox.interrupt(RuntimeError("boom"))
    with pytest.raises(RuntimeError, match="boom"):
        await mailbox.receive()
    assert await mailbox.receive() == 1


async def test_peak_tracks_the_largest_backlog() -> None:
    mailbox: Mailbox[int] = Mailbox(10)
    for i in range(4):
        mailbox.try_send(i)
    for _ in range(4):
        await mailbox.receive()
    mailbox.try_send(9)
    assert (mailbox.stats().size, mailbox.stats().peak) == (1, 4)


def test_capacity_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        Mailbox(0)


async def test_a_cleared_interrupt_is_not_raised() -> None:
    mailbox: Mailbox[int] = Mailbox(5)
    mailbox.interrupt(RuntimeError("stale"))
    mailbox.clear_interrupt()
    await mailbox.send(1)
    assert await mailbox.receive() == 1
