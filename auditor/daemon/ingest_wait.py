"""Waiting for an Ingest stream's next batch: bounded by the daemon stopping, the idle timeout,
and the stream's receive slot or its place (`receive_slots`) being taken back.

No other clock: a stream slow to send its first batch is ended only when its place is wanted
(`ReceiveSlots.make_room`, at the stream cap). Ending it after a fixed time regardless (5 s,
issue 40) cut off every agent whose first batch took longer to arrive over a throttled link or
from a loaded machine: it reconnected, resent, and was cut off again, never acked.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from numaudit.auditor.daemon.admission import IdleStream
from numaudit.auditor.daemon.receive_slots import ReceiveSlots, StreamSlot


def abandon(task: asyncio.Future) -> None:
    """Cancel a task nobody will await, and retrieve its outcome so that asyncio does not log
    "Task exception was never retrieved" (StopAsyncIteration of a stream that ended meanwhile)."""
    task.cancel()
    task.add_done_callback(lambda t: t.cancelled() or t.exception())


async def _receive(batches: AsyncIterator[Any], slot: StreamSlot, slots: ReceiveSlots) -> Any:
    """The next message, asked of gRPC only while holding a receive slot; the caller keeps the
    slot until the batch is admitted to the in-flight budget, then releases it."""
    await slots.acquire(slot)
    slots.reading(slot)
    try:
        message = await batches.__anext__()
    except BaseException:
        slots.release(slot)
        raise
    slots.received(slot)
    return message


async def next_batch(batches: AsyncIterator[Any], slot: StreamSlot, slots: ReceiveSlots,
                     stopping: asyncio.Event, idle_s: float,
                     shutting_down: type[Exception]) -> Any:
    """The next batch; `shutting_down()` when the daemon stops first, IdleStream after `idle_s`
    (0 = never) or when the slot or the stream's place is taken back (`slot.why`),
    StopAsyncIteration at the end of the stream."""
    if stopping.is_set():
        raise shutting_down()
    slot.evicted.clear()  # told to go just as its last batch arrived: that batch was taken
    nxt = asyncio.ensure_future(_receive(batches, slot, slots))
    stop = asyncio.ensure_future(stopping.wait())
    evict = asyncio.ensure_future(slot.evicted.wait())
    try:
        await asyncio.wait((nxt, stop, evict), return_when=asyncio.FIRST_COMPLETED,
                           timeout=idle_s or None)
    except BaseException:  # the call was cancelled (the agent closed it) while we waited
        abandon(nxt)
        raise
    finally:
        stop.cancel()
        evict.cancel()
    if not nxt.done():
        abandon(nxt)
        slots.release(slot)
        if stopping.is_set():
            raise shutting_down()
        if slot.evicted.is_set():
            raise IdleStream(slot.why)
        raise IdleStream(f"Ingest: no batch for {idle_s:g} s; the stream is closed (reconnect "
                         "to send more)")
    error = nxt.exception()  # StopAsyncIteration at the end of the stream
    if error is None:
        return nxt.result()
    # Raise it without the cycle task -> error -> traceback -> this frame -> task, which kept
    # the caller's frame (and the 40 MiB batch it last held) alive until a full gc.
    del nxt
    try:
        raise error
    finally:
        del error
