"""What the daemon admits at once: its limits, and the counters that enforce them.

Every resource a client can make the daemon hold has a cap (docs/reliability.md, "Limits and
isolation"): open Ingest streams, Watch streams (in all and per caller), comparisons, and the bytes
of batches between receipt and commit. A call over a cap is answered RESOURCE_EXHAUSTED naming the
limit (`TooBusy`); a batch waits up to `inflight_wait_s` for bytes to free before it is refused.
An Ingest stream that sends nothing for `idle_stream_s` is ended (`IdleStream`, UNAVAILABLE: the
agent reconnects when it has something to send), so idle connections cannot pile up. At the
stream cap, a new stream takes the place of the oldest stream that has sent no batch
`first_batch_s` after it opened (`make_room`), so streams that never send cannot keep a new rank
out; below the cap no stream is ended for being slow to send its first batch.

Pure bookkeeping on the event loop: no locks, no threads.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

MEMORY_PER_WIRE_BYTE = 4
"""Memory the daemon holds per byte of a batch between receipt and commit, at its peak: gRPC's
receive buffer, the message's bytes, the parsed message, the fields handed to the store
(measured: one 40 MiB batch raised the daemon's peak RSS by 159 MiB). The in-flight budget
counts batches at this rate, so the daemon's memory, not their wire size, stays within it."""


@dataclass(frozen=True)
class ServerLimits:
    """Caps on what clients can make the daemon hold (`auditor serve --max-*` options)."""

    max_ingest_streams: int = 4096
    """Ingest streams open at once (one per rank: raise it for jobs of more ranks)."""
    max_watches: int = 64
    """Watch streams open at once, all callers together."""
    max_watches_per_caller: int = 8
    """Watch streams open at once per token (per peer host when the daemon has no tokens)."""
    max_compares: int = 8
    """Compare calls running or queued at once."""
    max_inflight_bytes: int = 512 << 20
    """Memory that batches being received, or received and not yet committed, may take, all
    streams together: each wire byte counts MEMORY_PER_WIRE_BYTE (one budget for receiving and
    admitted batches: `receive_slots`)."""
    inflight_wait_s: float = 10.0
    """How long a batch waits for in-flight bytes to free before RESOURCE_EXHAUSTED."""
    idle_stream_s: float = 600.0
    """An Ingest stream with no batch for this long is ended (0 = never)."""
    first_batch_s: float = 5.0
    """An Ingest stream that has sent no batch this long after it opened may lose its place to
    a new stream when `max_ingest_streams` are open (the oldest such stream, one per new
    stream): an agent opens its stream when it has a batch to send, so a stream that sends
    nothing holds a place for nothing (20,000 of them kept a capped daemon from admitting a new
    rank). Never while there is room: a first batch slow to arrive (a throttled link) is not cut
    off."""
    compare_budget_s: float = 300.0
    """Longest a comparison may run; its worker process is killed after (DEADLINE_EXCEEDED)."""
    compare_processes: int = 1
    """Worker processes that run comparisons (outside the daemon's process and its GIL)."""
    read_processes: int = 1
    """Worker processes that answer DescribeRun and ListRuns."""


class TooBusy(Exception):
    """A cap of `ServerLimits` is reached (RESOURCE_EXHAUSTED); the message names it."""


class IdleStream(Exception):
    """The daemon ended an Ingest stream: nothing sent for `idle_stream_s`, or its receive slot
    or its place under the cap was wanted (UNAVAILABLE, `wire.limits.ENDED_PREFIX`: reconnect to
    send more)."""


class Admission:
    """The live counts behind `ServerLimits`; use from the event loop only."""

    def __init__(self, limits: ServerLimits) -> None:
        self.limits = limits
        self.on_freed: Callable[[], None] | None = None
        """Called when admitted bytes are freed (the receive slots may then grant more)."""
        self.make_room: Callable[[float, str], bool] | None = None
        """`make_room(older_than_s, why)` ends the oldest open stream that has sent no batch
        since it opened at least `older_than_s` ago; False when there is none
        (`ReceiveSlots.make_room`)."""
        self.streams = 0
        self.watches: Counter[str] = Counter()
        self.compares = 0
        self.inflight_bytes = 0
        self._freed: asyncio.Condition | None = None

    @contextlib.contextmanager
    def ingest_stream(self) -> Iterator[None]:
        """A place under `max_ingest_streams`; at the cap, the place of a stream that has sent
        nothing `first_batch_s` after it opened (it ends: the count is over the cap by the
        streams so ended until their handlers return, on the loop's next turns)."""
        if self.streams >= self.limits.max_ingest_streams and not self._room_made():
            raise TooBusy(f"Ingest: {self.streams} streams open, the limit is "
                          f"{self.limits.max_ingest_streams} (max_ingest_streams)")
        self.streams += 1
        try:
            yield
        finally:
            self.streams -= 1

    def _room_made(self) -> bool:
        first_s = self.limits.first_batch_s
        return self.make_room is not None and self.make_room(
            first_s, f"Ingest: {self.streams} streams open, the limit (max_ingest_streams), and "
            f"this one sent nothing in the {first_s:g} s after it opened: a new stream takes its "
            "place; the stream is closed (reconnect to send)")

    @contextlib.contextmanager
    def watch(self, caller: str) -> Iterator[None]:
        total = sum(self.watches.values())
        if total >= self.limits.max_watches:
            raise TooBusy(f"Watch: {total} watches open, the limit is {self.limits.max_watches} "
                          "(max_watches)")
        if self.watches[caller] >= self.limits.max_watches_per_caller:
            raise TooBusy(f"Watch: this caller has {self.watches[caller]} watches open, the limit "
                          f"is {self.limits.max_watches_per_caller} (max_watches_per_caller)")
        self.watches[caller] += 1
        try:
            yield
        finally:
            self.watches[caller] -= 1
            if not self.watches[caller]:
                del self.watches[caller]

    @contextlib.contextmanager
    def compare(self) -> Iterator[None]:
        if self.compares >= self.limits.max_compares:
            raise TooBusy(f"Compare: {self.compares} comparisons running or queued, the limit is "
                          f"{self.limits.max_compares} (max_compares)")
        self.compares += 1
        try:
            yield
        finally:
            self.compares -= 1

    @contextlib.asynccontextmanager
    async def bytes_in_flight(self, wire_bytes: int):
        """Hold a batch of `wire_bytes` (MEMORY_PER_WIRE_BYTE each) in the in-flight budget
        while the block runs (waits for room; never does after a receive slot, whose
        reservation covered it)."""
        n = min(wire_bytes * MEMORY_PER_WIRE_BYTE,
                self.limits.max_inflight_bytes)  # one batch alone always fits
        if self._freed is None:
            self._freed = asyncio.Condition()
        fits = lambda: self.inflight_bytes + n <= self.limits.max_inflight_bytes  # noqa: E731
        if not fits():
            async with self._freed:
                try:
                    await asyncio.wait_for(self._freed.wait_for(fits), self.limits.inflight_wait_s)
                except TimeoutError:
                    raise TooBusy(f"Ingest: {self.inflight_bytes} bytes of batches in flight, the "
                                  f"limit is {self.limits.max_inflight_bytes} "
                                  "(max_inflight_bytes); retry later") from None
        self.inflight_bytes += n
        try:
            yield
        finally:
            self.inflight_bytes -= n
            if self.on_freed is not None:
                self.on_freed()
            async with self._freed:
                self._freed.notify_all()
