"""Receive slots: how many Ingest streams may be receiving a batch at once.

gRPC core accepts a whole message (up to `wire.limits.MAX_MESSAGE_BYTES`) for every stream whose
handler is waiting for its next message, before any admission check can see its size: 24 streams
each sending a 40 MiB batch put ~1.8 GB in the daemon although `max_inflight_bytes` was 512 MiB.
So a stream asks for the next message only while it holds a receive slot, and keeps the slot
until its batch is admitted to the in-flight bytes (`Admission.bytes_in_flight`). A stream
without a slot has not asked gRPC for a message: HTTP/2 flow control holds its sender to the
stream window (64 KiB, BDP probing off: `wire.limits.server_options`).

One budget covers both, counted in memory (`admission.MEMORY_PER_WIRE_BYTE` bytes per wire
byte): a slot reserves what one largest message may take, and is granted only while the
reservations and what the admitted batches (received, not yet committed) take fit in
`max_inflight_bytes`; a received batch turns its slot's reservation into its own share. So the
memory batches take, receiving or admitted, stays within the budget (before, slots and admitted
bytes were two budgets, each of wire bytes, and 24 concurrent 40 MiB batches took 4-5 times the
budget). A budget below one largest message's share still lets one stream receive at a time.

Agents keep one long-lived stream per rank and it waits for the next batch holding its slot. So
when streams wait for a slot, every `evict_after_s` the streams that have held a slot without
receiving anything for that long are ended (`IdleStream`, UNAVAILABLE: the agent reconnects and
resends, nothing is lost), at most one per waiter. While both kinds wait, freed slots alternate
between streams that have delivered a batch before (oldest waiter first) and streams that have
not (newest first): a flood of streams that never send takes at most every other slot, so it
cannot starve working agents, and agents that keep sending cannot starve a rank new to this
daemon (one failing over from a hung replica waited out a whole 7 s freeze while three busy
streams took every slot). Newest first among the new: an agent opens its stream when it has a
batch to send, so a stream that has waited long without one is more likely idle (a flood), and
a rank that just connected is not queued behind thousands of them. The trade-off is documented
in docs/reliability.md ("Memory bounded by what is in flight").

The same bookkeeping makes room under `max_ingest_streams` (`make_room`, called by
`Admission.ingest_stream` at the cap): the open streams that have received no batch yet are kept
oldest first, and a new stream at the cap ends the oldest of them that opened at least
`first_batch_s` ago, one per new stream. Only then: a stream whose first batch is slow to arrive
(a throttled link, a loaded machine) is never ended while the daemon has room for it.

Pure bookkeeping on the event loop, like `admission`.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable, Iterator

from numaudit.wire import limits


class StreamSlot:
    """One Ingest stream's place: whether it holds a slot, since when it waits for a message,
    and the event that ends it (with `why`) when its slot or its place is taken back."""

    __slots__ = ("holding", "reading_since", "batches", "evicted", "why", "opened", "_grant")

    def __init__(self) -> None:
        self.opened = time.monotonic()
        self.holding = False
        self.reading_since: float | None = None
        self.batches = 0
        self.evicted = asyncio.Event()
        self.why = ""
        """What `IdleStream` says when `evicted` is set."""
        self._grant: asyncio.Future | None = None


class ReceiveSlots:
    """`slots` streams at most receive (or hold a received, not yet admitted batch) at once;
    with `admitted` (the bytes admitted, not yet committed) and `budget`, fewer: as many largest
    messages as fit in the budget beside the admitted bytes (one at least when nothing is)."""

    def __init__(self, slots: int, evict_after_s: float = 1.0,
                 on_evict: Callable[[], None] | None = None, *,
                 budget: int | None = None, admitted: Callable[[], int] | None = None,
                 message_bytes: int = limits.MAX_MESSAGE_BYTES) -> None:
        self.slots = max(1, slots)
        self.budget = budget
        self.admitted = admitted or (lambda: 0)
        self.message_bytes = message_bytes
        self.evict_after_s = evict_after_s
        self.held = 0
        self._holders: set[StreamSlot] = set()
        self._silent: dict[StreamSlot, None] = {}
        """Open streams that have received no batch, oldest first (`make_room`)."""
        self._waiters: dict[StreamSlot, tuple[int, int]] = {}
        self._order = itertools.count()
        self._newcomer_turn = False
        """Whether the next freed slot goes to a stream that has sent nothing yet
        (`_grant_next`)."""
        self._timer: asyncio.TimerHandle | None = None
        self._on_evict = on_evict

    @classmethod
    def for_budget(cls, inflight_bytes: int, admitted: Callable[[], int] | None = None,
                   per_byte: int = 1, **kw) -> ReceiveSlots:
        """As many slots as the largest messages (`per_byte` memory bytes a wire byte) fit in
        the in-flight budget, beside the memory `admitted()` (one budget for both)."""
        message = per_byte * limits.MAX_MESSAGE_BYTES
        return cls(inflight_bytes // message, budget=inflight_bytes, admitted=admitted,
                   message_bytes=message, **kw)

    def _room(self) -> bool:
        """Whether one more stream may take a slot."""
        if self.held >= self.slots:
            return False
        if self.budget is None:
            return True
        admitted = self.admitted()
        return ((self.held == 0 and admitted == 0)
                or (self.held + 1) * self.message_bytes + admitted <= self.budget)

    def budget_freed(self) -> None:
        """Admitted bytes were committed: slots the budget now has room for go to waiters."""
        self._grant_next()

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    @contextlib.contextmanager
    def open(self, stream: StreamSlot) -> Iterator[None]:
        """The stream's life: counted as silent until its first batch, its slot given back at
        the end."""
        self._silent[stream] = None
        try:
            yield
        finally:
            self._silent.pop(stream, None)
            self.release(stream)

    def make_room(self, older_than_s: float, why: str) -> bool:
        """Ends the oldest open stream that has received no batch, if it opened at least
        `older_than_s` ago (its `next_batch` raises IdleStream(`why`)); False when none has."""
        stream = next(iter(self._silent), None)
        if stream is None or time.monotonic() - stream.opened < older_than_s:
            return False
        del self._silent[stream]
        self._end(stream, why)
        return True

    async def acquire(self, stream: StreamSlot) -> None:
        """Waits for a slot (cancellable); the stream holds it until `release`."""
        if stream.holding:
            return
        if not self._waiters and self._room():
            self._take(stream)
            return
        stream._grant = asyncio.get_running_loop().create_future()
        order = next(self._order)  # working streams oldest first, the others newest first
        self._waiters[stream] = (0, order) if stream.batches else (1, -order)
        self._arm()
        try:
            await stream._grant
        except BaseException:
            if stream._grant.done() and not stream._grant.cancelled():
                self.release(stream)  # granted just as the wait was cancelled
            raise
        finally:
            self._waiters.pop(stream, None)
            stream._grant = None

    def reading(self, stream: StreamSlot) -> None:
        """The stream, holding its slot, now waits for gRPC's next message."""
        stream.reading_since = time.monotonic()

    def received(self, stream: StreamSlot) -> None:
        stream.reading_since = None
        stream.batches += 1
        self._silent.pop(stream, None)

    def release(self, stream: StreamSlot) -> None:
        """Gives the slot back (idempotent) and hands it to the best waiter."""
        stream.reading_since = None
        if not stream.holding:
            return
        stream.holding = False
        self._holders.discard(stream)
        self.held -= 1
        self._grant_next()

    def _take(self, stream: StreamSlot) -> None:
        stream.holding = True
        self._holders.add(stream)
        self.held += 1

    def _grant_next(self) -> None:
        while self._waiters and self._room():
            stream = min(self._waiters, key=self._waiters.__getitem__)
            if self._waiters[stream][0] == 0 and self._newcomer_turn:
                newcomers = [w for w, (cls, _) in self._waiters.items() if cls == 1]
                if newcomers:
                    stream = min(newcomers, key=self._waiters.__getitem__)
            # Alternate while both kinds wait: working streams that never stop sending would
            # otherwise take every freed slot, and a rank new to this daemon (one failing
            # over from a hung replica) would wait as long as they send.
            self._newcomer_turn = self._waiters[stream][0] == 0
            del self._waiters[stream]
            if stream._grant is not None and not stream._grant.done():
                self._take(stream)
                stream._grant.set_result(None)

    def _arm(self) -> None:
        if self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self.evict_after_s, self._tick)

    def _tick(self) -> None:
        """Ends streams that hold a slot idle, one per waiter, oldest first."""
        self._timer = None
        if not self._waiters:
            return
        now = time.monotonic()
        idle = sorted((s.reading_since, id(s), s) for s in self._holders
                      if s.reading_since is not None and not s.evicted.is_set()
                      and now - s.reading_since >= self.evict_after_s)
        why = (f"Ingest: idle while {len(self._waiters)} streams wait to send; the stream is "
               "closed (reconnect to send more)")
        for _, _, stream in idle[:len(self._waiters)]:
            self._end(stream, why)
            if self._on_evict is not None:
                self._on_evict()
        self._arm()

    @staticmethod
    def _end(stream: StreamSlot, why: str) -> None:
        stream.why = why
        stream.evicted.set()
