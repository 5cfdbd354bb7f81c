"""Receive slots (auditor/daemon/receive_slots.py) as pure bookkeeping on an event loop."""

from __future__ import annotations

import asyncio

import pytest

from numaudit.auditor.daemon.receive_slots import ReceiveSlots, StreamSlot

pytestmark = pytest.mark.timeout(30)


def test_slots_cap_readers_prefer_working_streams_and_evict_idle_holders():
    async def main() -> None:
        evicted: list[int] = []
        slots = ReceiveSlots(2, evict_after_s=0.05, on_evict=lambda: evicted.append(1))
        a, b, fresh, worker = StreamSlot(), StreamSlot(), StreamSlot(), StreamSlot()
        worker.batches = 3  # has delivered batches before
        for s in (a, b):
            await slots.acquire(s)
            slots.reading(s)
        assert slots.held == 2
        t_fresh = asyncio.ensure_future(slots.acquire(fresh))
        await asyncio.sleep(0)
        t_worker = asyncio.ensure_future(slots.acquire(worker))
        await asyncio.sleep(0)
        assert slots.waiting == 2 and not t_fresh.done()
        slots.received(a)
        slots.release(a)  # the freed slot goes to the stream that delivered before
        await asyncio.sleep(0)
        assert t_worker.done() and not t_fresh.done()
        # b holds its slot idle while `fresh` waits: it is told to go after evict_after_s
        await asyncio.wait_for(b.evicted.wait(), 2)
        assert evicted == [1] and not a.evicted.is_set()
        slots.release(b)
        await asyncio.wait_for(t_fresh, 2)
        assert slots.held == 2 and slots.waiting == 0
        # a cancelled wait leaves no trace
        late = StreamSlot()
        t_late = asyncio.ensure_future(slots.acquire(late))
        await asyncio.sleep(0)
        t_late.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t_late
        assert slots.waiting == 0 and not late.holding
        for s in (worker, fresh):
            slots.release(s)
            slots.release(s)  # idempotent
        assert slots.held == 0

    asyncio.run(main())


def test_streams_that_never_sent_are_served_newest_first():
    """A rank that just connected is not queued behind thousands of silent streams (issue 40:
    a new rank's Ingest got DEADLINE_EXCEEDED behind 4,080 of them)."""
    async def main() -> None:
        slots = ReceiveSlots(1, evict_after_s=60)
        holder = StreamSlot()
        await slots.acquire(holder)
        silent = [StreamSlot() for _ in range(50)]
        waits = [asyncio.ensure_future(slots.acquire(s)) for s in silent]
        await asyncio.sleep(0)
        newcomer = StreamSlot()
        t_new = asyncio.ensure_future(slots.acquire(newcomer))
        await asyncio.sleep(0)
        slots.release(holder)
        await asyncio.sleep(0)
        assert t_new.done() and not any(w.done() for w in waits)
        for w in waits:
            w.cancel()
        await asyncio.gather(*waits, return_exceptions=True)

    asyncio.run(main())


def test_busy_streams_cannot_starve_a_rank_new_to_the_daemon():
    """Three agents that always have a next batch keep the two slots turning over; a fourth
    rank's first stream (failing over from a frozen replica) still gets the second freed slot,
    and the busy ones the slots in between: freed slots alternate between the two kinds."""
    async def main() -> None:
        slots = ReceiveSlots(2, evict_after_s=60)
        busy = [StreamSlot() for _ in range(3)]
        for s in busy:
            s.batches = 5
        await slots.acquire(busy[0])
        await slots.acquire(busy[1])
        waiting = asyncio.ensure_future(slots.acquire(busy[2]))
        await asyncio.sleep(0)
        newcomer = StreamSlot()
        t_new = asyncio.ensure_future(slots.acquire(newcomer))
        await asyncio.sleep(0)
        order = []
        for _turn in range(4):  # each holder in turn receives a batch, gives its slot back and
            holder = next(s for s in busy if s.holding)  # at once asks for the next one
            slots.received(holder)
            slots.release(holder)
            again = asyncio.ensure_future(slots.acquire(holder))
            await asyncio.sleep(0)
            order.append("new" if t_new.done() and "new" not in order else "busy")
            if t_new.done():
                break
            assert not again.done()
            waiting = again
        assert t_new.done() and order.count("new") == 1 and len(order) <= 2, order
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)

    asyncio.run(main())


def test_receiving_and_admitted_bytes_share_one_budget():
    """Slots reserve a largest message each, admitted batches their own share, in one budget."""
    async def main() -> None:
        admitted = [0]
        slots = ReceiveSlots(8, evict_after_s=60, budget=4 * 100, admitted=lambda: admitted[0],
                             message_bytes=100)
        held = [StreamSlot() for _ in range(4)]
        for s in held:
            await slots.acquire(s)
        assert slots.held == 4  # the budget holds four largest messages
        admitted[0] = 30  # one batch received and admitted (its slot released below)
        slots.release(held[0])
        late = StreamSlot()
        t_late = asyncio.ensure_future(slots.acquire(late))
        await asyncio.sleep(0)
        assert not t_late.done()  # 3 reservations + 30 admitted: no room for a fourth message
        admitted[0] = 0
        slots.budget_freed()
        await asyncio.wait_for(t_late, 2)
        # a budget below one message still lets one stream receive when nothing else is held
        small = ReceiveSlots(8, budget=10, admitted=lambda: 0, message_bytes=100)
        one = StreamSlot()
        await small.acquire(one)
        assert small.held == 1

    asyncio.run(main())
