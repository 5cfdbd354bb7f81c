"""Digest a checkpoint into a run: every entry a ``state`` record, read in bounded memory.

The checkpoint is read as an agent would capture it: each tensor is cut into slabs of whole
rows of at most a third of the memory cap, each filled from the chunks it crosses
(`sources.plan`), mapped from the file where one chunk fills it (its pages digested where
they lie, nothing copied) or else read into one of two reused buffers, and digested by the
agent's digest (the fused kernel on CPU) as a piece of the logical tensor, at its offsets; the
records travel to an auditor daemon over the agent's own gRPC path (the daemon validates and
stores them as any agent's). So a checkpoint and a live run's `capture_state_dict` land in the
store in one form, and the comparison engine, the policies and the renderers apply unchanged.
Nothing is dropped silently: the reader waits for the daemon's acks to keep the backlog bounded,
and a record the agent could not deliver fails the read.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from numaudit.agents.agent import Agent
from numaudit.agents.capture.sites import normalize_site
from numaudit.agents.capture.state import TooDeep, expand, leaf_tensor
from numaudit.agents.config import AgentConfig, check
from numaudit.agents.identity import job_identity, rank_identity
from numaudit.agents.layout import PieceLayout
from numaudit.auditor.checkpoint.mapping import NameMap
from numaudit.auditor.checkpoint.sources import CheckpointError, Entry, Slab, Source
from numaudit.wire import limits

log = logging.getLogger(__name__)

DEFAULT_MAX_MEMORY = 256 << 20
"""Bytes of checkpoint data held at once: a third for the box being digested, a third for the
next box being read, a third for a transposed copy (a mapped conversion) and small boxes."""
SMALL_BOX_BYTES = 1 << 20
"""Boxes up to this size get their own tensor and are digested 64 at a time."""
BACKLOG_RECORDS = 2048
"""Records digested but not yet acked before the reader waits for the daemon."""
ACK_TIMEOUT_S = 300.0
RECHECK_S = 0.05
"""How long a wait for the busiest reader's acks may leave the others' unlooked at."""
MAX_READERS = 256
"""Most pieces one tensor is cut into (each needs a reader of its own: `_Readers`, an agent
with its threads; 1024 of them kept two cores busy with their own polling). Slabs of whole rows
keep the count to what the cap needs whatever the number of ranks that saved the tensor;
only rows above a third of the cap are cut within, chunk by chunk."""


@dataclass
class DigestStats:
    """What reading one checkpoint did."""

    entries: int = 0
    tensors: int = 0
    values: int = 0
    pieces: int = 0
    bytes_read: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def gb_per_s(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds > 0 else 0.0


def digest_checkpoint(source: Source, *, address: str, run: str, step: int = 0,
                      max_memory: int = DEFAULT_MAX_MEMORY, name_map: NameMap | None = None,
                      labels: dict[str, str] | None = None) -> DigestStats:
    """Read every entry of `source` into run `run` of the daemon at `address` (phase state,
    `step`); CheckpointError when the checkpoint is unreadable or a record was not stored."""
    if max_memory < 4096:
        raise CheckpointError(f"max-memory: {max_memory} bytes is too small (4096 at least)")
    box_bytes = max_memory // 3
    stats = DigestStats()
    t0 = time.perf_counter()
    entries = [(e, e.plan(box_bytes)) for e in source.entries()]
    width = max((len(plan) for _, plan in entries), default=1) or 1
    if width > MAX_READERS:
        raise CheckpointError(f"max-memory: {max_memory} bytes would cut a tensor into {width} "
                              f"pieces (at most {MAX_READERS}): raise it")
    readers = _Readers(address, run, width, labels or {}, step)
    boxes_in = _Prefetch(entries, name_map, box_bytes, stats, str(source.path))
    try:
        for piece, item, done in boxes_in:
            # a buffer's box is digested now, before the reader may fill that buffer again
            readers.add(piece, item, now=done is not None)
            item = None  # a mapped box is unmapped here, before its slot is used again
            if done is not None:
                done.release()
        summary = readers.close()
    except BaseException:
        boxes_in.stop()
        readers.abandon()
        raise
    stats.seconds = time.perf_counter() - t0
    stats.bytes_read = source.files.bytes_read
    lost = summary["dropped"] + summary["errors"] + summary["conflicts"]
    if lost or summary["acked"] != summary["captured"]:
        raise CheckpointError(
            f"run {run}: {summary['captured']} records digested, {summary['acked']} stored "
            f"(dropped {summary['dropped']}, errors {summary['errors']}, conflicts "
            f"{summary['conflicts']}): the digests are incomplete, not compared")
    return stats


class _Prefetch:
    """The boxes of every entry, read by a thread of their own one box ahead of the digest
    (file reads and the digest kernel both run without the GIL): items ``(piece index,
    capture item, slot lock or None)``. Two slots of `box_bytes` alternate, each a mapped
    range of the file or a buffer read into; a box is handed over with its slot's lock, which
    the consumer releases once the box is digested. Small boxes get tensors of their own (at
    most 64 in flight, a sixth of the memory cap in all)."""

    def __init__(self, entries: list[tuple[Entry, list[Slab]]], name_map: NameMap | None,
                 box_bytes: int, stats: DigestStats, where: str = "checkpoint") -> None:
        self.entries, self.name_map, self.box_bytes, self.stats = (entries, name_map,
                                                                   box_bytes, stats)
        self.where = where
        """The checkpoint's path, for errors."""
        self.small = min(SMALL_BOX_BYTES, max(1, box_bytes // 128))
        self.buffers = [torch.empty(0, dtype=torch.uint8) for _ in range(2)]
        self.free = [threading.Semaphore(1) for _ in range(2)]
        self.out: queue.Queue = queue.Queue(maxsize=64)
        self.named: dict[str, str] = {}
        """Site -> the checkpoint name read under it (two names mapped to one site: an error)."""
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="numaudit-ckpt-read", daemon=True)
        self.thread.start()

    def __iter__(self):
        while True:
            item = self.out.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def stop(self) -> None:
        """End the reader thread (the consumer failed)."""
        self.stopped.set()
        for lock in self.free:
            lock.release()
        while self.thread.is_alive():
            try:
                self.out.get(timeout=0.05)
            except queue.Empty:
                pass

    def _put(self, item) -> None:
        while not self.stopped.is_set():
            try:
                self.out.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        try:
            for entry, plan in self.entries:
                if self.stopped.is_set():
                    return
                self._entry(entry, plan)
            self._put(None)
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(exc)

    def _site(self, name: str) -> tuple[str, bool]:
        """(the site `name` is read as, whether the map says it is stored transposed)."""
        site, transpose = self.name_map.apply(name) if self.name_map else (name, False)
        site = normalize_site(site)
        # what the auditor would refuse, said here, naming the entry (not as a dropped record)
        if not site or len(site) > limits.MAX_SITE_CHARS or not site.isprintable():
            why = (f"{len(site)} characters, more than the {limits.MAX_SITE_CHARS} a site may "
                   "have" if len(site) > limits.MAX_SITE_CHARS else
                   "empty" if not site else "has non-printable characters")
            raise CheckpointError(f"{self.where}: entry {name[:80]!r}"
                                  f"{'...' if len(name) > 80 else ''}: its name, read as a "
                                  f"site, is {why}")
        other = self.named.setdefault(site, name)
        if other != name:
            raise CheckpointError(f"{name} and {other} are both read as {site} (the map or the "
                                  "names' normalization sends them to one name)")
        return site, transpose

    def _entry(self, entry: Entry, plan: list[Slab]) -> None:
        stats = self.stats
        stats.entries += 1
        if entry.note:
            stats.notes.append(f"{entry.name}: {entry.note}")
        if entry.load_value is not None:
            value, note = entry.load_value()
            if note:
                stats.notes.append(f"{entry.name}: {note}")
            try:
                leaves = expand(entry.name, value)  # as the live capture names them
            except TooDeep as exc:
                raise CheckpointError(f"{self.where}: {exc}") from None
            for name, leaf in leaves:
                stats.values += 1
                self._put((0, (self._site(name)[0], -1, leaf_tensor(leaf), None), None))
            return
        site, transpose = self._site(entry.name)
        if len(entry.shape) > limits.MAX_TENSOR_DIMS:
            raise CheckpointError(f"{self.where}: entry {entry.name[:80]!r}: {len(entry.shape)} "
                                  f"dims, more than the {limits.MAX_TENSOR_DIMS} the auditor "
                                  "takes")
        stats.tensors += 1
        if transpose and len(entry.shape) != 2:
            raise CheckpointError(f"{entry.name}: the map says transposed, but it has "
                                  f"{len(entry.shape)} dims (2 needed)")
        assert entry.dtype is not None
        itemsize = torch.empty((), dtype=entry.dtype).element_size()
        logical = entry.shape[::-1] if transpose else entry.shape
        for piece, slab in enumerate(plan):
            offsets, shape = slab.offsets, slab.shape
            lock = None
            if slab.numel * itemsize > self.small:
                k = stats.pieces % 2
                lock = self.free[k]
                lock.acquire()
                if self.stopped.is_set():
                    return
                t = self._fill(slab, entry.dtype, itemsize, k)
            else:
                t = self._fill(slab, entry.dtype, itemsize, None)
            if transpose:
                t, offsets, shape = t.t().contiguous(), offsets[::-1], shape[::-1]
            layout = PieceLayout(logical_shape=logical, offsets=offsets, shape=tuple(shape))
            stats.pieces += 1
            self._put((piece, (site, -1, t, layout), lock))

    def _fill(self, slab: Slab, dtype: torch.dtype, itemsize: int,
              k: int | None) -> torch.Tensor:
        """The slab's elements as a tensor of its shape: the file's mapped pages where one part
        is the whole slab and can be mapped, else read into buffer `k` (a tensor of its own
        when None): a part spanning the slab's rows whole straight into its place, any other
        (a chunk cut along another dim) read apart and copied into its box."""
        nbytes = slab.numel * itemsize
        parts = slab.parts
        if len(parts) == 1 and parts[0].count == slab.numel:
            part = parts[0]
            t = part.chunk.view(part.start, part.count) if part.chunk.view is not None \
                and k is not None else None
            if t is None:
                t = part.chunk.read(part.start, part.count, self._buffer(k, nbytes))
            return t.reshape(slab.shape)
        buf = self._buffer(k, nbytes)
        out = (buf[:nbytes] if buf is not None else torch.empty(nbytes, dtype=torch.uint8)
               ).view(dtype)
        whole = out.reshape(slab.shape)
        inner = math.prod(slab.shape[1:])
        for part in parts:
            if part.shape[1:] == slab.shape[1:]:  # whole rows: contiguous in the slab
                at = part.offsets[0] * inner
                dst = out[at:at + part.count]
                got = part.chunk.read(part.start, part.count, dst.view(torch.uint8))
                if got.data_ptr() != dst.data_ptr():  # a chunk loaded whole hands a slice
                    dst.copy_(got)
            else:
                box = tuple(slice(o, o + n) for o, n in zip(part.offsets, part.shape))
                whole[box].copy_(part.chunk.read(part.start, part.count, None)
                                 .reshape(part.shape))
        return whole

    def _buffer(self, k: int | None, nbytes: int) -> torch.Tensor | None:
        """Buffer `k`, grown to hold `nbytes` (None for None: the read makes its own)."""
        if k is None:
            return None
        if self.buffers[k].numel() < nbytes:
            self.buffers[k] = torch.empty(max(nbytes, min(self.box_bytes, 4 * nbytes)),
                                          dtype=torch.uint8)
        return self.buffers[k]


class _Readers:
    """One agent per piece index: the store keeps one record per (key, rank), so the k-th piece
    of every entry is sent as rank k of a job of `width` ranks (the report's "ranks" of a
    checkpoint are these readers). Agents are made when first needed."""

    def __init__(self, address: str, run: str, width: int, labels: dict[str, str],
                 step: int) -> None:
        self.address, self.run, self.width, self.step = address, run, width, step
        self.labels = dict(labels, checkpoint_readers=str(width))
        self.job_id = f"checkpoint-{run}-{time.time_ns()}"
        self.agents: list[Agent | None] = [None] * width
        self.pending: list[list] = [[] for _ in range(width)]

    def add(self, k: int, item: tuple, *, now: bool = False) -> None:
        self.pending[k].append(item)
        if now or len(self.pending[k]) >= 64:
            self._capture(k)

    def _agent(self, k: int) -> Agent:
        agent = self.agents[k]
        if agent is None:
            cfg = AgentConfig(address=self.address, run=self.run, phases=("state",),
                              spool_mode="off", queue_records=1 << 30,
                              max_unacked_bytes=1 << 40, flush_timeout_s=ACK_TIMEOUT_S,
                              batch_interval_s=0.005)
            check(cfg)
            ident = rank_identity(None, dp_rank=0, dp_size=1)
            ident.rank, ident.world_size, ident.local_rank = k, self.width, k
            ident.labels = dict(self.labels)
            ident.job_id, ident.job_id_source = job_identity(self.job_id)
            agent = self.agents[k] = Agent(cfg, ident)
        return agent

    def _capture(self, k: int) -> None:
        items = self.pending[k]
        if not items:
            return
        agent = self._agent(k)
        with agent.capturer.at_step(self.step):
            agent.capturer.capture_values(list(items), phase="state")
        items.clear()
        self._wait(BACKLOG_RECORDS)

    def _wait(self, keep: int) -> None:
        """Wait until at most `keep` records are digested and not yet acked (bounded memory):
        woken by the acks of the reader holding the most (`Agent.wait_for_acks`), looking at
        the others at least every `RECHECK_S`."""
        deadline = time.monotonic() + ACK_TIMEOUT_S
        last = -1
        while True:
            logs = [(a, a.backlog()) for a in self.agents if a is not None]
            acked = sum(b.acked for _, b in logs)
            behind = sum(b.waiting for _, b in logs)
            if behind <= keep:
                return
            if acked != last:
                last, deadline = acked, time.monotonic() + ACK_TIMEOUT_S
            elif time.monotonic() > deadline:
                raise CheckpointError(f"the auditor acked nothing for {ACK_TIMEOUT_S:.0f} s "
                                      f"({behind} records waiting)")
            agent, most = max(logs, key=lambda ab: ab[1].waiting)
            agent.wait_for_acks(most.acked, RECHECK_S)

    def close(self) -> dict:
        """Flush every reader and close them; the summed counts."""
        for k in range(self.width):
            self._capture(k)
        total = {"captured": 0, "acked": 0, "dropped": 0, "errors": 0, "conflicts": 0}
        agents = [a for a in self.agents if a is not None]
        # in parallel: each close waits for its acks and its session's close
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(agents)))) as pool:
            for s in pool.map(lambda a: a.close(timeout=ACK_TIMEOUT_S), agents):
                for name in total:
                    total[name] += s[name]
        return total

    def abandon(self) -> None:
        for agent in self.agents:
            if agent is not None:
                agent.close(timeout=1.0)
