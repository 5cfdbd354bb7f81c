"""Captures and their batches: what a hook hands over, digested in one call per hook, and
delivered to the sender a batch of rows at a time.

:class:`Batcher` owns the captures queued by the running hook (or parameter sweep) and the batch
their rows go to. :meth:`Batcher.drain` digests the queue in one call before the hook returns
(agents/digest/fastpath.py): pieces the fused kernel takes are written straight into the host
batch's row buffers (agents/digest/rows.py), rows computed on an accelerator are kept apart and sent
to the host in one asynchronous copy per batch. :meth:`Batcher.flush` hands both to the sink (the
sender) as :class:`HostBatch` es. Nothing here raises into training: failures go to the
capturer's ``failed`` callback, which counts and logs them.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from numaudit.agents.config import AgentConfig
from numaudit.agents.digest.digest import digest_batch_to_host
from numaudit.agents.digest.fastpath import Digester
from numaudit.agents.digest.rows import I64_COLUMNS, RowBatch
from numaudit.agents.digest.sample_digest import SAMPLE_PHASES, SampleDigests, combine_units
from numaudit.agents.layout import PieceLayout

I64_ROW_BYTES = 8 * I64_COLUMNS

MAX_BATCH_ROWS = 1024
"""Host rows per batch at most (2 MiB at k = 256), whatever `device_batch` says."""
ARENA_BYTES = 256 << 10
"""Size of the host buffers that small payloads are cut from (see Batcher.payload_buffer)."""
ARENA_MAX_PIECE = 16 << 10
"""Payloads up to this size come from an arena; larger ones get their own tensor."""


_CAPTURE_ORDER = itertools.count(1)
"""The next capture's number (`Capture.order`): one clock for the process, so that the
captures of each agent in it are numbered in the order they were made (with gaps where another
agent of the process captured in between). ``next`` on it is one C call, atomic under the GIL."""


@dataclass(slots=True)
class Capture:
    """Host-side metadata of one captured piece; its digest rows travel in the HostBatch.

    Made on the training thread when the hook (or ``capture()`` call, or parameter sweep)
    takes the piece, so `order` numbers captures in the order the hooks fired, whatever path
    they take afterwards (fused or eager digest, host or accelerator rows, with a payload in
    chunks or without)."""

    step: int
    microbatch: int
    phase: int
    site: str
    role: int
    index: int
    call: int
    stage: int
    layout: PieceLayout | None
    dtype: str
    is_none: bool = False
    moments: bool = True
    complex_as_real: bool = False
    row: int = -1
    """Row of this capture's digest in the batch's tensors; -1 for None captures."""
    payload: torch.Tensor | memoryview | None = None
    """A host copy of the piece when its bytes travel too (its C-order bytes as a memoryview
    when the fused kernel copied them into a payload arena)."""
    samples: SampleDigests | None = None
    """Digests of the piece's samples (agents/digest/sample_digest.py), for batch-holding captures;
    on the host once the batch's `HostBatch.wait` returned."""
    order: int = field(default_factory=_CAPTURE_ORDER.__next__)
    """Execution order (`Record.capture_order`): numbered when the capture is made."""


FusedItem = tuple[Capture, bytes, torch.Tensor]
"""A piece queued for the fused kernel (`Batcher.fused`): its Capture, its descriptor
(agents/kernels/cpu.py ``descriptor``: built from the capturer's cached plan,
agents/capture/fused_plans.py) and the tensor, held until the kernel has read it. A plain tuple,
not a NamedTuple: one is made per capture on the fast path, where a NamedTuple's constructor
would be a Python call."""


@dataclass
class HostBatch:
    """Captures whose digests were stacked and sent to the host in one transfer."""

    captures: list[Capture]
    f64: torch.Tensor | None
    i64: torch.Tensor | None
    ready: torch.cuda.Event | None = None
    """A CUDA event to synchronize on before reading f64/i64; None on CPU."""

    def wait(self) -> None:
        if self.ready is not None:
            self.ready.synchronize()


class CountsSnapshot(NamedTuple):
    """The agent's counts at one moment (`Counters.snapshot`), read together under the lock."""

    captured: int
    """Captures made (records digested or recorded as None)."""
    errors: int
    """Failures counted instead of raised into training."""
    dropped: dict[str, int]
    """Records dropped, by reason."""


class Counters:
    """Thread-safe counts the agent reports at close."""

    def __init__(self) -> None:
        # Re-entrant: a SIGTERM handler may close the agent on the training thread while that
        # thread is inside one of these methods.
        self._lock = threading.RLock()
        self.captured = 0
        self.errors = 0
        self.dropped: Counter[str] = Counter()
        self.not_captured: Counter[str] = Counter()
        """Captures that could not be made at all, by reason (not part of `captured`)."""

    def add_captured(self, n: int) -> None:
        """Unlocked: the capturer is the one writer (it is not thread-safe in any case), and a
        lock per capture was a measurable share of a capture's cost."""
        self.captured += n

    def drop(self, reason: str, n: int) -> None:
        if n:
            with self._lock:
                self.dropped[reason] += n

    def error(self) -> None:
        with self._lock:
            self.errors += 1

    def miss(self, reason: str, n: int = 1) -> None:
        with self._lock:
            self.not_captured[reason] += n

    def not_captured_snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.not_captured)

    def snapshot(self) -> CountsSnapshot:
        with self._lock:
            return CountsSnapshot(self.captured, self.errors, dict(self.dropped))


class Batcher:
    """The pending captures of one hook and the batches their digests go to (one per rank,
    owned by the training thread)."""

    def __init__(self, digester: Digester, config: AgentConfig, sink: Callable[[HostBatch], None],
                 counters: Counters, failed: Callable[[str, Exception], None], *,
                 batch_dims: dict[tuple[str, int], int] | None = None) -> None:
        self._digester = digester
        self._samples_on = config.sample_digests
        self.rows: int | None = config.microbatch_size
        """This rank's samples in the running microbatch, where the capturer knows them (its
        model's input): pieces holding another number of rows along their batch dim (an
        expert's tokens) get no sample digests; None: every batch-holding piece does."""
        self._batch_dim = config.batch_dim
        self._batch_dims = batch_dims if batch_dims is not None else {}
        """(site, output index) -> its batch dim where a module states one (the capturer's
        own dict, filled as it hooks modules); `config.batch_dim` elsewhere."""
        self._sketch_k = config.sketch_k
        self._batch = min(config.device_batch, MAX_BATCH_ROWS)
        self._sink = sink
        self._counters = counters
        self._failed = failed
        self._pending: list[tuple[Capture, torch.Tensor, PieceLayout, int | None]] = []
        """Pieces for Digester.digest (the general path)."""
        self.fused: list[FusedItem] = []
        """Pieces for the fused kernel, queued by the capturer (agents/capture/fused_plans.py
        ``capture_fast``, ``split_fast``)."""
        self._kernel = digester.kernel()
        self._captures: list[Capture] = []
        """Captures of the host batch being filled (their rows in `_rows`; None captures)."""
        self._rows: RowBatch | None = None
        self._dev_captures: list[Capture] = []
        """Captures whose rows are on an accelerator (`_dev_f64`, `_dev_i64`)."""
        self._dev_f64: list[torch.Tensor] = []
        self._dev_i64: list[torch.Tensor] = []
        self._arena: memoryview | None = None
        self._arena_at = 0
        """Address of the arena's first byte."""
        self._arena_used = ARENA_BYTES

    def unsent(self) -> int:
        """Captures taken but not handed to the sink yet (read from another thread only when
        the training thread is known to be blocked: agents/shutdown.py)."""
        return (len(self._pending) + len(self.fused) + len(self._captures)
                + len(self._dev_captures))

    def payload_buffer(self, nbytes: int) -> tuple[torch.Tensor | memoryview, int]:
        """A host buffer of ``nbytes`` for the fused kernel to copy a payload into, and its
        address. Small ones are slices of a shared arena: a ``torch.empty`` per payload cost
        ~15 us in a training step (~130 payloads a step at scale 1 of the DS3-style model);
        a slice keeps its arena alive until the sender has read it."""
        if nbytes > ARENA_MAX_PIECE:
            t = torch.empty(nbytes, dtype=torch.uint8)
            return t, t.data_ptr()
        start = self._arena_used
        arena = self._arena
        if arena is None or start + nbytes > ARENA_BYTES:  # None: the first, _arena_used full
            buf = bytearray(ARENA_BYTES)
            self._arena = arena = memoryview(buf)
            self._arena_at = ctypes.addressof(ctypes.c_char.from_buffer(buf))
            start = 0
        self._arena_used = (start + nbytes + 63) & ~63
        return arena[start:start + nbytes], self._arena_at + start

    def add(self, cap: Capture, t: torch.Tensor, layout: PieceLayout,
            payload_at: int | None) -> None:
        """Queue a piece for the next :meth:`drain` (``payload_at``: see fastpath.Piece)."""
        self._pending.append((cap, t, layout, payload_at))

    def add_none(self, cap: Capture) -> None:
        """A capture without a tensor (None, recorded as such): no digest, no row."""
        self._captures.append(cap)

    def drain(self) -> None:
        """Digest the pending captures (one kernel call for the fused ones) and queue their
        rows. Never raises.

        The usual case (only fused pieces, room in the open batch) is one kernel call from
        here: each level of calls between a hook and the kernel cost a microsecond or two in a
        training step, where Python runs with cold caches, for ~800 captures a step at scale 1
        of the DS3-style model.
        """
        fused = self.fused
        rows = self._rows
        if (self._pending or not fused or rows is None
                or rows.capacity - rows.n < len(fused)):
            self._drain_slow()
            return
        self.fused = []
        self._drain_fused(fused, rows)
        if self._samples_on:
            self._sample_digests([(f[0], f[2]) for f in fused if f[0].phase in SAMPLE_PHASES])
        if rows.n >= self._batch:
            self.flush()

    def _drain_slow(self) -> None:
        pending, fused = self._pending, self.fused
        if not pending and not fused:
            return
        self._pending, self.fused = [], []
        rows = self._rows
        if rows is None or rows.room() < len(pending) + len(fused):
            self._flush_host()
            try:
                rows = self._rows = RowBatch(max(len(pending) + len(fused), self._batch),
                                             self._sketch_k)
            except Exception as exc:  # out of memory
                for cap, *_ in pending + fused:
                    self._failed(f"capture of {cap.site}", exc)
                return
        if fused:
            self._drain_fused(fused, rows)
        if pending:
            self._drain_general(pending, rows)
        if self._samples_on:
            self._sample_digests([(f[0], f[2]) for f in fused if f[0].phase in SAMPLE_PHASES]
                                 + [(p[0], p[1]) for p in pending if p[0].phase in SAMPLE_PHASES])
        if rows.n >= self._batch or len(self._dev_f64) >= self._batch:
            self.flush()

    def _drain_fused(self, fused: list, rows: RowBatch) -> None:
        """One kernel call for ``fused`` into the next rows of ``rows`` (which has room)."""
        m = len(fused)
        first = rows.n
        rows.n = first + m
        try:
            bad = self._kernel(m, fused[0][1] if m == 1 else b"".join([f[1] for f in fused]),
                               self._sketch_k, rows.f64_ptr + first * rows.f64_row_bytes,
                               rows.i64_ptr + first * I64_ROW_BYTES)
            if bad:
                raise RuntimeError(f"pieces[{bad - 1}]: descriptor rejected by the kernel")
        except Exception as exc:
            for cap, *_ in fused:
                self._failed(f"capture of {cap.site}", exc)
            return
        captures = self._captures
        for j, f in enumerate(fused):
            cap = f[0]
            cap.row = first + j
            captures.append(cap)

    def _sample_digests(self, items: list[tuple[Capture, torch.Tensor]]) -> None:
        """Digest the samples of the batch-holding captures among ``items`` (agents/digest/
        sample_digest.py) into their `Capture.samples`: each capture's plan from the digester's
        cache, one kernel call per bucket count for all fused ones. A capture whose main digest
        failed (row -1) gets none. Never raises: a failure costs a capture its sample digests."""
        digester, dims, default = self._digester, self._batch_dims, self._batch_dim
        todo = []
        for cap, t in items:
            # an operation's capture (agents/capture/ops.py): its keys are compared in the
            # grouping both runs captured, no samples
            if cap.row < 0 or "/" in cap.site:
                continue
            layout = cap.layout
            if layout is None:  # no layout, no sample digests (plan_samples: None)
                continue
            try:
                plan = digester.sample_plan(t, layout, dims.get((cap.site, cap.index),
                                                                    default) if dims else
                                            default, cap.phase)
            except Exception as exc:
                self._failed(f"sample digests of {cap.site}", exc)
                continue
            if plan is not None and (self.rows is None or plan.count == self.rows):
                todo.append((cap, plan, t))
        if not todo:
            return
        try:
            results = digester.digest_planned([(plan, t) for _, plan, t in todo])
        except Exception as exc:
            self._failed("sample digests", exc)
            return
        for (cap, plan, _t), res in zip(todo, results):
            if isinstance(res, Exception):
                self._failed(f"sample digests of {cap.site}", res)
                continue
            try:
                f64, fp = combine_units(res[0], res[1], plan.unit, plan.numel_s, plan.k)
                cap.samples = SampleDigests(plan.dim, plan.unit, plan.count, plan.k, f64, fp)
            except Exception as exc:
                self._failed(f"sample digests of {cap.site}", exc)

    def _drain_general(self, pending: list, rows: RowBatch) -> None:
        try:
            results = self._digester.digest([p[1:] for p in pending], self._sketch_k, rows)
        except Exception as exc:
            for cap, *_ in pending:
                self._failed(f"capture of {cap.site}", exc)
            return
        for (cap, *_), res in zip(pending, results):
            if type(res) is int:
                cap.row = res
                self._captures.append(cap)
            elif isinstance(res, Exception):
                self._failed(f"capture of {cap.site}", res)
            else:  # rows on an accelerator
                cap.row = len(self._dev_f64)
                self._dev_f64.append(res[0])
                self._dev_i64.append(res[1])
                self._dev_captures.append(cap)

    def flush(self) -> None:
        """Hand the pending digests to the sink: the host batch as it is, and the rows kept on
        an accelerator after starting their one transfer to the host."""
        self.drain()
        self._flush_host()
        if not self._dev_captures:
            return
        captures, f64, i64 = self._dev_captures, self._dev_f64, self._dev_i64
        self._dev_captures, self._dev_f64, self._dev_i64 = [], [], []
        try:
            samples_to_host([c.samples for c in captures if c.samples is not None])
            host_f64, host_i64, event = digest_batch_to_host(f64, i64)
            self._sink(HostBatch(captures, host_f64, host_i64, event))
        except Exception as exc:
            self._counters.drop("transfer_error", len(captures))
            self._failed("host transfer", exc)

    def _flush_host(self) -> None:
        captures, rows = self._captures, self._rows
        self._captures, self._rows = [], None
        if not captures:
            return
        try:
            f64, i64 = rows.rows() if rows is not None and rows.n else (None, None)
            self._sink(HostBatch(captures, f64, i64, None))
        except Exception as exc:
            self._counters.drop("transfer_error", len(captures))
            self._failed("host transfer", exc)


def samples_to_host(samples: list[SampleDigests]) -> None:
    """Start the one copy of these sample digests' accelerator rows to the host, and point each
    at its host rows. On CUDA the copy is asynchronous into pinned memory, on the stream that
    `digest_batch_to_host` then records its event on: waiting for that event (`HostBatch.wait`)
    covers these rows too. Other accelerators copy synchronously."""
    # (digests, f64, fingerprint): both tensors, or both numpy arrays (combine_units)
    dev = [(s, s.f64, s.fingerprint) for s in samples if isinstance(s.f64, torch.Tensor)
           and isinstance(s.fingerprint, torch.Tensor) and not s.f64.is_cpu]
    if not dev:
        return
    flat_f64 = torch.cat([f64.reshape(-1) for _, f64, _ in dev])
    flat_i64 = torch.cat([fp.reshape(-1) for _, _, fp in dev])
    if flat_f64.device.type == "cuda":
        host_f64 = torch.empty(flat_f64.shape, dtype=flat_f64.dtype, pin_memory=True)
        host_i64 = torch.empty(flat_i64.shape, dtype=flat_i64.dtype, pin_memory=True)
        host_f64.copy_(flat_f64, non_blocking=True)
        host_i64.copy_(flat_i64, non_blocking=True)
    else:
        host_f64, host_i64 = flat_f64.cpu(), flat_i64.cpu()
    a = b = 0
    for s, f64, _ in dev:
        g, width = f64.shape
        s.f64 = host_f64[a:a + g * width].view(g, width)
        s.fingerprint = host_i64[b:b + g]
        a += g * width
        b += g
