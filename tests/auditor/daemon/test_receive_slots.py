"""Receive slots (auditor/daemon/receive_slots.py) as pure bookkeeping on an event loop."""

from __future__ import annotations

import asyncio

import pytest

from auditor.daemon.receive_slots import ReceiveSlots, StreamSlot

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
